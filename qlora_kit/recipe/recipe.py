"""The typed recipe: one pydantic section per pipeline stage, YAML loading and dotted ``--set`` overrides.

A recipe is the single source of truth for a run. Every field has a type, a default and a docstring;
unknown keys are errors; impossible combinations are rejected with the field named. YAML files hold
only the values that differ from these defaults.

    recipe = Recipe.from_yaml("recipes/demo.yaml", overrides=["lora.rank=16"])

Paths in a recipe (``model.path``, ``data.path``, ``data.val_path``) are resolved relative to the recipe
file, so a recipe runs the same from any working directory. ``builtin:`` names refer to the embedded
demo model and data (see ``builtin.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from qlora_kit.errors import RecipeError
from qlora_kit.recipe import overrides as overrides_
from qlora_kit.recipe.base import Section, describe_validation_error, one_line
from qlora_kit.recipe.data import DataSection
from qlora_kit.recipe.grpo import GrpoSection
from qlora_kit.recipe.memory import MemorySection
from qlora_kit.recipe.objective_rules import check_objective
from qlora_kit.recipe.paths import data_paths, is_local_path, path_fields, resolve_paths
from qlora_kit.recipe.preference import PreferenceSection

# The two extension points are registries the recipe reads its choices from (both import nothing of
# ours and nothing heavy): adding an optimizer or a data format is one entry there.
from qlora_kit.registries import attention
from qlora_kit.registries.objectives import OBJECTIVES
from qlora_kit.registries.optimizers import OPTIMIZERS

__all__ = ["DataSection", "MemorySection", "Recipe", "RecipeError", "Section"]

OptimizerName = Literal[tuple(OPTIMIZERS)]  # type: ignore[valid-type]


class ModelSection(Section):
    path: str = "builtin:tiny-llama"
    """Base model: a local directory, a hub id, or builtin:tiny-llama (or another of builtin.TINY_ARCHITECTURES)."""
    trust_remote_code: bool = False
    """Run modelling code shipped with the checkpoint. Off unless you trust its author."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids; ignored for local directories."""
    adapter: str | None = None
    """A trained adapter folder to start from (a qlora-kit train output): train.objective dpo tunes the SFT adapter and keeps it, frozen, as the reference; sft continues training it."""
    attn_implementation: str = "auto"
    """Attention kernel: auto (sdpa where the model supports it, else eager), sdpa, eager, flex_attention, flash_attention_2, flash_attention_3, or a kernels-hub id."""
    max_pixels: int | None = Field(default=None, gt=0)
    """Qwen-VL (dynamic resolution): the most pixels an image is resized to, bounding its tokens (pixels / 784); None: the processor's own (Qwen2.5-VL's 12,845,056)."""

    @field_validator("adapter")
    @classmethod
    def _absolute_adapter(cls, value: str | None) -> str | None:
        # an override's relative path means the working directory's (a recipe file's was resolved against
        # its folder already): the run's saved recipe must name the same folder from anywhere
        return None if value is None else str(Path(value).expanduser().absolute())

    @model_validator(mode="after")
    def _check_attention(self) -> ModelSection:
        attention.kernel(self.attn_implementation)  # a ValueError naming the field for an unknown name
        return self


