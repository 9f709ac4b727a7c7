"""The whole pipeline, top to bottom: ``run(recipe)``.

load tokenizer -> tokenize data -> load 4-bit base -> checkpointing policy -> attach LoRA ->
transformers' Trainer with the chosen bitsandbytes optimizer -> save adapter, tokenizer and recipe.
The Trainer owns the loop: accumulation, clipping, scheduling, evaluation, logging and checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qlora_kit import adapters, data, memory, model
from qlora_kit.distributed import Ranks, launched_with_fsdp
from qlora_kit.interrupts import Interrupted, StopOnSignal
from qlora_kit.manifest import build_manifest, write_manifest
from qlora_kit.outputs import (
    FINISHED_MARKER,
    check_output_dir,
    check_writable,
    clear_staging,
    complete_checkpoints,
    exclusive,
    find_resume_checkpoint,
    move_into_place,
    prepare_output_dir,
    staging_dir,
    truncate_metrics,
)
from qlora_kit.precision import resolve_mixed_precision
from qlora_kit.trainer_setup import build_trainer

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from qlora_kit.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run leaves behind: where it wrote, what it logged, and the trained model in memory."""

    output_dir: Path
    metrics: list[dict[str, Any]]
    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    checkpointed_layers: list[int] = field(default_factory=list)
    samples: list[dict[str, str]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)  # the run's largest saved bytes, CUDA peaks

    @property
    def eval_losses(self) -> list[float]:
        return [row["eval_loss"] for row in self.metrics if "eval_loss" in row]

    @property
    def train_losses(self) -> list[float]:
        return [row["loss"] for row in self.metrics if "loss" in row]


def run(
    recipe: Recipe,
    overwrite: bool = False,
    resume: bool | str | Path = False,
    callbacks: list | None = None,
    guards: bool = True,
) -> TrainResult:
    """Fine-tune the recipe's base model with QLoRA and save the adapter into ``recipe.train.output_dir``.

    ``resume``: True continues from the newest complete checkpoint in the output dir, a path from that
    checkpoint. ``callbacks`` are extra ``transformers.TrainerCallback`` objects for the Trainer.
    ``guards=False`` drops the loss and gradient guards (for measuring what they cost; never for a run).
    """
    from transformers import set_seed

    recipe.check_paths()
    _check_launch(recipe)
    resolve_mixed_precision(recipe)  # a precision this machine cannot run is refused before any work
    ranks = Ranks()
    output_dir = Path(recipe.train.output_dir).expanduser().resolve()
    with exclusive(output_dir) if ranks.is_main else contextlib.nullcontext():
        checkpoint = find_resume_checkpoint(output_dir, resume) if resume else None
        if not resume:
            check_output_dir(output_dir, overwrite=overwrite)
        set_seed(recipe.train.seed)

        tokenizer = model.load_tokenizer(recipe.model)
        # Data before weights: a mistake in the data is found in seconds, not after loading a large model.
        with ranks.main_first():
            prepared = data.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
        base = model.load_base_model(recipe.model, recipe.quant, fsdp=recipe.train.fsdp)
        checkpointed = memory.enable_checkpointing(base, memory.resolve_checkpointing(recipe))
        peft_model = adapters.attach_lora(base, recipe.lora)
        examples = []
        if ranks.is_main:
            _log_setup(peft_model, checkpointed, prepared, recipe)
            _log_optimizer_state(peft_model, recipe)
            examples = data.prompt_examples(prepared, recipe.data, tokenizer, recipe.train.sample_prompts)
        before = _answer(peft_model, tokenizer, examples)

        manifest = (
            _prepare_folder(output_dir, recipe, peft_model, overwrite, resume, checkpoint)
            if ranks.is_main
            else {}
        )
        ranks.barrier()
        stopper = StopOnSignal()
        trainer = build_trainer(
            recipe,
            peft_model,
            tokenizer,
            prepared.train,
            prepared.val,
            output_dir,
            [stopper, *(callbacks or [])],
            guards=guards,
        )
        _train(trainer, stopper, peft_model, checkpoint, output_dir)
        # Take accelerate's autocast wrapper off the model's forward: the model handed back computes as
        # it does once loaded from disk (generate, eval, a notebook), not under the training autocast.
        trainer.accelerator.unwrap_model(peft_model, keep_fp32_wrapper=False)
        _save_final(trainer, peft_model, tokenizer, output_dir, ranks, recipe.train.fsdp)
        if ranks.is_main:
            write_manifest(output_dir, manifest | {"finished_at": _now(), "steps": trainer.state.global_step})
        ranks.barrier()
    samples = _samples(examples, before, _answer(peft_model, tokenizer, examples))
    usage = trainer.memory_monitor.summary()
    if checkpoint is not None:
        usage["repaged_optimizer_tensors"] = trainer.repaged_tensors
    if ranks.is_main:
        _log_memory(usage)
        log.info("adapter, tokenizer and recipe written to %s", output_dir)
    return TrainResult(
        output_dir=output_dir,
        metrics=trainer.metrics_log.rows,
        model=peft_model,
        tokenizer=tokenizer,
        checkpointed_layers=checkpointed,
        samples=samples,
        memory=usage,
    )


