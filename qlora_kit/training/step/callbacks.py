"""Every callback of a run, in the order the Trainer calls them, attached here and nowhere else; they act
between the micro-batches and the optimizer step (trainer.py's module docstring, items 3 to 6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import ProgressCallback, TrainerCallback
from transformers.trainer_callback import PrinterCallback

from qlora_kit.training.watch.run_console import RunConsole

if TYPE_CHECKING:
    from rich.console import Console

    from qlora_kit.memory.monitor import MemoryMonitor
    from qlora_kit.training.step.guards import TrainingGuard
    from qlora_kit.training.watch.metrics_log import MetricsLog
    from qlora_kit.training.watch.throughput import Throughput


def callbacks(
    monitor: MemoryMonitor,
    throughput: Throughput,
    routing: list[TrainerCallback],
    metrics_log: MetricsLog,
    guard: TrainingGuard | None,
    trackers: list[TrainerCallback],
    stopping: list[TrainerCallback],
    objective: list[TrainerCallback],
    callers: list[TrainerCallback],
) -> list[TrainerCallback]:
    """Every callback of a run, in the order the Trainer calls them: the memory monitor, the throughput
    and a mixture of experts' routing first (they add their figures to the logs the others write), the
    metrics file, the guard, the trackers, early stopping, the objective's own (GRPO's explanations), the
    caller's."""
    return [
        monitor,
        throughput,
        *routing,
        metrics_log,
        *([guard] if guard is not None else []),
        *trackers,
        *stopping,
        *objective,
        *callers,
    ]


def show_on(trainer, console: Console) -> TrainerCallback:
    """The run console in place of the Trainer's progress bars and printed log dicts (training/watch/run_console.py):
    the last callback, after every figure is in the logs."""
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    run_console = RunConsole(console)
    trainer.add_callback(run_console)
    return run_console
