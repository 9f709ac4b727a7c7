"""The one point where a test's fault injector enters a run; without one installed, nothing happens.

A CPU has no device memory to run out of, so the recovery from out-of-memory (training/step/
oom_recovery.py) is tested by injectors that raise a real ``torch.OutOfMemoryError`` where a GPU's
allocation would fail (qlora_kit/testing/: ``oom_faults`` and ``allocator_faults``). They live with the
tests' machinery, and no module of the package imports them: a test (or a benchmark, or
``python -m qlora_kit.testing``) calls ``install`` with its ``Faults``, and the run reaches them through
``installed()`` at the points below, each a no-op of this class by default.
"""

from __future__ import annotations

import contextlib
from typing import Any


class Faults:
    """No faults: every run's, unless a test installs its injector. The points, in the order a run
    reaches them: ``run_built`` (checkpointing is enabled), ``micro_batch`` (around a training
    micro-batch's attempts) and ``attempt_started`` (each attempt), ``forward_started`` and ``saved``
    (a training forward pass's bytes saved for backward, ``accounting.SavedTensors``), ``recompute``
    (around a checkpointed layer's recompute), ``evaluation`` and ``generation`` (a no-grad forward
    pass, a ``generate`` call), ``figures`` (what the injector holds when an attempt fails)."""

    def run_built(self, model: Any) -> None:
        """The model of a run being built: an injector reads its caps and the weights here."""

    @property
    def counts_saved(self) -> bool:
        """Whether ``forward_started`` and ``saved`` are called (the saved-bytes cap is set)."""
        return False

    @property
    def counts_recompute(self) -> bool:
        """Whether each checkpointed layer's recompute runs inside ``recompute()``."""
        return False

    def forward_started(self) -> None:
        pass

    def saved(self, total: int) -> None:
        """The running count of bytes saved for backward, after each new storage."""

    def recompute(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def evaluation(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def generation(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def micro_batch(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def attempt_started(self) -> None:
        pass

    def figures(self) -> str:
        return ""


_installed: Faults = Faults()


def installed() -> Faults:
    """The faults in force: the inert ``Faults`` unless a test installed its own."""
    return _installed


def install(faults: Faults) -> Faults:
    """Put ``faults`` in force (tests and benchmarks only); returns the ones it replaces."""
    global _installed
    previous, _installed = _installed, faults
    return previous
