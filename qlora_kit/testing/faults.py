"""The tests' faults, installed through the one seam (memory/fault_seam.py): the out-of-memory injector
(``oom_faults``: bytes saved for backward, a recompute's, evaluation's and generation's live bytes) and
the allocation cap (``allocator_faults``), both read from the environment when each run is built.

``install()`` puts them in force in this process (tests/conftest.py does for the whole suite, benchmarks
that cap memory do too); ``python -m qlora_kit.testing ARGS`` is ``qlora-kit ARGS`` with them installed,
for a run in another process (torchrun's).
"""

from __future__ import annotations

import contextlib

from qlora_kit.memory import fault_seam
from qlora_kit.testing.allocator_faults import ALLOCATIONS
from qlora_kit.testing.oom_faults import INJECTOR, reload_cap


class EnvFaults(fault_seam.Faults):
    """``oom_faults.INJECTOR`` and ``allocator_faults.ALLOCATIONS`` at the seam's points: each inert
    while its environment variable is unset."""

    def run_built(self, model) -> None:
        injector = reload_cap()  # a test sets the caps after import: read when each run is built
        ALLOCATIONS.reload()
        if injector.cap is not None or injector.eval_cap is not None:
            injector.watch(model)

    @property
    def counts_saved(self) -> bool:
        return INJECTOR.cap is not None

    @property
    def counts_recompute(self) -> bool:
        return INJECTOR.cap is not None

    def forward_started(self) -> None:
        INJECTOR.forward_started()

    def saved(self, total: int) -> None:
        INJECTOR.saved(total)

    def recompute(self) -> contextlib.AbstractContextManager:
        return INJECTOR.recompute_context()

    def evaluation(self) -> contextlib.AbstractContextManager:
        return INJECTOR.evaluation()

    def generation(self) -> contextlib.AbstractContextManager:
        return INJECTOR.generation()

    def micro_batch(self) -> contextlib.AbstractContextManager:
        return ALLOCATIONS.micro_batch()

    def attempt_started(self) -> None:
        ALLOCATIONS.attempt_started()

    def figures(self) -> str:
        return ALLOCATIONS.figures()


def install() -> EnvFaults:
    """The environment's faults in force in this process (idempotent); returns them."""
    current = fault_seam.installed()
    if isinstance(current, EnvFaults):
        return current
    faults = EnvFaults()
    fault_seam.install(faults)
    return faults
