"""Memory stage: the activation-checkpointing policy and the optimizer choice.

Checkpointing (``memory.checkpointing``) is one call to transformers'
``activation_checkpointing_enable`` on the 4-bit base before peft wraps it: the forward pass keeps
only each checkpointed decoder layer's input and backward recomputes the layer. It is non-reentrant,
and input-embedding outputs require grad so LoRA receives gradients through frozen, checkpointed
layers.

The optimizer is a bitsandbytes class handed to the Trainer, which still builds its parameter groups,
scheduler and clipping. Paged optimizers keep their state in CUDA unified memory that the driver evicts
to host RAM under pressure; on a CPU there is nothing to page and bitsandbytes falls back to ordinary
tensors, which the run reports once.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from qlora_kit.recipe import MemorySection, OptimizerSection, Recipe

log = logging.getLogger(__name__)

# recipe name -> (bitsandbytes class name or None for torch's AdamW, is paged)
OPTIMIZERS = {
    "paged_adamw_8bit": ("PagedAdamW8bit", True),
    "paged_adamw_32bit": ("PagedAdamW32bit", True),
    "adamw_8bit": ("AdamW8bit", False),
    "adamw_torch": (None, False),
}


def resolve_checkpointing(recipe: Recipe) -> MemorySection:
    """The memory section with ``checkpointing: auto`` replaced by the planner's choice (logged, with why)."""
    memory = recipe.memory
    if memory.checkpointing != "auto":
        return memory
    from qlora_kit.planner import choose_policy, plan

    device = "cuda" if _has_cuda() else "cpu"
    policy, every_n, why = choose_policy(recipe, memory.budget_gb, plan(recipe, device=device))
    chosen = memory.model_copy(update={"checkpointing": policy, "every_n": every_n})
    log.info(
        "memory.checkpointing auto: %s (%s)", policy if policy != "every_n" else f"every_n={every_n}", why
    )
    return chosen


def enable_checkpointing(model: PreTrainedModel, memory: MemorySection) -> list[int]:
    """Apply the checkpointing policy to the decoder layers; returns the indices of checkpointed layers."""
    if memory.checkpointing == "none":
        return []
    if memory.checkpointing == "auto":
        raise ValueError("memory.checkpointing: resolve auto with resolve_checkpointing(recipe) first")
    every_n = memory.every_n if memory.checkpointing == "every_n" else 1
    offload = memory.offload_activations and _has_accelerator()
    if memory.offload_activations and not offload:
        log.info("memory.offload_activations: no accelerator here, activations already live in host memory")
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n, offload=offload)
    return checkpointed_layers(model)


def checkpointed_layers(model: PreTrainedModel) -> list[int]:
    """Indices of decoder layers that recompute in backward."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [i for i, layer in enumerate(layers) if layer.gradient_checkpointing]


def optimizer_class_and_kwargs(optimizer: OptimizerSection) -> tuple[type, dict[str, Any]]:
    """The optimizer class and its constructor arguments, for the Trainer's ``optimizer_cls_and_kwargs``.

    The Trainer passes these kwargs as they are (its own learning_rate is not added), so lr is here;
    weight decay it applies per parameter group.
    """
    class_name, paged = OPTIMIZERS[optimizer.name]
    kwargs = {"lr": optimizer.lr, "betas": (0.9, 0.999), "eps": 1e-8}
    if class_name is None:
        import torch

        return torch.optim.AdamW, kwargs
    import bitsandbytes as bnb

    if paged and not _has_cuda():
        log.info(
            "optimizer %s: no CUDA device, so its state is ordinary host memory (nothing to page)",
            optimizer.name,
        )
        # bitsandbytes warns once per state tensor otherwise; the line above says it once.
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    return getattr(bnb.optim, class_name), kwargs


def repage_optimizer_state(optimizer) -> int:
    """Move a resumed paged optimizer's state back into paged (unified) memory; returns how many tensors.

    The Trainer loads optimizer.pt onto the CPU and bitsandbytes' ``load_state_dict`` moves each state
    tensor to its parameter's device as an ordinary CUDA tensor (``Optimizer8bit.load_state_dict``), so
    after ``--resume`` a paged optimizer would page nothing. Each such tensor is copied into a buffer
    from the optimizer's own ``get_state_buffer``, which pages exactly what a fresh run pages (CUDA
    parameters of >= 100,000 elements); on a CPU nothing is paged and nothing changes.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    if not getattr(inner, "is_paged", False):
        return 0
    moved = 0
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state.get(param, {})
            for key in ("state1", "state2"):
                value = state.get(key)
                if value is None or getattr(value, "is_paged", False) or value.shape != param.shape:
                    continue
                buffer = inner.get_state_buffer(param, dtype=value.dtype)
                if getattr(buffer, "is_paged", False):
                    buffer.copy_(value)
                    state[key] = buffer
                    moved += 1
    if moved:
        import torch

        torch.cuda.empty_cache()  # the ordinary copies just replaced
    return moved


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _has_accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()
