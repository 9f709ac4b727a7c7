"""An out-of-memory error raised where CUDA raises it, from the allocation path, for tests on the CPU.

``oom_faults.py`` raises from what a forward pass saves for backward: a measure of our own, blind to
what the caching allocator still holds. On the H200 a split step ran out of memory again at every retry
with 13.3 GiB of the 13.46 GiB cap still allocated: the failed attempt's tensors were alive, and no CPU
test could see it. This one counts as the allocator does. With ``QLORA_KIT_OOM_ALLOCATION_CAP_BYTES=N``
set, a dispatch mode around each training micro-batch (every attempt of it) counts the bytes of every
tensor an operator allocates, for as long as the tensor lives, and an operator that takes the count past
N raises ``torch.OutOfMemoryError`` from inside the dispatch, in forward, in backward and in a
checkpointed layer's recompute alike. What a failed attempt leaves alive is then counted against the
next attempt, as on the device, and reported: ``AllocationCap.survivors`` has, for each retry, the
bytes still alive from the attempts before it when it begins (0 when recovery frees everything).

Unset (the default), nothing is installed.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ENV = "QLORA_KIT_OOM_ALLOCATION_CAP_BYTES"
MIB = 1024**2


class AllocationCap:
    """The cap, and what each micro-batch's attempts allocated and left alive (one process, one thread)."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.raised = 0
        self.peaks: list[int] = []  # per micro-batch: the most bytes its attempts held at once
        self.survivors: list[int] = []  # per retry: bytes of the failed attempts alive as it begins
        self._mode: _CountAllocations | None = None

    def reload(self) -> AllocationCap:
        """Read the environment again (a test sets the cap after import)."""
        value = os.environ.get(ENV, "").strip()
        self.cap = int(value) if value else None
        return self

    @contextlib.contextmanager
    def micro_batch(self):
        """Around one micro-batch's attempts: every allocation counted while its tensor lives."""
        if self.cap is None:
            yield
            return
        self._mode = _CountAllocations(self)
        self.peaks.append(0)
        try:
            with self._mode:
                yield
        finally:
            self._mode = None

    def attempt_started(self) -> None:
        """Called as each attempt begins: a retry records what the failed ones before it left alive."""
        if self._mode is not None:
            if self._mode.attempt > 0:
                self.survivors.append(self._mode.live)
            self._mode.attempt += 1

    def figures(self) -> str:
        """The count at a failure, as ``memory_figures`` gives CUDA's allocator's."""
        if self._mode is None:
            return ""
        return (
            f"allocated by the micro-batch {self._mode.live / MIB:.2f} MiB of a {self.cap / MIB:.2f} MiB cap"
        )


class _CountAllocations(TorchDispatchMode):
    """Each operator's new tensors (not views, not in-place results) count from their creation until they
    are collected; one that takes the count past the cap is dropped and the error raised in its place."""

    def __init__(self, owner: AllocationCap) -> None:
        super().__init__()
        self.owner = owner
        self.live = 0
        self.attempt = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = {
            t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        new = [
            t
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs
        ]
        nbytes = sum(t.untyped_storage().nbytes() for t in new)
        if self.live + nbytes > self.owner.cap:
            self.owner.raised += 1
            held = self.live
            del out, new
            raise torch.OutOfMemoryError(
                f"qlora_kit allocation cap: {func} tried to allocate {nbytes / MIB:.2f} MiB with "
                f"{held / MIB:.2f} MiB of the {self.owner.cap / MIB:.2f} MiB cap allocated"
            )
        for tensor in new:
            size = tensor.untyped_storage().nbytes()
            self.live += size
            weakref.finalize(tensor, self._freed, size)
        peaks = self.owner.peaks
        peaks[-1] = max(peaks[-1], self.live)
        return out

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


ALLOCATIONS = AllocationCap(None).reload()
