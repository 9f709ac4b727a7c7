"""The one point where a test's fault injector enters a run; without one installed, the run has none.

A CPU has no device memory to run out of, so the recovery from out-of-memory (training/step/
oom_recovery.py) is tested by injectors that raise a real ``torch.OutOfMemoryError`` where a GPU's
allocation would fail (qlora_kit/testing/: ``oom_faults`` and ``allocator_faults``). They live with the
tests' machinery, and no module of the package imports them: a test (or a benchmark, or
``python -m qlora_kit.testing``) calls ``install`` with its ``Faults``.

The run reads the seam when it is built, never in a step: ``run_built`` as checkpointing is enabled (the
recompute's count joins torch checkpoint's ``context_fn`` there), ``trainer_built`` once the trainer
exists, where the faults attach what they count to the trainer's objects themselves. A step then runs
the same code with faults or without; with none installed (every run outside the tests) it calls
nothing of this module (tests/test_host_syncs.py counts what it calls). ``failure_figures`` is read once
an attempt has failed, off the step's path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from qlora_kit.memory import accounting


class Faults(Protocol):
    """What a test's injector provides (qlora_kit/testing/faults.py's ``EnvFaults``)."""

    def run_built(self, model: Any) -> None:
        """The model of a run being built: the injector reads its caps and the weights here."""

    @property
    def counts_recompute(self) -> bool:
        """Whether each checkpointed layer's recompute runs inside ``recompute()``."""

    def recompute(self) -> contextlib.AbstractContextManager:
        """Around a checkpointed layer's recompute in backward."""

    def trainer_built(self, trainer: Any) -> None:
        """The run's trainer: the injector wraps what it counts around the trainer's objects."""

    def forward_started(self) -> None:
        """A training forward pass begins (``accounting.SavedTensors``' step observers)."""

    def saved(self, total: int) -> None:
        """The running count of bytes saved for backward, after each new storage."""

    def figures(self) -> str:
        """What the injector holds when an attempt fails."""


_installed: Faults | None = None


def installed() -> Faults | None:
    """The faults in force: None unless a test installed its own."""
    return _installed


def install(faults: Faults | None) -> Faults | None:
    """Put ``faults`` in force (tests and benchmarks only; None removes them); returns the ones replaced.
    The bytes a training forward pass saves are reported to them from then on."""
    global _installed
    previous, _installed = _installed, faults
    accounting.STEP_OBSERVERS[:] = [faults] if faults is not None else []
    return previous


def run_built(model: Any) -> Faults | None:
    """A run's model is being built: the faults in force read it; returns them (None: no faults)."""
    if _installed is not None:
        _installed.run_built(model)
    return _installed


def trainer_built(trainer: Any) -> None:
    """A run's trainer is built: the faults in force attach to it (none: nothing happens)."""
    if _installed is not None:
        _installed.trainer_built(trainer)


def failure_figures() -> str:
    """What the faults in force held when an attempt failed ("" without faults)."""
    return _installed.figures() if _installed is not None else ""
