"""Memory stage: the activation-checkpointing policy of the decoder layers.

Checkpointing (``memory.checkpointing``) is one call to transformers'
``activation_checkpointing_enable`` on the 4-bit base before peft wraps it. Each decoder layer then
follows one of three policies:
- ``none``: it keeps what autograd saves for backward;
- ``full``: the forward pass keeps only its input and backward recomputes the whole layer;
- ``selective``: it keeps its input and the outputs of its expensive ops (4-bit matmuls, attention) and
  backward recomputes only the cheap ops (``selective.py``), through torch's ``context_fn``, which
  transformers passes on to ``torch.utils.checkpoint.checkpoint`` with the other checkpointing kwargs.
``every_n`` is ``full`` on layers 0, n, 2n, ... and ``none`` on the rest; ``per_layer`` names each
layer's policy (``memory.layer_policies``: what ``auto`` resolves to, ``planner.resolve_checkpointing``).
Checkpointing is non-reentrant, and input-embedding outputs require grad so LoRA receives gradients
through frozen, checkpointed layers.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from qlora_kit.errors import RecipeError
from qlora_kit.memory import selective
from qlora_kit.memory.accounting import decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from qlora_kit.recipe.recipe import MemorySection

log = logging.getLogger(__name__)

LAYER_POLICIES = ("none", "selective", "full")


def layer_policies(memory: MemorySection, layers: int) -> list[str]:
    """Each decoder layer's policy (none, selective or full) under ``memory.checkpointing``."""
    policy = memory.checkpointing
    if policy == "auto":
        raise ValueError(
            "memory.checkpointing: resolve auto with planner.resolve_checkpointing(recipe) first"
        )
    if policy == "per_layer":
        chosen = list(memory.layer_policies or [])
        if len(chosen) != layers:
            raise RecipeError(
                f"memory.layer_policies: one policy per decoder layer, {layers} for this model (got {len(chosen)})"
            )
        return chosen
    if policy == "every_n":
        return ["full" if i % memory.every_n == 0 else "none" for i in range(layers)]
    return [policy] * layers


def enable_checkpointing(model: PreTrainedModel, memory: MemorySection) -> list[int]:
    """Apply the checkpointing policy to the decoder layers; returns the indices of the layers that
    recompute in backward (selective or full)."""
    if memory.checkpointing == "none":
        return []
    layers = decoder_layers(model)
    policies = layer_policies(memory, len(layers))
    if set(policies) == {"none"}:
        return []
    offload = memory.offload_activations and torch.accelerator.is_available()
    if memory.offload_activations and not offload:
        log.info("memory.offload_activations: no accelerator here, activations already live in host memory")
    kwargs = {"use_reentrant": False}
    if "selective" in policies:
        kwargs["context_fn"] = selective.context_fn
    every_n = memory.every_n if memory.checkpointing == "every_n" else 1
    model.activation_checkpointing_enable(kwargs, every_n_layers=every_n, offload=offload)
    if memory.checkpointing in ("per_layer",):
        _mix(layers, policies)
    return checkpointed_layers(model)


def _mix(layers: list[torch.nn.Module], policies: list[str]) -> None:
    """Per-layer policies on top of transformers' setup (every layer checkpointed, selectively if any layer
    is): a full layer gets the same checkpoint function without the selective context (transformers'
    own function, offload included), a none layer is not checkpointed."""
    for layer, policy in zip(layers, policies, strict=True):
        func = layer._gradient_checkpointing_func
        if policy == "full" and "context_fn" in func.keywords:
            keywords = {k: v for k, v in func.keywords.items() if k != "context_fn"}
            layer._gradient_checkpointing_func = functools.partial(func.func, *func.args, **keywords)
        layer.gradient_checkpointing = policy != "none"


def checkpointed_layers(model: PreTrainedModel) -> list[int]:
    """Indices of decoder layers that recompute in backward."""
    return [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]


def applied_policies(model: PreTrainedModel) -> list[str]:
    """Each decoder layer's policy as applied (none, selective or full), read back from the layers."""
    found = []
    for layer in decoder_layers(model):
        if not layer.gradient_checkpointing:
            found.append("none")
            continue
        func = getattr(layer, "_gradient_checkpointing_func", None)
        keywords = getattr(func, "keywords", {}) or {}
        found.append("selective" if keywords.get("context_fn") is selective.context_fn else "full")
    return found
