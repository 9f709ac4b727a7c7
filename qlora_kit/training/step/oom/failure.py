"""What a failed attempt leaves: the error as text (its frames hold the activations), the memory released and
its figures, and what is said about it: a split's ``metrics.jsonl`` row, a stop's one line."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qlora_kit.memory import fault_seam
from qlora_kit.registries import metric_keys as keys
from qlora_kit.training.step.oom.rows import rows_of, tokens_of, width_of

if TYPE_CHECKING:
    from qlora_kit.training.step.oom.policy import OomPolicy


@dataclass
class Failure:
    """What is kept of an out-of-memory error once it and its frames are gone: text only."""

    message: str
    figures: str
    lost_s: float = 0.0  # from the failed attempt's start to the error


def release_memory() -> None:
    """Give back what the failed attempt held: autograd's queues let go of a stopped backward pass, the
    collector breaks reference cycles through the dropped frames, then the caching allocator returns its
    free blocks to the device."""
    _drain_autograd_queues()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _drain_autograd_queues() -> None:
    """A backward pass stopped by an error leaves the nodes that were ready to run in autograd's ready
    queue of their device, with the gradients waiting for them, until the next backward pass on that
    device pops and drops them (a failed recompute kept a checkpointed layer's frame and 4 of a capped
    tiny run's 7.3 MiB there: tests/e2e/test_oom.py). A one-value backward pass on each device pops them
    now, before the retry allocates."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    for device in devices:
        leaf = torch.zeros((), device=device, requires_grad=True)
        (leaf * 1).backward()


def memory_figures() -> str:
    """The device's memory at the failure, as the log line shows it (CUDA only)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    gib = 1024**3
    free, total = torch.cuda.mem_get_info()
    return (
        f"allocated {torch.cuda.memory_allocated() / gib:.2f} GiB, peak {torch.cuda.max_memory_allocated() / gib:.2f}"
        f" GiB, reserved {torch.cuda.memory_reserved() / gib:.2f} GiB, free {free / gib:.2f} of {total / gib:.2f} GiB"
    )


def held_after_release() -> str:
    """What is still allocated once a failed attempt is dropped (CUDA's allocator, or the CPU's
    allocation cap in tests): the next attempt starts from it."""
    if torch.cuda.is_available():
        return f"allocated {torch.cuda.memory_allocated() / 1024**3:.2f} GiB"
    return fault_seam.failure_figures() or "no CUDA device"


def split_record(step: int, phase: str, rows: int, parts: int, failure: Failure) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of a split: where, the micro-batch before and after, the error."""
    return {
        "step": step,
        keys.OOM_SPLIT: {
            "phase": phase,
            keys.MICRO_BATCH_BEFORE: -(-rows // (parts // 2)),
            keys.MICRO_BATCH: -(-rows // parts),
            keys.MICRO_BATCH_PARTS: parts,
            "error": failure.message,
            "memory": failure.figures,
            keys.LOST_SECONDS: round(failure.lost_s, 3),
        },
    }


def stop_message(
    step: int, where: str, inputs: dict[str, Any], policy: OomPolicy, failure: Failure, kept: str
) -> str:
    """One line for a micro-batch that cannot be split further, or for ``on_oom: stop``."""
    rows, seq = rows_of(inputs), width_of(inputs)
    predicted = policy.predict(rows, seq) if policy.predict is not None else None
    plan = f"; the planner predicts {predicted} for it" if predicted else ""
    return (
        f"step {step}: out of memory in {where} ({failure.message}; {failure.figures}): a micro-batch of "
        f"{rows} row{'s' if rows != 1 else ''}, {tokens_of(inputs)} tokens ({rows} x {seq}){plan}. "
        f"To fit it: {policy.levers}; {kept}"
    )
