"""Adapter stage: attach LoRA to the 4-bit base with peft, save it, load it back.

Only the LoRA matrices train. ``all-linear`` targets every linear layer but the output head (peft's
own rule), which is the QLoRA paper's finding: adapters on every layer matter more than the rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils.error import NoMatchingPeftModuleError
from torch.distributed.tensor import DTensor

from qlora_kit.errors import RecipeError
from qlora_kit.model import experts_selfcheck, moe_targets, peft_3711, text_only, vision
from qlora_kit.model import loading as base_model
from qlora_kit.model.layers import is_linear
from qlora_kit.model.paths import check_adapter_folder
from qlora_kit.recipe.recipe import Recipe

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from qlora_kit.recipe.recipe import LoraSection

log = logging.getLogger(__name__)

# peft's init_lora_weights values for the recipe's names; "default" is peft's True.
PEFT_INIT = {"default": True, "gaussian": "gaussian", "pissa": "pissa", "olora": "olora"}


def lora_config(lora: LoraSection, model: PreTrainedModel | None = None):
    """peft's LoraConfig for the recipe's lora section; on a mixture-of-experts ``model`` with lora.experts,
    the experts' fused weights too (peft's target_parameters, run in low-rank form: moe_experts.py)."""
    experts = (
        moe_targets.lora_targets(model, lora.target_modules, lora.experts, lora.router)
        if model is not None
        else {}
    )
    on_experts = "target_parameters" in experts
    dropout = lora.dropout_for(on_experts)
    if on_experts and dropout:
        raise RecipeError(
            f"lora.dropout: LoRA on a mixture of experts' experts takes no dropout (got {lora.dropout}) with "
            "lora.experts true: the update of each expert's tokens cannot be factored out of it (peft's rule "
            "for target_parameters); set lora.dropout 0 or auto, or lora.experts false"
        )
    if lora.dropout == "auto" and on_experts:
        log.info("lora.dropout auto: 0 (LoRA on the experts takes no dropout)")
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=dropout,
        target_modules=experts.get("target_modules", lora.target_modules),
        bias=lora.bias,
        use_rslora=lora.rslora,
        use_dora=lora.dora,
        init_lora_weights=PEFT_INIT[lora.init],
        task_type="CAUSAL_LM",
        target_parameters=experts.get("target_parameters"),
        modules_to_save=experts.get("modules_to_save"),
        # a vision-language model: the language model adapts, the vision side unless lora.vision (vision.py)
        exclude_modules=vision.excluded_from_lora(model, lora.vision) if model is not None else None,
    )
    if "custom" in experts:
        config._register_custom_module(experts["custom"])
    return config


def attach_lora(model: PreTrainedModel, lora: LoraSection, empty: bool = False) -> PeftModel:
    """Wrap ``model`` with trainable LoRA adapters; every other parameter stays frozen. ``empty``: the
    adapters are made on the meta device, never allocated nor drawn (the planner's traces of a meta model)."""
    try:
        with peft_3711.targets_kept(model):  # LoRA on shared experts' linears (peft#3711)
            peft_model = get_peft_model(model, lora_config(lora, model), low_cpu_mem_usage=empty)
        experts_selfcheck.check_lora(peft_model)  # LoRA on packed experts against peft's own, once a load
        return peft_model
    except NoMatchingPeftModuleError:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if is_linear(m)})
        raise RecipeError(
            f"lora.target_modules: none of {lora.target_modules} is a linear layer of this model; "
            f"its linear layers are: {', '.join(names)} (or use all-linear)"
        ) from None
    except ValueError as exc:  # peft refuses some layers of some architectures (a Mamba block's out_proj)
        if "is incompatible with" not in str(exc):
            raise
        raise RecipeError(
            f"lora.target_modules: {lora.target_modules} takes in a layer peft will not adapt on this model "
            f"({' '.join(str(exc).split())[:240]}); list the layers LoRA should adapt instead"
        ) from None


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) tensors, whole, on the CPU, by parameter name: what ``save_pretrained(...,
    state_dict=)`` writes. Under FSDP2 each rank holds a shard of each (a DTensor) and every rank must
    call this (one all-gather per tensor); the frozen 4-bit base is never gathered."""
    state = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            tensor = parameter.detach()
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            state[name] = tensor.cpu()
    return state


def save_adapter(model: PeftModel, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the adapter (``state``: its tensors, gathered under FSDP; None: the model's own).

    Never the base's embedding or output-head weights: peft adds them when LoRA targets ``lm_head`` or
    ``embed_tokens`` (``save_embedding_layers="auto"``), for vocabularies resized in training, which
    qlora_kit never does; for Llama-3-8B that is a 1 GB copy of the head in every checkpoint.
    """
    # only the trained adapter: under DPO the model also holds TRL's frozen reference copy (dpo.py)
    model.save_pretrained(
        folder, state_dict=state, save_embedding_layers=False, selected_adapters=[model.active_adapter]
    )
    text_only.write_as_checkpoint_names(model, folder)  # a multimodal checkpoint's language model


