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
layer's policy (``memory.layer_policies``: what ``auto`` resolves to, ``auto.resolve_checkpointing``).
Checkpointing is non-reentrant, and input-embedding outputs require grad so LoRA receives gradients
through frozen, checkpointed layers. Under the test fault injector (``oom_faults``) every checkpointed
layer's recompute is also counted against its cap, composed into the same ``context_fn``.
Two more fields act on the same layers: ``memory.offload_activations`` wraps each checkpointed layer's
checkpoint function so its saved input waits in host memory (``offload.py``), and ``memory.mlp_tiles``
computes each layer's MLP in sequence tiles (``tiled_mlp.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING

import torch

from qlora_kit.errors import RecipeError
from qlora_kit.memory import allocator_faults, offload, oom_faults, selective, tiled_mlp
from qlora_kit.memory.accounting import decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from qlora_kit.recipe.memory import MemorySection

log = logging.getLogger(__name__)

LAYER_POLICIES = ("none", "selective", "full")


def layer_policies(memory: MemorySection, layers: int) -> list[str]:
    """Each decoder layer's policy (none, selective or full) under ``memory.checkpointing``."""
    policy = memory.checkpointing
    if policy == "auto":
        raise ValueError("memory.checkpointing: resolve auto with auto.resolve_checkpointing(recipe) first")
    if policy == "per_layer":
        chosen = list(memory.layer_policies or [])
        if len(chosen) != layers:
            raise RecipeError(
                f"memory.layer_policies: one policy per decoder layer, {layers} for this model (got {len(chosen)})"
            )
        return chosen
    return expand_policy(policy, memory.every_n, layers)


def expand_policy(policy: str, every_n: int, layers: int, per_layer: list[str] | None = None) -> list[str]:
    """A policy name as one policy per layer: every_n is full on layers 0, n, 2n, ... and none between;
    per_layer is ``per_layer`` as given (the run checks its length: ``layer_policies``; the planner too)."""
    if policy == "per_layer":
        return list(per_layer or [])
    if policy == "every_n":
        return ["full" if i % every_n == 0 else "none" for i in range(layers)]
    return [policy] * layers


def enable_checkpointing(model: PreTrainedModel, memory: MemorySection) -> list[int]:
    """Apply the memory section's policy to the decoder layers (checkpointing, offloaded checkpoints, MLP
    tiles); returns the indices of the layers that recompute in backward (selective or full)."""
    injector = oom_faults.reload_cap()  # the fault injector's cap, read when each run is built (tests)
    allocator_faults.ALLOCATIONS.reload()  # and the allocation cap's
    if injector.cap is not None or injector.eval_cap is not None:
        injector.watch(model)
    tiled_mlp.enable_mlp_tiles(model, memory.mlp_tiles)
    if memory.checkpointing == "none":
        return []
    layers = decoder_layers(model)
    policies = layer_policies(memory, len(layers))
    if set(policies) == {"none"}:
        return []
    kwargs: dict = {"use_reentrant": False}
    context_fn = _context_fn("selective" in policies, injector)
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    model.activation_checkpointing_enable(kwargs)
    _vision_side_without_input_grads(model)
    if memory.checkpointing == "every_n":
        # transformers' every_n_layers counts every layer that can checkpoint, a vision tower's first: a
        # vision-language model's decoder would then start wherever the tower's count left off. So the
        # decoder's layers are set by their own index, and a vision tower checkpoints throughout.
        for layer, policy in zip(layers, policies, strict=True):
            layer.gradient_checkpointing = policy != "none"  # full on layers 0, n, 2n, ... (expand_policy)
    if memory.checkpointing in ("per_layer",):
        _mix(layers, policies, _context_fn(False, injector))
    if memory.offload_activations:
        _offload(layers)
    return checkpointed_layers(model)


def _vision_side_without_input_grads(model: PreTrainedModel) -> None:
    """transformers' activation_checkpointing_enable makes the input embeddings' output of every sub-model
    require grad, a vision tower's patch embedding too: a frozen tower (Qwen-VL's) would then keep its
    activations and run backward for no gradient (measured: tests/test_planner_grid.py). Its hooks on the
    vision side are removed; LoRA's weights there (lora.vision) get their gradients regardless, as the
    checkpoints are non-reentrant."""
    from qlora_kit.model import vision

    facet = vision.vision_of(getattr(model, "config", None))
    hooks = getattr(model, "_require_grads_hooks", None)
    if facet is None or not hooks:
        return
    vision_hooks = [
        module._forward_hooks for name, module in model.named_modules() if vision.on_vision_side(name, facet)
    ]
    for hook in hooks:
        if any(hook.id in registered for registered in vision_hooks):
            hook.remove()


def _context_fn(selective_layers: bool, injector: oom_faults.FaultInjector):
    """torch checkpoint's ``context_fn``: selective's op policy, and under the test fault injector its
    recompute count too (out-of-memory in backward's recompute); None when neither applies."""
    policy = selective.context_fn if selective_layers else None
    if injector.cap is None:
        return policy

    def contexts():
        forward, recompute = policy() if policy else (contextlib.nullcontext(), contextlib.nullcontext())
        return forward, _together(recompute, injector.recompute_context())

    contexts.selective = policy is not None  # read back by applied_policies
    return contexts


@contextlib.contextmanager
def _together(first, second):
    with first, second:
        yield


def _mix(layers: list[torch.nn.Module], policies: list[str], full_context_fn) -> None:
    """Per-layer policies on top of transformers' setup (every layer checkpointed, selectively if any layer
    is): a full layer gets the same checkpoint function without the selective context (transformers'
    own function, offload included; ``full_context_fn``: the fault injector's alone, in tests), a none
    layer is not checkpointed."""
    for layer, policy in zip(layers, policies, strict=True):
        func = layer._gradient_checkpointing_func
        if policy == "full" and "context_fn" in func.keywords:
            keywords = {k: v for k, v in func.keywords.items() if k != "context_fn"}
            if full_context_fn is not None:
                keywords["context_fn"] = full_context_fn
            layer._gradient_checkpointing_func = functools.partial(func.func, *func.args, **keywords)
        layer.gradient_checkpointing = policy != "none"


def _offload(layers: list[torch.nn.Module]) -> None:
    """Each checkpointed layer's saved input in host memory (``offload.py``), its checkpoint function
    otherwise unchanged (still a partial whose keywords ``applied_policies`` reads)."""
    for layer in layers:
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if layer.gradient_checkpointing and func is not None:
            layer._gradient_checkpointing_func = functools.partial(
                offload.offloaded_checkpoint, *func.args, checkpoint_fn=func.func, **func.keywords
            )


def offloaded_layers(model: PreTrainedModel) -> list[int]:
    """Indices of decoder layers whose checkpointed input lives in host memory."""
    return [
        i
        for i, layer in enumerate(decoder_layers(model))
        if getattr(getattr(layer, "_gradient_checkpointing_func", None), "func", None)
        is offload.offloaded_checkpoint
    ]


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
        context_fn = keywords.get("context_fn")
        chosen = context_fn is selective.context_fn or getattr(context_fn, "selective", False)
        found.append("selective" if chosen else "full")
    return found
