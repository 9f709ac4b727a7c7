"""torch's autocast state, kept across an attempt that fails inside accelerate's autocast (``autocast_kept``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

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