class QuantSection(Section):
    bits: Literal[4, 16] = 4
    """4: the base's linear weights in 4 bits (QLoRA); 16: the base in compute_dtype (plain LoRA, for comparison)."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type for the frozen linear weights (NF4 is the QLoRA paper's)."""
    double_quant: bool = True
    """Quantize the per-block absmax scales again (saves ~0.37 bits per parameter)."""
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the 4-bit weights are dequantized to for each matmul; also the dtype of unquantized layers."""
    quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = "uint8"
    """Container dtype of the packed 4-bit weights; FSDP needs it equal to compute_dtype."""
    vision: bool = False
    """On a vision-language model, the vision tower and the projector in 4 bits too; by default they stay in compute_dtype (docs: vlm.md)."""

    FOUR_BIT_ONLY: ClassVar[tuple[str, ...]] = ("double_quant", "quant_type", "quant_storage", "vision")

    @model_validator(mode="after")
    def _check_bits(self) -> QuantSection:
        if self.bits == 16:
            # from values, not from which fields were set: a run's recipe.yaml writes every field, defaults too
            for name in self.FOUR_BIT_ONLY:
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"quant.{name}: only applies to 4-bit weights (quant.bits is 16)")
        return self


class LoraSection(Section):
    rank: int = Field(16, gt=0)
    """LoRA rank r: inner dimension of the A (r x in) and B (out x r) matrices."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the update is (alpha / r) * B @ A, or alpha / sqrt(r) with rslora."""
    dropout: float | Literal["auto"] = "auto"
    """Dropout on the LoRA branch's input; auto: 0.05, or 0 on a mixture of experts whose experts get LoRA (peft's LoRA on fused experts takes none)."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Which linear layers get adapters: all-linear (every linear but the output head) or a list of names."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train alongside the adapters."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023)."""
    dora: bool = False
    """Weight-decomposed LoRA (Liu et al. 2024): trains a magnitude vector too; slower."""
    init: Literal["default", "gaussian", "pissa", "olora"] = "default"
    """Adapter initialisation passed to peft (default: A Kaiming-uniform, B zero)."""
    experts: bool = True
    """On a mixture-of-experts model, LoRA on every expert too (their fused weights, in low-rank form; needs dropout 0); false leaves the experts frozen."""
    vision: bool = False
    """On a vision-language model, LoRA on the vision tower and the projector too; by default only the language model adapts."""
    router: bool = False
    """On a mixture-of-experts model, train each layer's router too (whole: a small experts x hidden matrix, in the compute dtype, saved in the adapter as peft's modules_to_save); frozen by default (docs: moe.md)."""

    AUTO_DROPOUT: ClassVar[float] = 0.05  # what lora.dropout auto is wherever dropout can apply

    @field_validator("dropout")
    @classmethod
    def _check_dropout(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 <= value < 1:
            raise ValueError(f"must be >= 0 and < 1, or auto (got {value})")
        return value

    def dropout_for(self, experts_get_lora: bool) -> float:
        """The dropout a model gets: ``experts_get_lora`` when it is a mixture whose fused experts take
        LoRA (lora.experts on), where peft allows none, so auto resolves to 0 for the whole adapter (one
        adapter config holds one dropout, and plain peft must load it back)."""
        if self.dropout != "auto":
            return self.dropout
        return 0.0 if experts_get_lora else self.AUTO_DROPOUT


class OptimizerSection(Section):
    name: OptimizerName = "paged_adamw_8bit"
    """Optimizer: bitsandbytes paged/8-bit AdamW variants, or torch's AdamW."""
    lr: float = Field(2e-4, gt=0)
    """Peak learning rate."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup."""
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    """Fraction of the training steps spent warming the learning rate up from 0."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay on the LoRA matrices."""
    max_grad_norm: float = Field(0.3, ge=0)
    """Clip the global gradient norm to this (0 disables clipping); 0.3 is the QLoRA paper's value."""


class TrainSection(Section):
    output_dir: str = "outputs/run"
    """Where the adapter, tokenizer, metrics and checkpoints are written."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training data (ignored when max_steps is set)."""
    max_steps: int | None = Field(None, gt=0)
    """Stop after this many optimizer steps."""
    micro_batch_size: int = Field(4, gt=0)
    """Examples per forward pass; with data.packing, packed rows of up to data.max_seq_len tokens."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches accumulated per optimizer step."""
    logging_steps: int = Field(10, gt=0)
    """Log loss and learning rate every this many steps."""
    eval_steps: int | None = Field(None, gt=0)
    """Evaluate on the validation set every this many steps (and before the first step)."""
    save_steps: int | None = Field(None, gt=0)
    """Write a checkpoint every this many steps."""
    seed: int = 42
    """Seed for initialisation, dropout and data order."""
    sample_prompts: int = Field(0, ge=0)
    """After training, print this many validation prompts answered before and after fine-tuning."""
    objective: Literal[tuple(OBJECTIVES)] = "sft"  # type: ignore[valid-type]
    """sft: supervised fine-tuning on responses; dpo: preference tuning on chosen/rejected pairs (the preference section, TRL's DPOTrainer); grpo: reinforcement learning from rewards a program checks (the grpo section, TRL's GRPOTrainer)."""
    fsdp: bool = False
    """The run shards the 4-bit model with FSDP (launched by accelerate with an FSDP config)."""
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = "auto"
    """Autocast of the forward pass: auto (on a GPU: bf16, or fp16 for compute_dtype float16; no on a CPU), bf16, fp16 (GPU only, with a gradient scaler) or no."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer (one graph for all, inductor): faster steps after a one-off compile; auto: on when a timed step and compile show the planned steps repay it (logged with its figures)."""
    keep_best: str | None = None
    """Keep the adapter of the best evaluation as the final output: eval_loss, or another metric evaluation logs (lower is better for names ending in loss)."""
    early_stopping_patience: int | None = Field(None, gt=0)
    """Stop after this many evaluations without improvement of train.keep_best (eval_loss when unset)."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"]
    )
    """Experiment trackers the run logs to: tensorboard (in the output folder), wandb, mlflow, trackio (each an extra: pip install 'qlora-kit[wandb]'); [] for none."""
    run_name: str | None = None
    """The run's name in the trackers (default: the output folder's name)."""
    project: str = "qlora-kit"
    """The project (W&B, trackio) or experiment (MLflow) the run is logged under, unless their environment variables say otherwise."""
    on_oom: Literal["split", "stop"] = "split"
    """Out of memory in a step: split: redo the step with each micro-batch in twice the parts (same examples, global batch and schedule; kept for the rest of the run and in checkpoints; GRPO: its generate calls too); stop: stop with one line."""
    probe_worst_batch: bool | Literal["auto"] = "auto"
    """Before step 1, run forward and backward on the longest micro-batch (and evaluate the largest batch), then discard it all: an out-of-memory error comes in the first minute; auto: on a GPU (GRPO: rollouts of the longest prompts to max_completion_length, then their policy step; DPO never probes)."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak dense TFLOPS of one device, for the MFU in metrics.jsonl (common GPUs are known; a CPU has none)."""


