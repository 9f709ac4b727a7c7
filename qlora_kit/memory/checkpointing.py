"""Memory stage: the activation-checkpointing policy of the decoder layers.

Checkpointing (``memory.checkpointing``) is one call to transformers'
``activation_checkpointing_enable`` on the 4-bit base before peft wraps it: the forward pass keeps
only each checkpointed decoder layer's input and backward recomputes the layer. It is non-reentrant,
and input-embedding outputs require grad so LoRA receives gradients through frozen, checkpointed
layers. ``checkpointing: auto`` asks the planner for the policy with the least recompute that fits.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.memory.planner import GIB, choose_policy, plan, policy_name
from qlora_kit.recipe import RecipeError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from qlora_kit.recipe import MemorySection, Recipe

log = logging.getLogger(__name__)


def resolve_checkpointing(recipe: Recipe) -> MemorySection:
    """The memory section with ``checkpointing: auto`` replaced by the planner's choice (logged, with why)."""
    memory = recipe.memory
    if memory.checkpointing != "auto":
        return memory
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # per GPU of this launch: under FSDP the weights and optimizer state are sharded over its processes
    the_plan = plan(recipe, device=device, processes=int(os.environ.get("WORLD_SIZE", "1")))
    if not the_plan.fitting(memory.budget_gb) and not memory.over_budget:
        smallest = min(the_plan.policies, key=lambda p: p.peak)
        raise RecipeError(
            f"memory.budget_gb: no checkpointing policy fits {memory.budget_gb:g} GiB (the smallest predicted "
            f"peak is {smallest.peak / GIB:.2f} GiB, with full checkpointing); lower train.micro_batch_size "
            f"({recipe.train.micro_batch_size}), data.max_seq_len ({recipe.data.max_seq_len}) or lora.rank "
            f"({recipe.lora.rank}), or set memory.over_budget: true to train anyway"
        )
    policy, every_n, why = choose_policy(recipe, memory.budget_gb, the_plan)
    chosen = memory.model_copy(update={"checkpointing": policy, "every_n": every_n})
    log.info("memory.checkpointing auto: %s (%s)", policy_name(policy, every_n), why)
    return chosen


def enable_checkpointing(model: PreTrainedModel, memory: MemorySection) -> list[int]:
    """Apply the checkpointing policy to the decoder layers; returns the indices of checkpointed layers."""
    if memory.checkpointing == "none":
        return []
    if memory.checkpointing == "auto":
        raise ValueError("memory.checkpointing: resolve auto with resolve_checkpointing(recipe) first")
    every_n = memory.every_n if memory.checkpointing == "every_n" else 1
    offload = memory.offload_activations and torch.accelerator.is_available()
    if memory.offload_activations and not offload:
        log.info("memory.offload_activations: no accelerator here, activations already live in host memory")
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n, offload=offload)
    return checkpointed_layers(model)


def checkpointed_layers(model: PreTrainedModel) -> list[int]:
    """Indices of decoder layers that recompute in backward."""
    return [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]
