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
through frozen, checkpointed layers. Under a test's fault injector (``fault_seam``) every checkpointed
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
from qlora_kit.memory import fault_seam, offload, selective, tiled_mlp
from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from qlora_kit.recipe.memory import MemorySection

log = logging.getLogger(__name__)


def layer_policies(memory: MemorySection, layers: int) -> list[str]:
    """Each decoder layer's policy (a layer policy of the table) under ``memory.checkpointing``."""
    policy = memory.checkpointing
    if table.planned(policy):
        raise ValueError(
            f"memory.checkpointing: resolve {policy} with auto.resolve_checkpointing(recipe) first"
        )
    if table.policy(policy).expands == table.LISTED:
        chosen = list(memory.layer_policies or [])
        if len(chosen) != layers:
            raise RecipeError(
                f"memory.layer_policies: one policy per decoder layer, {layers} for this model (got {len(chosen)})"
            )
        return chosen
    return expand_policy(policy, memory.every_n, layers)


# torch checkpoint's context_fn of each policy the table marks ``context_fn`` (the table, standard library
# only, cannot refer to it)
CONTEXT_FNS = {"selective": selective.context_fn}


def expand_policy(policy: str, every_n: int, layers: int, per_layer: list[str] | None = None) -> list[str]:
    """A policy name as one policy per layer (the table's ``expands``): every_n is full on layers 0, n,
    2n, ... and none between; per_layer is ``per_layer`` as given (the run checks its length:
    ``layer_policies``; the planner too)."""
    expands = table.policy(policy).expands
    if expands == table.LISTED:
        return list(per_layer or [])
    if expands == table.EVERY_N:
        return [table.FULL if i % every_n == 0 else table.NONE for i in range(layers)]
    return [policy] * layers


def enable_checkpointing(model: PreTrainedModel, memory: MemorySection) -> list[int]:
    """Apply the memory section's policy to the decoder layers (checkpointing, offloaded checkpoints, MLP
    tiles); returns the indices of the layers that recompute in backward (selective or full)."""
    faults = fault_seam.run_built(model)  # None unless a test installed its injector
    tiled_mlp.enable_mlp_tiles(model, memory.mlp_tiles)
    spec = table.policy(memory.checkpointing)
    if spec.layer and not spec.recomputes:
        return []
    layers = decoder_layers(model)
    policies = layer_policies(memory, len(layers))
    if not any(table.recomputes(p) for p in policies):
        return []
    kwargs: dict = {"use_reentrant": False}
    # transformers sets one checkpoint function on every layer: with the context of the layers' policy
    # that has one (a mix of two such contexts is refused), each other layer's set apart below
    contexts = list(dict.fromkeys(p for p in policies if table.policy(p).context_fn))
    if len(contexts) > 1:
        raise RecipeError(f"memory.layer_policies: one of {', '.join(contexts)} at a time, not both")
    context_fn = _context_fn(contexts[0] if contexts else None, faults)
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    model.activation_checkpointing_enable(kwargs)
    _vision_side_without_input_grads(model)
    if len(set(policies)) > 1:
        # transformers' every_n_layers counts every layer that can checkpoint, a vision tower's first: a
        # vision-language model's decoder would then start wherever the tower's count left off. So the
        # decoder's layers are set by their own index (every_n's and per_layer's alike), and a vision
        # tower checkpoints throughout.
        _mix(layers, policies, _context_fn(None, faults))
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


def _context_fn(policy: str | None, faults: fault_seam.Faults | None):
    """torch checkpoint's ``context_fn`` for layer policy ``policy``'s layers: the table's (selective's op
    policy), and under the test fault injector its recompute count too (out-of-memory in backward's
    recompute); None when neither applies."""
    context = CONTEXT_FNS[policy] if policy is not None and table.policy(policy).context_fn else None
    if faults is None or not faults.counts_recompute:
        return context

    def contexts():
        forward, recompute = context() if context else (contextlib.nullcontext(), contextlib.nullcontext())
        return forward, _together(recompute, faults.recompute())

    contexts.policy = policy if context else None  # read back by applied_policies
    return contexts


@contextlib.contextmanager
def _together(first, second):
    with first, second:
        yield


def _mix(layers: list[torch.nn.Module], policies: list[str], full_context_fn) -> None:
    """Per-layer policies on top of transformers' setup (every layer checkpointed, with a policy's context
    if any layer has one): a layer whose policy has no context gets the same checkpoint function without
    it (transformers' own function, offload included; ``full_context_fn``: the fault injector's alone, in
    tests), a layer that keeps everything is not checkpointed."""
    for layer, policy in zip(layers, policies, strict=True):
        func = layer._gradient_checkpointing_func
        if not table.policy(policy).context_fn and "context_fn" in func.keywords:
            keywords = {k: v for k, v in func.keywords.items() if k != "context_fn"}
            if full_context_fn is not None:
                keywords["context_fn"] = full_context_fn
            layer._gradient_checkpointing_func = functools.partial(func.func, *func.args, **keywords)
        layer.gradient_checkpointing = table.recomputes(policy)


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
    """Indices of decoder layers whose checkpointed input lives in host memory (training/compiled.py
    keeps them eager: dynamo cannot trace the offload hooks)."""
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
    """Each decoder layer's policy as applied (a layer policy of the table), read back from the layers."""
    uncheckpointed = next(p for p in table.layer_policies() if not table.recomputes(p))
    plain = table.of_kind(table.KEEPS_INPUT)  # checkpointed with no policy's context
    by_context = {
        CONTEXT_FNS[name]: name for name, spec in table.POLICIES.items() if spec.layer and spec.context_fn
    }
    found = []
    for layer in decoder_layers(model):
        if not layer.gradient_checkpointing:
            found.append(uncheckpointed)
            continue
        func = getattr(layer, "_gradient_checkpointing_func", None)
        keywords = getattr(func, "keywords", {}) or {}
        context_fn = keywords.get("context_fn")
        found.append(by_context.get(context_fn) or getattr(context_fn, "policy", None) or plain)
    return found
