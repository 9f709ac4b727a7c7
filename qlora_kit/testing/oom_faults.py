"""A fault injector for tests and benchmarks: a real ``torch.OutOfMemoryError`` on a machine without one.

A CPU has no device memory to run out of, so the recovery from out-of-memory (training/step/oom_recovery.py)
could not be tested there. With ``QLORA_KIT_OOM_CAP_BYTES=N`` in the environment, a training forward
or backward pass that needs more than N bytes raises ``torch.OutOfMemoryError``, where the
allocation would fail on a GPU; everything after the raise is the real code path:

- in the forward pass, when the bytes saved for backward so far (``accounting.SavedTensors``' count,
  which excludes parameters and counts a storage once) pass N: the raise comes from autograd's
  pack hook, inside the operation that saves, with the partial graph alive in its frames;
- in the backward pass, when a checkpointed decoder layer is recomputed: the forward's saved bytes
  plus the live bytes the recompute has allocated (each operation's outputs while they live, counted
  by a dispatch mode that torch's checkpoint enters around the recompute through its ``context_fn``)
  pass N. Some LoRA
  gradients of the micro-batch have then been accumulated already, as on a GPU.

- in evaluation (no grad: nothing is saved), when the live bytes of the forward pass's activations,
  counted the same way, pass ``QLORA_KIT_OOM_EVAL_CAP_BYTES`` (default: N).

- in GRPO's rollouts (``generate`` under no grad), when the live bytes of one generate call — the KV
  cache and each step's logits, counted the same way — pass ``QLORA_KIT_OOM_GENERATION_CAP_BYTES``
  (unset: generation is not capped; the training cap counts bytes saved for backward, another measure).

With ``QLORA_KIT_OOM_RANK=R`` as well, only the process of rank R (torchrun's ``RANK``) is capped: one
process of a multi-process run runs out of memory, its peers do not.

Unset (the default), nothing is installed: no hook, no dispatch mode, no cost.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ENV = "QLORA_KIT_OOM_CAP_BYTES"
EVAL_ENV = "QLORA_KIT_OOM_EVAL_CAP_BYTES"  # evaluation's own cap (default: the training cap)
GENERATION_ENV = "QLORA_KIT_OOM_GENERATION_CAP_BYTES"  # GRPO's generate calls (default: not capped)
RANK_ENV = "QLORA_KIT_OOM_RANK"  # the one rank the caps apply to (default: every rank)
MIB = 1024**2


class FaultInjector:
    """The cap and the forward pass's running count (one forward pass at a time per process)."""

    def __init__(
        self, cap: int | None, eval_cap: int | None = None, generation_cap: int | None = None
    ) -> None:
        self.cap = cap
        self.eval_cap = eval_cap
        self.generation_cap = generation_cap
        self.generation_peaks: list[int] = []  # per generate call: its live bytes' peak
        self.forward_bytes = 0  # bytes saved for backward by the latest training forward pass
        self.raised = 0  # errors raised so far, for tests and benchmarks
        self.weights: set[int] = set()  # data pointers of the model's parameters and buffers
        self.peaks: list[int] = []  # per training micro-batch (or part): its forward and backward's peak
        self.eval_peaks: list[int] = []  # per evaluation batch (or part): its live bytes' peak
        self.forwards: list[int] = []  # per training micro-batch (or part): bytes its forward pass saved

    def watch(self, model: torch.nn.Module) -> None:
        """Know the model's weights (the recompute's count leaves out what is made from them alone)."""
        tensors = [*model.parameters(), *model.buffers()]
        for param in model.parameters():  # a 4-bit weight's quantization constants are attributes
            state = getattr(param, "quant_state", None)
            while state is not None:
                tensors += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
                state = getattr(state, "state2", None)
        self.weights = {t.data_ptr() for t in tensors}

    def forward_started(self) -> None:
        self.forward_bytes = 0
        self.peaks.append(0)
        self.forwards.append(0)

    def _seen(self, total: int) -> None:
        if self.peaks:
            self.peaks[-1] = max(self.peaks[-1], total)

    def saved(self, total: int) -> None:
        """Called by ``SavedTensors`` with its running count after each newly saved storage."""
        self.forward_bytes = total
        self.forwards[-1] = total
        self._seen(total)
        if self.cap is not None and total > self.cap:
            self._raise(f"forward: {total / MIB:.2f} MiB saved for backward")

    def recompute_context(self) -> contextlib.AbstractContextManager:
        """What torch's checkpoint enters around a layer's recompute (``context_fn``'s second half)."""
        if self.cap is None:
            return contextlib.nullcontext()
        return _CountLive(self, self.cap, "backward: recomputing a checkpointed layer", self.peaks)

    def evaluation(self) -> contextlib.AbstractContextManager:
        """Around an evaluation forward pass (no grad, nothing saved): its live bytes against the eval cap."""
        if self.eval_cap is None:
            return contextlib.nullcontext()
        self.forward_bytes = 0
        self.eval_peaks.append(0)
        return _CountLive(self, self.eval_cap, "evaluation", self.eval_peaks)

    def generation(self) -> contextlib.AbstractContextManager:
        """Around one ``generate`` call of GRPO's rollouts: its live bytes (KV cache, logits) against the
        generation cap."""
        if self.generation_cap is None:
            return contextlib.nullcontext()
        self.forward_bytes = 0
        self.generation_peaks.append(0)
        return _CountLive(self, self.generation_cap, "generation", self.generation_peaks)

    def _raise(self, where: str, cap: int | None = None) -> None:
        self.raised += 1
        cap = self.cap if cap is None else cap
        raise torch.OutOfMemoryError(
            f"qlora_kit fault injector (cap {cap} bytes): {where}, over the cap of {cap / MIB:.2f} MiB"
        )


