"""Memory stage: the activations a checkpointing policy keeps for backward, per decoder layer and in the loss
head (``activation_bytes``), which ``planner.plan`` puts under each policy's row: traced from the model's own
code (``tracing.py``) where it runs on fake tensors, else the Llama-shaped formula (``formula.py``); the
planner's docstring says what each holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qlora_kit.memory import checkpointing
from qlora_kit.memory.formula import (
    Activations,
    formula_activation_bytes,
    kept_layer_bytes,
    lora_dropout,
    selected_positions_bytes,
)
from qlora_kit.memory.pixels import images_in_a_row
from qlora_kit.memory.shapes import ModelShape
from qlora_kit.memory.tiled_mlp import tile_count
from qlora_kit.memory.tracing import trace_layers
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def layer_plan(policy: str | list[str], every_n: int, layers: int, recipe: Recipe | None = None) -> list[str]:
    """Each layer's policy (none, selective or full) under a checkpointing policy, or the given list;
    ``per_layer`` reads the recipe's ``memory.layer_policies``."""
    if isinstance(policy, list):
        return policy
    per_layer = recipe.memory.layer_policies if recipe is not None else None
    return checkpointing.expand_policy(policy, every_n, layers, per_layer)


def activation_bytes(
    shape: ModelShape,
    recipe: Recipe,
    policy: str,
    every_n: int,
    batch: int,
    seq: int,
    device: str = "cpu",
    trained_tokens: int | None = None,
    precision: str = "no",
    images_per_row: int | None = None,
    padded: bool = True,
) -> Activations:
    """Bytes kept for backward at ``batch`` x ``seq`` under a checkpointing policy and the Trainer's
    autocast ``precision``: traced from the model's own code where it runs on fake tensors, else from
    the Llama-shaped formula (which assumes no autocast). A vision-language model's rows hold
    ``images_per_row`` images (``images_in_a_row``)."""
    policies = layer_plan(policy, every_n, shape.layers, recipe)
    recomputing = any(table.recomputes(p) for p in policies)
    images = images_in_a_row(recipe, images_per_row)
    traced = (
        trace_layers(shape.config, recipe, batch, seq, precision, images, device, padded)
        if shape.config is not None
        else None
    )
    if traced is None:
        return formula_activation_bytes(shape, recipe, policies, batch, seq, device, trained_tokens)
    per_layer = traced.per_layer(policies)
    if device != "cpu" and lora_dropout(shape, recipe) > 0:
        # The trace ran the CPU's dropout, whose masks keep 4 bytes a value; CUDA's keep 1 (a selective
        # layer keeps no mask: dropout is recomputed).
        n = batch * seq
        tiled = tile_count(recipe.memory.mlp_tiles, seq, shape.hidden) > 1  # its MLP keeps no mask to correct
        for i, layer_policy in enumerate(policies):
            if not table.recomputes(layer_policy):
                grad = recomputing or i > 0
                on_cpu = kept_layer_bytes(shape, recipe, n, "cpu", grad, tiled)
                per_layer[i] -= on_cpu - kept_layer_bytes(shape, recipe, n, device, grad, tiled)
    head = traced.head_checkpointed if recomputing else traced.head
    head_source = "traced"
    if traced.chunked_head:  # which positions it keeps depends on the labels' values: closed form
        head += selected_positions_bytes(shape, recipe, batch, seq, trained_tokens)
        head_source = "traced, the trained positions closed form"
        if trained_tokens is not None:
            head_source += f" (at most {trained_tokens} of {batch * (seq - 1)}, from the data)"
    cost = traced.recompute_cost(policies)
    return Activations(
        per_layer, head, source="traced", head_source=head_source, recompute_cost=cost, kernels=traced.kernels
    )
