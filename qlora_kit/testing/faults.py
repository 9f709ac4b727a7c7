"""The tests' faults, installed through the one seam (memory/fault_seam.py): the out-of-memory injector
(``oom_faults``: bytes saved for backward, a recompute's, evaluation's and generation's live bytes) and
the allocation cap (``allocator_faults``), both read from the environment when each run is built.

A run's step names none of them: once the run's trainer is built (``trainer_built``) they wrap the
trainer's own objects, in this process only (the micro-batch's attempts, evaluation's loss, GRPO's
generate calls), and ``accounting.SavedTensors`` reports a training forward pass's saved bytes to them.

``install()`` puts them in force in this process (tests/conftest.py does for the whole suite, benchmarks
that cap memory do too); ``python -m qlora_kit.testing ARGS`` is ``qlora-kit ARGS`` with them installed,
for a run in another process (torchrun's).
"""

from __future__ import annotations

import contextlib
import functools

from qlora_kit.memory import fault_seam
from qlora_kit.testing.allocator_faults import ALLOCATIONS
from qlora_kit.testing.oom_faults import INJECTOR, reload_cap


class EnvFaults:
    """``oom_faults.INJECTOR`` and ``allocator_faults.ALLOCATIONS`` (fault_seam.Faults): each inert while
    its environment variable is unset."""

    def run_built(self, model) -> None:
        injector = reload_cap()  # a test sets the caps after import: read when each run is built
        ALLOCATIONS.reload()
        if injector.cap is not None or injector.eval_cap is not None:
            injector.watch(model)

    @property
    def counts_recompute(self) -> bool:
        return INJECTOR.cap is not None

    def recompute(self) -> contextlib.AbstractContextManager:
        return INJECTOR.recompute_context()

    def forward_started(self) -> None:
        if INJECTOR.cap is not None:
            INJECTOR.forward_started()

    def saved(self, total: int) -> None:
        if INJECTOR.cap is not None:
            INJECTOR.saved(total)

    def figures(self) -> str:
        return ALLOCATIONS.figures()

    def trainer_built(self, trainer) -> None:
        """The caps wrapped around the trainer's own objects (instance attributes: this trainer only)."""
        oom = trainer.oom
        oom.train = _inside(ALLOCATIONS.micro_batch, oom.train)  # every attempt of a micro-batch
        oom._attempt = _after(ALLOCATIONS.attempt_started, oom._attempt)
        trainer.compute_loss = _evaluation_capped(trainer.compute_loss)
        if hasattr(oom, "generate_in_parts"):  # GRPO: each generate call under the generation cap
            oom.generate_in_parts = _generation_capped(oom.generate_in_parts)


def _inside(context, method):
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with context():
            return method(*args, **kwargs)

    return wrapped


def _after(first, method):
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        first()
        return method(*args, **kwargs)

    return wrapped


def _evaluation_capped(compute_loss):
    @functools.wraps(compute_loss)
    def wrapped(model, *args, **kwargs):
        context = contextlib.nullcontext() if model.training else INJECTOR.evaluation()
        with context:
            return compute_loss(model, *args, **kwargs)

    return wrapped


def _generation_capped(generate_in_parts):
    @functools.wraps(generate_in_parts)
    def wrapped(prompt_ids, generate_rows):
        def capped(rows, first):
            with INJECTOR.generation():
                return generate_rows(rows, first)

        return generate_in_parts(prompt_ids, capped)

    return wrapped


def install() -> EnvFaults:
    """The environment's faults in force in this process (idempotent); returns them."""
    current = fault_seam.installed()
    if isinstance(current, EnvFaults):
        return current
    faults = EnvFaults()
    fault_seam.install(faults)
    return faults