class _CountLive(TorchDispatchMode):
    """The live bytes of the activations a checkpointed layer's recompute (or an evaluation forward
    pass) allocates: each operation's
    outputs count from their creation until the tensor is collected, unless every tensor it read is
    a weight or made from weights only (a dequantized 4-bit weight, an autocast copy: the same for
    any batch, and on a GPU transient)."""

    def __init__(self, injector: FaultInjector, cap: int, where: str, peaks: list[int]) -> None:
        super().__init__()
        self.injector, self.cap, self.where, self.peaks = injector, cap, where, peaks
        self.live = 0
        self.weight_made: set[int] = set()  # data pointers of tensors made from weights alone

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.numel() > 1]
        from_weights = all(self._is_weight(t) for t in read)
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or func.is_view:
                continue
            if from_weights:
                key = leaf.data_ptr()
                self.weight_made.add(key)
                weakref.finalize(leaf, self.weight_made.discard, key)
            else:
                nbytes = leaf.numel() * leaf.element_size()
                self.live += nbytes
                weakref.finalize(leaf, self._freed, nbytes)
        total = self.injector.forward_bytes + self.live
        if self.peaks:
            self.peaks[-1] = max(self.peaks[-1], total)
        if total > self.cap:
            self.injector._raise(
                f"{self.where}, {total / MIB:.2f} MiB ({self.injector.forward_bytes / MIB:.2f} saved by the "
                "forward pass)",
                self.cap,
            )
        return out

    def _is_weight(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self.injector.weights or tensor.data_ptr() in self.weight_made

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def cap_from_env(name: str = ENV) -> int | None:
    """The cap in bytes from the environment variable, or None when unset or empty, or when
    ``QLORA_KIT_OOM_RANK`` names another rank than this process's."""
    value = os.environ.get(name, "").strip()
    only = os.environ.get(RANK_ENV, "").strip()
    if only and os.environ.get("RANK", "0") != only:
        return None
    return int(value) if value else None


INJECTOR = FaultInjector(
    cap_from_env(), cap_from_env(EVAL_ENV) or cap_from_env(), cap_from_env(GENERATION_ENV)
)


def reload_cap() -> FaultInjector:
    """Read the environment again (a test sets the cap after import); returns the injector."""
    INJECTOR.cap = cap_from_env()
    INJECTOR.eval_cap = cap_from_env(EVAL_ENV) or INJECTOR.cap
    INJECTOR.generation_cap = cap_from_env(GENERATION_ENV)
    return INJECTOR
