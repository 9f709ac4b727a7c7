"""The out-of-memory split policy: the pieces of out-of-memory recovery (oom_recovery.py) that need no
Trainer: a micro-batch cut into parts, the random and autocast states a redone step restores, the split
file in a checkpoint, the memory figures and the messages of a split or a stop, and the recipe's policy
(``train.on_oom``, ``train.probe_worst_batch``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qlora_kit.registries import checkpointing as table
from qlora_kit.registries import metric_keys as keys
from qlora_kit.registries import objectives

if TYPE_CHECKING:
    from collections.abc import Callable

    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

SPLIT_FILE = "micro_batch_split.json"  # in each checkpoint: the parts a resumed run continues with


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


@dataclass
class Failure:
    """What is kept of an out-of-memory error once it and its frames are gone: text only."""

    message: str
    figures: str
    lost_s: float = 0.0  # from the failed attempt's start to the error


def rows_of(inputs: dict[str, Any]) -> int:
    """The rows of a micro-batch: its sequences, or a GRPO rollout's completions."""
    return int(inputs["input_ids" if "input_ids" in inputs else "prompt_ids"].shape[0])


def width_of(inputs: dict[str, Any]) -> int:
    """The positions of a micro-batch's rows, padding included (a rollout's: prompt and completion)."""
    if "input_ids" in inputs:
        return int(inputs["input_ids"].shape[-1])
    return int(inputs["prompt_ids"].shape[-1] + inputs["completion_ids"].shape[-1])


def split_rows(inputs: dict[str, Any], parts: int, trim: bool) -> list[dict[str, Any]]:
    """The micro-batch as ``parts`` chunks of consecutive rows (as equal as can be). ``trim``: cut each
    chunk's right padding (columns no row of it attends to), as a batch of those rows alone is padded."""
    if parts == 1:
        return [inputs]
    rows = rows_of(inputs)
    chunks: list[dict[str, Any]] = [{} for _ in range(min(parts, rows))]
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            for chunk, piece in zip(chunks, torch.tensor_split(value, len(chunks)), strict=True):
                chunk[name] = piece
        else:
            for chunk in chunks:
                chunk[name] = value
    return [_trimmed(c) for c in chunks] if trim else chunks


def _trimmed(chunk: dict[str, Any]) -> dict[str, Any]:
    mask = chunk.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return chunk
    length = mask.shape[1]
    attended = mask.any(dim=0).nonzero()
    if len(attended) == 0:
        return chunk
    end = int(attended.max()) + 1  # right padding ends where no row attends any more
    if end == length:
        return chunk
    return {
        k: v[:, :end] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == length else v
        for k, v in chunk.items()
    }


def tokens_of(inputs: dict[str, Any]) -> int:
    """The positions of a batch that are not padding."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    if "prompt_mask" in inputs:  # a GRPO rollout (TRL's GRPOTrainer._generate_and_score_completions)
        return int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    return int(inputs["input_ids"].numel())


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
    from qlora_kit.memory import fault_seam

    if torch.cuda.is_available():
        return f"allocated {torch.cuda.memory_allocated() / 1024**3:.2f} GiB"
    return fault_seam.installed().figures() or "no CUDA device"


AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """torch's autocast state of this thread: its nesting, its cache switch, each device's switch and dtype.

    accelerate 1.10.1's ``Accelerator.autocast`` (our floor; 1.16 enters it with ``with``), which our chunked
    loss head and TRL's GRPO, DPO and KTO forward passes run under, enters torch's autocast before its
    ``yield`` and leaves it after, with no ``finally`` (a torch.compile'd region does the same: pytorch
    issue 195488): an out-of-memory error raised inside it leaves autocast on and its nesting one deep for
    the rest of the process, so the cache of casts, emptied only when the nesting returns to 0, is never
    emptied again. Every later forward pass then runs on the 16-bit copies of the LoRA weights cast before
    the error while the optimizer moves the fp32 ones (CI on torch 2.7: the guard found every LoRA A
    without a gradient)."""

    nesting: int
    cache_enabled: bool
    devices: dict[str, tuple[bool, torch.dtype]]

    @classmethod
    def now(cls) -> AutocastState:
        devices = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES}
        return cls(_autocast_nesting(), torch.is_autocast_cache_enabled(), devices)

    def restore(self) -> None:
        for device, (enabled, dtype) in self.devices.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.cache_enabled)
        nesting = _autocast_nesting()
        while nesting > self.nesting:
            nesting = torch.autocast_decrement_nesting()
        if nesting == 0:
            torch.clear_autocast_cache()  # what leaving the outermost autocast does


def _autocast_nesting() -> int:
    # torch reads the depth only as the result of a change: one step in and back out
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


@contextlib.contextmanager
def autocast_kept():
    """Around an attempt: on an error from inside it, autocast is put back as it was before it."""
    before = AutocastState.now()
    try:
        yield
    except BaseException:
        before.restore()
        raise


def rng_state() -> dict[str, Any]:
    """Every random state a step draws from (dropout: torch's; the probe also restores Python's, NumPy's)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def write_split(folder: Path, parts: int, eval_parts: int, generation_parts: int = 1) -> None:
    saved = {"parts": parts, "eval_parts": eval_parts}
    if generation_parts > 1:  # GRPO's rollouts: generate calls per generation batch (grpo/oom.py)
        saved["generation_parts"] = generation_parts
    (folder / SPLIT_FILE).write_text(json.dumps(saved) + "\n")


def read_split(folder: Path) -> tuple[int, int]:
    """(parts, eval parts) a checkpoint was written with; (1, 1) when it has no file (never split)."""
    path = folder / SPLIT_FILE
    if not path.is_file():
        return 1, 1
    saved = json.loads(path.read_text())
    return int(saved["parts"]), int(saved["eval_parts"])


def read_generation_parts(folder: Path) -> int:
    """The generate calls a GRPO checkpoint's rollouts were split in; 1 when never split."""
    path = folder / SPLIT_FILE
    return int(json.loads(path.read_text()).get("generation_parts", 1)) if path.is_file() else 1


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


def concat(values: list[Any]) -> Any:
    if values[0] is None:
        return None
    if isinstance(values[0], (tuple, list)):
        return type(values[0])(concat(list(group)) for group in zip(*values, strict=True))
    return torch.cat(values, dim=0)