def _check_launch(recipe: Recipe) -> None:
    from qlora_kit.recipe import RecipeError

    if launched_with_fsdp() and not recipe.train.fsdp:
        raise RecipeError(
            "train.fsdp: this run is launched with an FSDP config; set train.fsdp: true "
            "(and quant.quant_storage equal to quant.compute_dtype)"
        )


def _prepare_folder(
    output_dir: Path, recipe: Recipe, peft_model, overwrite: bool, resume, checkpoint
) -> dict:
    """The main process readies the output folder; returns the run manifest it wrote."""
    if not resume:
        prepare_output_dir(output_dir, overwrite=overwrite)
    check_writable(output_dir, _output_bytes(peft_model, recipe))
    clear_staging(output_dir)
    if resume:
        truncate_metrics(output_dir, _step_of(checkpoint))
        log.info("resuming from %s", checkpoint or "the start: no complete checkpoint was written")
    manifest = build_manifest(recipe, model.resolve_model_path(recipe.model))
    log.info("run manifest: %s", write_manifest(output_dir, manifest))
    (output_dir / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")
    return manifest


def _train(trainer, stopper: StopOnSignal, peft_model, checkpoint: Path | None, output_dir: Path) -> None:
    stopper.install()
    try:
        if checkpoint is not None and _finished_training(checkpoint, trainer.args.max_steps):
            _load_checkpoint_adapter(peft_model, checkpoint)
            trainer.state.global_step = _step_of(checkpoint)
        else:
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    finally:
        stopper.restore()
    if stopper.stopped:
        newest = complete_checkpoints(output_dir)
        raise Interrupted(
            stopper.received or 15, trainer.state.global_step, str(newest[-1]) if newest else None
        )


def _save_final(trainer, peft_model, tokenizer, output_dir: Path, ranks: Ranks, fsdp: bool) -> None:
    """Adapter and tokenizer, staged and renamed into place; adapter_config.json (the finished marker) last.
    Under FSDP every rank takes part in gathering the sharded adapter (the Trainer's save_model)."""
    staged = staging_dir(output_dir, name="final")
    if fsdp:
        trainer.save_model(str(staged))
    elif ranks.is_main:
        peft_model.save_pretrained(staged)
    ranks.barrier()
    if ranks.is_main:
        tokenizer.save_pretrained(staged)
        move_into_place(staged, output_dir, last=FINISHED_MARKER)


def _output_bytes(peft_model, recipe: Recipe) -> int:
    """Room for a checkpoint (adapter + optimizer state) and the final adapter, with a margin."""
    from qlora_kit.accounting import state_bytes

    eight_bit = "8bit" in recipe.optimizer.name
    params = [p for p in peft_model.parameters() if p.requires_grad]
    adapter = sum(p.numel() * 4 for p in params)
    state = sum(state_bytes(p.numel(), eight_bit) for p in params)
    return 2 * (2 * adapter + state) + 64 * 2**20


def _finished_training(checkpoint: Path, max_steps: int) -> bool:
    """The checkpoint is the run's last step (a kill hit the final save). Resuming the Trainer from there
    would train one step too many (transformers 5.24 restarts the epoch's remaining batches).
    ``max_steps``: this run's (-1: by epochs, as the checkpoint's run counted them), so a resume that
    raises train.max_steps trains on."""
    import json

    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    last = max_steps if max_steps > 0 else state.get("max_steps", float("inf"))
    return state["global_step"] >= last


def _load_checkpoint_adapter(peft_model, checkpoint: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(peft_model, load_file(checkpoint / "adapter_model.safetensors"))


def _step_of(checkpoint: Path | None) -> int:
    return int(checkpoint.name.split("-")[-1]) if checkpoint else 0


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _log_setup(peft_model, checkpointed: list[int], prepared: data.PreparedData, recipe: Recipe) -> None:
    trainable, total = adapters.trainable_parameter_count(peft_model)
    log.info(
        "trainable parameters: %s of %s (%.2f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total
    )
    log.info("checkpointed decoder layers: %s", checkpointed or "none")
    for report in prepared.reports:
        log.info("data %s", report.summary())
    shares = data.pad_shares(prepared, recipe.data, recipe.train.micro_batch_size, recipe.train.seed)
    mode = (
        "packing" if recipe.data.packing else "group_by_length" if recipe.data.group_by_length else "padding"
    )
    log.info(
        "data: %d training examples in %d rows; pad tokens per batch: %.1f%% with %s (%.1f%% if padded)",
        len(prepared.example_lengths),
        len(prepared.train),
        100 * shares[mode],
        mode,
        100 * shares["padding"],
    )


def _log_optimizer_state(peft_model, recipe: Recipe) -> None:
    """How much optimizer state the paged optimizer can page; warn when it is asked to page nothing."""
    from qlora_kit.accounting import PAGEABLE_MIN_ELEMENTS, optimizer_state_report

    params = [p for p in peft_model.parameters() if p.requires_grad]
    report = optimizer_state_report(params, recipe.optimizer.name)
    log.info(
        "optimizer state: %.2f MiB, of which %.2f MiB pageable (%d of %d tensors have >= %s elements)",
        report.total_bytes / 2**20,
        report.pageable_bytes / 2**20,
        report.pageable_tensors,
        report.parameters,
        f"{PAGEABLE_MIN_ELEMENTS:,}",
    )
    if recipe.optimizer.name.startswith("paged_") and report.pageable_bytes == 0:
        largest = max(p.numel() for p in params)
        log.warning(
            "optimizer.name %s pages nothing here: bitsandbytes pages only tensors of >= %s elements and the "
            "largest LoRA tensor has %s (raise lora.rank, or use %s)",
            recipe.optimizer.name,
            f"{PAGEABLE_MIN_ELEMENTS:,}",
            f"{largest:,}",
            recipe.optimizer.name.removeprefix("paged_"),
        )


def _log_memory(usage: dict[str, Any]) -> None:
    if "saved_mib" not in usage:
        return  # no training step ran
    layers = usage["saved_mib_layers"]
    log.info(
        "memory: at most %.1f MiB saved for backward (head %.1f MiB; decoder layers %.1f-%.1f MiB each)",
        usage["saved_mib"],
        usage["saved_mib_head"],
        min(layers, default=0.0),
        max(layers, default=0.0),
    )
    if "peak_backward_gib" in usage:
        log.info(
            "CUDA peaks: forward %.2f GiB, backward %.2f GiB, optimizer step %.2f GiB; device used %.2f GiB",
            usage["peak_forward_gib"],
            usage["peak_backward_gib"],
            usage["peak_optimizer_gib"],
            usage["device_used_gib"],
        )


def _answer(peft_model, tokenizer, examples: list[data.PromptExample]) -> list[str]:
    from qlora_kit.generate import complete

    return [complete(peft_model, tokenizer, example.prompt, max_new_tokens=8) for example in examples]


def _samples(examples: list[data.PromptExample], before: list[str], after: list[str]) -> list[dict[str, str]]:
    return [
        {"prompt": ex.prompt, "reference": ex.reference, "before": b, "after": a}
        for ex, b, a in zip(examples, before, after, strict=True)
    ]