def load_adapter(
    model: PreTrainedModel, adapter_dir: str | Path, trainable: bool = False, flag: str = "--adapter"
) -> PeftModel:
    """``adapter_dir``'s adapter on ``model``; an adapter of another architecture (layers this model has
    not, or of other shapes), or one whose file holds no tensors for some of the LoRA layers its config puts
    on this model, is a one-line RecipeError naming the base it was trained on. LoRA on fused experts runs
    in low-rank form (moe_experts.LoraExperts)."""
    try:
        config = PeftConfig.from_pretrained(str(adapter_dir))
        experts = moe_targets.lora_targets(model, config.target_modules, True)
        if experts and getattr(config, "target_parameters", None):
            config._register_custom_module(experts["custom"])
        # key_mapping None: peft's own (the model's conversions); a multimodal checkpoint's language model's
        mapping = text_only.adapter_key_mapping(model)
        with _missing_tensors_refused(adapter_dir, flag), peft_3711.targets_kept(model):
            return PeftModel.from_pretrained(
                model, str(adapter_dir), is_trainable=trainable, config=config, key_mapping=mapping
            )
    except (ValueError, RuntimeError) as exc:  # peft's NoMatchingPeftModuleError, torch's size mismatch
        text = str(exc)
        if not (isinstance(exc, NoMatchingPeftModuleError) or "size mismatch" in text or "not found" in text):
            raise
        first = " ".join(text.split())[:160]
        raise RecipeError(
            f"{flag}: {adapter_dir} was trained on {trained_on(adapter_dir)}, whose layers this base model "
            f"({model.config.model_type}) does not have ({first})"
        ) from None


# peft 0.21's words when a LoRA layer it made finds no tensor in the adapter's file (it then keeps its fresh
# values: B at zero, the base model's output); peft asks its own tests to follow any change of them
PEFT_MISSING_KEYS = "Found missing adapter keys while loading the checkpoint"


@contextlib.contextmanager
def _missing_tensors_refused(adapter_dir: str | Path, flag: str) -> Iterator[None]:
    """peft warns, and goes on, when LoRA layers get no tensors from the file (names that do not match this
    model's): refused in one line, for a command would run the base model and call it the adapter's. Other
    warnings pass through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        text = str(warning.message)
        if PEFT_MISSING_KEYS in text:
            count = text.count(".lora_")
            raise RecipeError(
                f"{flag}: {adapter_dir} holds no tensors for {count} of the LoRA weights its config puts on this "
                f"base model, which would run without them (its tensors name other layers: trained on "
                f"{trained_on(adapter_dir)}?)"
            )
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def trained_on(adapter_dir: str | Path) -> str:
    """The base an adapter was trained on: model.path of the recipe saved beside it, else peft's record."""
    folder = Path(adapter_dir)
    try:
        return recipe_of(folder).model.path
    except (RecipeError, OSError):
        pass
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        return str(config.get("base_model_name_or_path") or "another base model")
    except (OSError, ValueError, AttributeError):
        return "another base model"


def log_continued_shape(peft_model: PeftModel, recipe: Recipe) -> None:
    """model.adapter: the adapter's own config fixes its shape; say so where the recipe's lora differs."""
    config = peft_model.peft_config[peft_model.active_adapter]
    log.info(
        "model.adapter: continuing %s (rank %d, alpha %g)", recipe.model.adapter, config.r, config.lora_alpha
    )
    base = trained_on(recipe.model.adapter)
    if base != recipe.model.path:  # the same layer shapes, or it would not have loaded
        log.warning(
            "model.adapter: %s was trained on %s, not on this run's base %s; its layers have the same "
            "shapes, so it loads, but it learned on another model's weights",
            recipe.model.adapter,
            base,
            recipe.model.path,
        )
    for field, own in (("rank", config.r), ("alpha", config.lora_alpha)):
        if getattr(recipe.lora, field) != own:
            log.warning(
                "model.adapter: the adapter's own shape applies, not lora.%s %s (it has %s)",
                field,
                getattr(recipe.lora, field),
                own,
            )


def trainable_parameter_count(model: PreTrainedModel) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as the values they hold."""
    trainable = total = 0
    for param in model.parameters():
        count = param.numel()
        # Packed 4-bit storage holds two values per byte of its container dtype: count values, not elements.
        if param.__class__.__name__ == "Params4bit":
            count *= param.element_size() * 2
        total += count
        if param.requires_grad:
            trainable += count
    return trainable, total


def recipe_of(adapter_dir: str | Path):
    """The resolved recipe a run saved beside its adapter."""
    path = Path(adapter_dir) / "recipe.yaml"
    check_adapter_folder(Path(adapter_dir))
    if not path.is_file():
        raise RecipeError(
            f"--adapter: {adapter_dir} has no recipe.yaml; it was not written by qlora-kit train"
        )
    return Recipe.from_yaml(path)


def load_for_inference(adapter_dir: str | Path | None, recipe: Recipe | None = None):
    """(recipe, tokenizer, model) for eval and generation: the 4-bit base with the trained adapter, as
    it was trained (the recipe defaults to the one saved beside it), or, without ``adapter_dir``, the
    recipe's base model alone, for comparison."""
    if adapter_dir is not None:
        return load_trained(adapter_dir, recipe)
    if recipe is None:
        raise RecipeError("give a recipe, an adapter directory, or both")
    return (
        recipe,
        base_model.load_tokenizer(recipe.model),
        base_model.load_base_model(recipe.model, recipe.quant),
    )


def load_trained(adapter_dir: str | Path, recipe=None):
    """(recipe, tokenizer, model): the 4-bit base with the trained adapter, as it was trained."""
    recipe = recipe or recipe_of(adapter_dir)
    tokenizer = base_model.load_tokenizer(recipe.model, path=str(adapter_dir))
    base = base_model.load_base_model(recipe.model, recipe.quant)
    return recipe, tokenizer, load_adapter(base, adapter_dir)
