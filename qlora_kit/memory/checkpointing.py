"""Memory stage: the activation-checkpointing policy of the decoder layers.

Checkpointing (``memory.checkpointing``) is one call to transformers'
``activation_checkpointing_enable`` on the 4-bit base before peft wraps it: the forward pass keeps
only each checkpointed decoder layer's input and backward recomputes the layer. It is non-reentrant,
and input-embedding outputs require grad so LoRA receives gradients through frozen, checkpointed
layers. ``checkpointing: auto`` is resolved first by the planner (``planner.resolve_checkpointing``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from qlora_kit.memory import oom_faults
from qlora_kit.memory.accounting import decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from qlora_kit.recipe.recipe import MemorySection

log = logging.getLogger(__name__)


def enable_checkpointing(model: PreTrainedModel, memory: MemorySection) -> list[int]:
    """Apply the checkpointing policy to the decoder layers; returns the indices of checkpointed layers."""
    injector = oom_faults.reload_cap()  # the fault injector's cap, read when each run is built (tests)
    if injector.cap is not None or injector.eval_cap is not None:
        injector.watch(model)
    if memory.checkpointing == "none":
        return []
    if memory.checkpointing == "auto":
        raise ValueError(
            "memory.checkpointing: resolve auto with planner.resolve_checkpointing(recipe) first"
        )
    every_n = memory.every_n if memory.checkpointing == "every_n" else 1
    offload = memory.offload_activations and torch.accelerator.is_available()
    if memory.offload_activations and not offload:
        log.info("memory.offload_activations: no accelerator here, activations already live in host memory")
    kwargs: dict = {"use_reentrant": False}
    if injector.cap is not None:  # tests only: out-of-memory in the recompute too (oom_faults.py)
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), injector.recompute_context())
    model.activation_checkpointing_enable(kwargs, every_n_layers=every_n, offload=offload)
    return checkpointed_layers(model)


def checkpointed_layers(model: PreTrainedModel) -> list[int]:
    """Indices of decoder layers that recompute in backward."""
    return [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]
