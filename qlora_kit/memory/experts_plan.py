"""Memory stage: ``memory.experts_on_host`` and a mixture's experts in the plan (``planner.plan`` reads it).

With ``memory.experts_on_host`` a mixture's experts live in host memory (``Plan.host_experts``: every layer's
packed weights and statistics) and the device holds two layers' of them (``Plan.experts_in_flight``: the
one computing, the one arriving); every layer's are copied to the device twice a micro-batch (forward,
backward; a recompute shares the backward's copy: ``Plan.experts_copied_per_step``). Loading keeps them on
the host as they load (memory/experts_on_host.py): the device holds the rest of the model and, while one
layer's empty device tensors are made, that layer's experts (``experts_at_load``), never the whole model.
``resolve`` decides ``auto`` against ``memory.budget_gb``.

The experts' working set in a step (``dequantized_expert``) is planned here too: the experts run one at a
time (a run of them on CUDA), dequantized for their tokens' matmuls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qlora_kit.memory.shapes import DTYPE_BYTES, ModelShape, stack_bytes
from qlora_kit.model import expert_matmul
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

GIB = 1024**3


def layer_experts(shape: ModelShape, recipe: Recipe) -> int:
    """The largest mixture layer's experts as packed (every stack of that layer: gate/up and down)."""
    per_layer: dict[str, int] = {}
    for stack in shape.expert_stacks:
        layer = stack.name.rsplit(".", 1)[0]
        per_layer[layer] = per_layer.get(layer, 0) + stack_bytes(stack, recipe)
    return max(per_layer.values(), default=0)


def in_flight(shape: ModelShape, recipe: Recipe, on_host: bool) -> int:
    """Experts on the device with them on the host: two layers' (the one computing, the one arriving)."""
    return 2 * layer_experts(shape, recipe) if on_host else 0


def experts_at_load(shape: ModelShape, recipe: Recipe, experts: int, on_host: bool) -> int:
    """The experts' bytes on the device while the model loads: all of them resident; with them on the host
    one layer's, whose device tensors are made at full size and emptied (experts_on_host._swap_to_host)."""
    return layer_experts(shape, recipe) if on_host else experts


def copied_per_step(host_experts: int, grad_accum: int) -> int:
    """Bytes copied host to device per optimizer step: every layer's experts in each micro-batch's forward
    and again in its backward (a recompute shares the backward's copy)."""
    return 2 * host_experts * grad_accum


def dequantized_expert(shape: ModelShape, recipe: Recipe, device: str) -> int:
    """A mixture of experts in 4 bits: the expert weights dequantized at once for their tokens' matmuls
    (forward and backward alike; 0 for a dense model). The CPU's loop holds one expert's; CUDA's grouped
    matmuls a run of experts up to expert_matmul.DEQUANTIZED_RUN_BYTES (model/expert_matmul.py)."""
    if recipe.quant.bits == 16 or not shape.expert_stacks:
        return 0
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    one = max(s.d_out * s.d_in for s in shape.expert_stacks) * c
    if device != "cuda":
        return one
    experts = max(s.experts for s in shape.expert_stacks)
    return one * min(experts, max(1, expert_matmul.DEQUANTIZED_RUN_BYTES // one))


def resolve(result, recipe: Recipe):
    """``memory.experts_on_host`` in the plan ``result`` (a planner.Plan): true moves every layer's experts to
    the host but two layers' in flight; auto does so only where the plan does not fit ``memory.budget_gb``
    without it (the recipe's checkpointing policy, or any policy under checkpointing auto). Only the static
    and loading bytes change, so each row's peak is recomputed from what it keeps."""
    wanted = recipe.memory.experts_on_host
    if wanted == "auto":
        budget = recipe.memory.budget_gb * GIB
        own = not table.planned(recipe.memory.checkpointing)
        rows = [result.chosen(recipe)] if own else result.policies
        wanted = not any(row.peak <= budget for row in rows)
    if not wanted or not result.shape.expert_stacks or result.shards > 1:
        return result
    result.experts_on_host = True
    for row in result.policies:
        row.peak = result.peak_of(row.activations, row.spike)
    return result