class Recipe(Section):
    """A whole fine-tuning run."""

    model: ModelSection = ModelSection()
    quant: QuantSection = QuantSection()
    lora: LoraSection = LoraSection()
    memory: MemorySection = MemorySection()
    optimizer: OptimizerSection = OptimizerSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    preference: PreferenceSection = PreferenceSection()
    grpo: GrpoSection = GrpoSection()

    @model_validator(mode="after")
    def _check_combinations(self) -> Recipe:
        if self.train.eval_steps is not None and not self.has_validation_data:
            raise ValueError(
                "train.eval_steps: needs validation data (set data.val_path or data.val_fraction)"
            )
        self._check_best_and_stopping()
        if self.train.fsdp and self.quant.bits == 4 and self.quant.quant_storage != self.quant.compute_dtype:
            raise ValueError(
                f"quant.quant_storage: must equal quant.compute_dtype ({self.quant.compute_dtype}) with train.fsdp "
                f"(got {self.quant.quant_storage}): the FSDP-QLoRA setting peft and accelerate document (FSDP1 "
                "shards flat tensors of one dtype) and the one qlora_kit tests under FSDP2"
            )
        if self.train.fsdp and self.memory.experts_on_host is True:
            raise ValueError("memory.experts_on_host: not with train.fsdp (FSDP shards the experts instead)")
        if self.train.fsdp and not OPTIMIZERS[self.optimizer.name].shards:
            raise ValueError(
                f"optimizer.name: {self.optimizer.name} cannot step FSDP2's sharded parameters (bitsandbytes' "
                "update kernels have no DTensor sharding rule); use adamw_torch with train.fsdp (LoRA's "
                "optimizer state is small, and FSDP shards it across the GPUs)"
            )
        autocast = {"bf16": "bfloat16", "fp16": "float16"}.get(self.train.mixed_precision)
        if autocast and self.quant.compute_dtype not in (autocast, "float32"):
            raise ValueError(
                f"train.mixed_precision: {self.train.mixed_precision} autocast with quant.compute_dtype "
                f"{self.quant.compute_dtype} casts every layer twice; use {autocast} for both (or auto)"
            )
        if self.quant.bits == 4 and self.lora.init in ("pissa", "olora"):
            raise ValueError(
                f"lora.init: {self.lora.init} needs full-precision base weights (it subtracts the adapter's "
                "start from them): peft's PiSSA refuses 4-bit storage and OLoRA quantizes the weights a second "
                "time, so the adapter no longer fits your base; use default or gaussian, or quant.bits: 16"
            )
        if self.lora.dora and self.lora.init in ("pissa", "olora"):
            raise ValueError(f"lora.init: {self.lora.init} cannot be combined with lora.dora")
        self._check_attention_kernel()
        check_objective(self)  # objective_rules.py
        return self

    def _check_best_and_stopping(self) -> None:
        train = self.train
        field = "train.keep_best" if train.keep_best else "train.early_stopping_patience"
        if (train.keep_best or train.early_stopping_patience) and train.eval_steps is None:
            raise ValueError(f"{field}: needs train.eval_steps (the evaluations it compares)")
        if train.keep_best is None:
            return
        if not train.save_steps or train.save_steps % train.eval_steps:
            raise ValueError(
                f"train.save_steps: must be a multiple of train.eval_steps ({train.eval_steps}) with "
                f"train.keep_best, so that every evaluation that may be the best has its checkpoint (got {train.save_steps})"
            )
        if train.fsdp:
            raise ValueError(
                "train.keep_best: not with train.fsdp yet (loading the best sharded checkpoint is untested)"
            )

    def _check_attention_kernel(self) -> None:
        kernel = attention.kernel(self.model.attn_implementation)
        if kernel.half_precision and self.quant.compute_dtype == "float32":
            raise ValueError(
                f"quant.compute_dtype: {kernel.name} computes in bfloat16 or float16 only (got float32)"
            )
        if self.data.packing is True and kernel.packing is None:
            raise ValueError(
                f"data.packing: cannot tell whether {kernel.name} keeps packed examples apart (only sdpa, eager, "
                "flex_attention and flash kernels are known to); set data.packing: false"
            )

    @property
    def has_validation_data(self) -> bool:
        return (
            self.data.val_path is not None
            or self.data.val_fraction > 0
            or any(source.path.startswith("builtin:") for source in self.data.source_list())
        )

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | dict[str, Any] | None = None) -> Recipe:
        """Load a YAML recipe, apply dotted overrides, resolve relative paths against the file's folder."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeError(f"{path}: cannot read recipe ({exc.__class__.__name__}: {exc})") from None
        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML ({one_line(str(exc))})") from None
        if not isinstance(values, dict):
            raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(values).__name__}")
        resolve_paths(values, path.parent)
        return cls.from_dict(values, overrides)

    @classmethod
    def from_dict(cls, values: dict[str, Any], overrides: list[str] | dict[str, Any] | None = None) -> Recipe:
        values = apply_overrides(values, overrides or [])
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise RecipeError(describe_validation_error(exc)) from None

    def input_paths(self) -> list[tuple[str, str]]:
        """Every path the recipe reads, as (field, value): the one list that the path checks, the output
        folder's refusal, the manifest's data hashes and the hub's checks all read."""
        return self._model_paths() + data_paths(self.data)

    def _model_paths(self) -> list[tuple[str, str]]:
        values = {"model": self.model.model_dump()}
        return [(field, block[key]) for field, block, key in path_fields(values)]

    def check_paths(self) -> None:
        """Local files and folders the recipe names must exist (hub ids and builtin: names are not checked)."""
        for field, value in self.input_paths():
            if is_local_path(field, value) and not Path(value).expanduser().exists():
                raise RecipeError(f"{field}: no such file or folder: {value}")

    def with_overrides(self, overrides: list[str] | dict[str, Any]) -> Recipe:
        return Recipe.from_dict(self.resolved_values(), overrides)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.resolved_values(), sort_keys=False)

    def resolved_values(self) -> dict[str, Any]:
        """Every field's value, as a recipe file holds them: what loads back into this same recipe.

        Every rule that makes fields exclusive decides from their values (data.path is None under
        data.sources; the 4-bit-only quant fields and the preference section keep their defaults where
        they do not apply), never from which fields a file happened to set: so this dump, defaults
        included, loads back equal, and an override applies the same to it as to the user's file."""
        return self.model_dump(mode="json")


def apply_overrides(values: dict[str, Any], overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Apply dotted overrides to a recipe's values (overrides.py: any depth, text fields get text)."""
    return overrides_.apply_overrides(values, overrides, Recipe)
