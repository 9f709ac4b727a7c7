"""``memory.chunked_loss: auto`` resolved from the plan: full logits where the run's planned peak with them fits,
the chunked head (``loss_head.py``) where it does not, with chunks as large as the same budget allows.

The chunked head recomputes the head in backward and runs it as a loop of chunks: on an H200 it cost 41% of
a 1B Llama's step at Llama-3's vocabulary (0.365 s against 0.258 s, 4 x 2,048 tokens) to save 10 GiB that
the device never needed. So the budget decides: ``memory.budget_gb`` where the recipe sets it, else the
memory free when the run starts (``torch.cuda.mem_get_info`` on CUDA, the host's available memory on the
CPU). A plan for a device this machine does not have (a CUDA plan read on a CPU machine) reads nothing of
this machine: without memory.budget_gb it assumes no budget and says so, so that a listing or a plan of a
GPU recipe is the same on every machine and at every moment. The peaks are ``planner.plan``'s, under the recipe's checkpointing (the least-memory policy when it
is ``auto``, which is then chosen against the head chosen here). Used by the pipeline before the weights
load (logged) and by ``qlora-kit plan`` (shown).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

from qlora_kit.memory.planner import GIB, plan
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

# The most doublings of memory.loss_chunk_tokens tried for larger chunks (1,024 x 2^6 = 65,536 tokens)
MAX_DOUBLINGS = 6


@dataclass(frozen=True)
class HeadChoice:
    """The loss head a run trains with: chunked or full logits, tokens a chunk, and why (one line)."""

    chunked: bool
    chunk_tokens: int
    why: str

    def describe(self) -> str:
        head = f"chunked, {self.chunk_tokens:,} tokens a chunk" if self.chunked else "full logits"
        return f"{head} ({self.why})"


def free_bytes(device: str) -> tuple[int | None, str]:
    """(bytes, what they are) the run can still take on ``device``: a GPU's free memory, the host's for a
    CPU run; (None, why) for a CUDA plan on a machine without CUDA (the host's memory is not the GPU's)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None, "no memory.budget_gb and no GPU here to read: assumed no budget"
        free, _ = torch.cuda.mem_get_info()
        return free, "the GPU's free memory"
    return psutil.virtual_memory().available, "the host's available memory"


def with_head(recipe: Recipe, chunked: bool, chunk_tokens: int | None = None) -> Recipe:
    """``recipe`` with ``memory.chunked_loss`` (and ``loss_chunk_tokens``) set."""
    update = {"chunked_loss": chunked}
    if chunk_tokens is not None:
        update["loss_chunk_tokens"] = chunk_tokens
    return recipe.model_copy(update={"memory": recipe.memory.model_copy(update=update)})


def choose_head(recipe: Recipe, device: str, budget_gb: float | None = None, **plan_options) -> HeadChoice:
    """The head ``recipe`` trains with on ``device`` (``plan_options``: ``planner.plan``'s batch, seq,
    trained_share...): as set when ``memory.chunked_loss`` is true or false; with auto, full logits when
    their planned peak fits ``budget_gb`` (else memory.budget_gb, else the device's free memory; a CUDA plan
    without a GPU here assumes no budget: full logits), else the chunked head with the largest chunk (memory.loss_chunk_tokens doubled) whose planned peak fits."""
    memory = recipe.memory
    if memory.chunked_loss != "auto":
        return HeadChoice(bool(memory.chunked_loss), memory.loss_chunk_tokens, "memory.chunked_loss set")
    budget_gb = budget_gb or memory.budget_gb
    if budget_gb is not None:
        budget, source = budget_gb * GIB, f"memory.budget_gb {budget_gb:g} GiB"
    else:
        budget, source = free_bytes(device)
        if budget is None:  # a plan for another machine's GPU: full logits, the head that costs no time
            return HeadChoice(False, memory.loss_chunk_tokens, source)
        source = f"{source}, {budget / GIB:.2f} GiB"
    try:
        full = planned_peak(with_head(recipe, False), device, plan_options)
        if full <= budget:
            return HeadChoice(
                False, memory.loss_chunk_tokens, f"planned peak {full / GIB:.2f} GiB fits {source}"
            )
        # the largest chunk that fits, from the most doublings down: fewer chunks, fewer launches
        for doublings in range(MAX_DOUBLINGS, -1, -1):
            chunk = memory.loss_chunk_tokens * 2**doublings
            peak = planned_peak(with_head(recipe, True, chunk), device, plan_options)
            if peak <= budget or doublings == 0:
                break
    except Exception as error:  # a model the planner cannot plan still trains, on the head that keeps least
        log.debug("memory.chunked_loss auto: no plan (%s)", error)
        return HeadChoice(True, memory.loss_chunk_tokens, "no plan of this model: the head that keeps least")
    why = f"planned peak with full logits {full / GIB:.2f} GiB > {source}; chunked {peak / GIB:.2f} GiB"
    return HeadChoice(True, chunk, why)


def planned_peak(recipe: Recipe, device: str, plan_options: dict) -> int:
    """The planned peak under the recipe's checkpointing (auto: its least-memory policy)."""
    the_plan = plan(recipe, device=device, **plan_options)
    if table.planned(recipe.memory.checkpointing):
        return min(row.peak for row in the_plan.policies)
    return the_plan.chosen(recipe).peak


def resolve_head(recipe: Recipe, **plan_options) -> Recipe:
    """``recipe`` with ``memory.chunked_loss: auto`` replaced by ``choose_head``'s choice on this launch's
    device (per GPU of its processes, as ``auto.resolve_auto`` plans), logged with why."""
    if recipe.memory.chunked_loss != "auto":
        return recipe
    device = "cuda" if torch.cuda.is_available() else "cpu"
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    choice = choose_head(recipe, device, processes=processes, **plan_options)
    log.info("memory.chunked_loss auto: %s", choice.describe())
    return with_head(recipe, choice.chunked, choice.chunk_tokens)
