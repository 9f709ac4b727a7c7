"""The recipe's out-of-memory policy: split or stop (``train.on_oom``), the levers a stop names, the planner's
prediction for the batch that failed, and whether the worst batch runs first (``train.probe_worst_batch``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qlora_kit.registries import checkpointing as table
from qlora_kit.registries import objectives

if TYPE_CHECKING:
    from collections.abc import Callable

    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass
class OomPolicy:
    """``on_oom``: split or stop; ``levers``: the recipe's memory fields as the stop message names them;
    ``predict``: (rows, sequence) -> the planner's peak for such a batch, as text (None: not known)."""

    on_oom: str = "split"
    levers: str = ""
    predict: Callable[[int, int], str | None] | None = None


def oom_policy(recipe: Recipe) -> OomPolicy:
    """The recipe's ``train.on_oom``, its memory levers as a stop names them, and the planner's prediction."""
    memory, data = recipe.memory, recipe.data
    levers = (
        f"memory.checkpointing (now {memory.checkpointing}; full keeps the least), a lower data.max_seq_len "
        f"(now {data.max_seq_len}), a lower memory.loss_chunk_tokens (now {memory.loss_chunk_tokens})"
    )
    if memory.chunked_loss is False:  # full logits (set, or chosen by auto): the chunked head keeps less
        levers += " with memory.chunked_loss true (now full logits)"
    if objectives.of(recipe).rollouts:  # the rollouts' peak and the policy step's (grpo/oom.py)
        grpo = recipe.grpo
        levers = (
            f"a lower grpo.max_completion_length (now {grpo.max_completion_length}; both peaks), fewer "
            f"completions per step (train.micro_batch_size x grad_accum, now {recipe.train.micro_batch_size} x "
            f"{recipe.train.grad_accum}; the rollouts' KV cache, in groups of grpo.num_generations "
            f"{grpo.num_generations}), a lower train.micro_batch_size (the policy step), memory.checkpointing "
            f"(now {memory.checkpointing}; the policy step)"
        )

    def predict(rows: int, seq: int) -> str | None:
        from qlora_kit.memory import planner

        try:  # a stop's message must not fail on the prediction
            the_plan = planner.plan(
                recipe, batch=rows, seq=seq, device="cuda" if torch.cuda.is_available() else "cpu"
            )
            policy = (
                the_plan.chosen(recipe) if not table.planned(memory.checkpointing) else the_plan.policies[-1]
            )
        except Exception as error:
            log.debug("no plan for the failing batch: %s", error)
            return None
        return f"{policy.peak / 1024**3:.2f} GiB peak under checkpointing {policy.policy}"

    # an objective whose steps cannot be split yet (KTO) stops with the line
    on_oom = recipe.train.on_oom if objectives.of(recipe).splits_on_oom else "stop"
    if recipe.train.fsdp and on_oom == "split":
        # FSDP gathers inside the forward and backward passes: the processes cannot agree on a split
        # there without one of them waiting in a gather (oom_recovery.py)
        log.warning(
            "train.on_oom: split is not available under FSDP (train.fsdp): an out-of-memory error stops "
            "the run with one line, from the newest checkpoint to resume with a smaller train.micro_batch_size"
        )
        on_oom = "stop"
    return OomPolicy(on_oom, levers, predict)


def probes_worst_batch(recipe: Recipe) -> bool:
    """``train.probe_worst_batch``: auto is on where memory can run out (CUDA)."""
    # DPO's pairs have no one input_ids to find the longest by (GRPO probes its own way: grpo/oom.py)
    if not objectives.of(recipe).probes_worst_batch:
        return False
    probe = recipe.train.probe_worst_batch
    return torch.cuda.is_available() if probe == "auto" else bool(probe)
