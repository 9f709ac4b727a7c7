"""What a person watching ``qlora-kit train`` sees: one live line that refreshes in place on a terminal
(progress, time left, loss, eval loss, GRPO's reward, learning rate, gradient norm, tokens per second, memory), the
run's log lines above it, and plain periodic lines where stderr is not a terminal (CI, ``nohup``, a
file): no carriage returns, no escape codes, no raw log dicts. The Trainer's own progress bars and log
printer are replaced by it (step/callbacks.py's ``show_on``); every figure still goes to ``metrics.jsonl``
and the trackers.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import TrainerCallback

from qlora_kit.registries import metric_keys as keys
from qlora_kit.registries import objectives


class RunConsole(TrainerCallback):
    """The run's progress on ``console`` (stderr): live on a terminal, else a line per logging step."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self.progress: Progress | None = None
        self.task = None
        self.figures: dict[str, str] = {}
        self.started = 0.0

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if not state.is_world_process_zero:
            return
        self.started = time.perf_counter()
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[figures]}"),
                console=self.console,
            )
            self.task = self.progress.add_task(
                "train", total=state.max_steps, completed=state.global_step, figures=""
            )
            self.progress.start()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not state.is_world_process_zero or not logs:
            return
        self.figures.update(figures(logs))
        shown = "  ".join(f"{name} {value}" for name, value in self.figures.items())
        if self.progress is not None:
            self.progress.update(self.task, figures=shown)
        elif "loss" in logs or "eval_loss" in logs:
            step = f"step {state.global_step}/{state.max_steps}"
            if "eval_loss" in logs:
                line = f"{step}  eval loss {logs['eval_loss']:.4f}"
                for key, label in objectives.lines("eval_line"):  # dpo: preference accuracy
                    if key in logs:
                        line += f"  {label} {logs[key]:.3f}"
            else:
                left = remaining(time.perf_counter() - self.started, state.global_step, state.max_steps)
                line = f"{step}  {shown}  left {left}"
            # whole lines, never wrapped: a log file is read with grep
            self.console.print(line, highlight=False, soft_wrap=True)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def figures(logs: dict[str, Any]) -> dict[str, str]:
    """The log's figures a person reads, formatted; absent ones are left as they were shown last."""
    shown: dict[str, str] = {}
    if "loss" in logs:
        shown["loss"] = f"{logs['loss']:.4f}"
    if "eval_loss" in logs:
        shown["eval"] = f"{logs['eval_loss']:.4f}"
    for key, label in objectives.lines("console"):  # dpo: eval preference accuracy; grpo: reward
        if key in logs:
            shown[label] = f"{logs[key]:.3f}"
    if "learning_rate" in logs:
        shown["lr"] = f"{logs['learning_rate']:.2e}"
    if "grad_norm" in logs:
        shown["grad"] = f"{logs['grad_norm']:.3f}"
    if keys.THROUGHPUT + keys.TOKENS_PER_S in logs:
        shown["tok/s"] = f"{logs[keys.THROUGHPUT + keys.TOKENS_PER_S]:,.0f}"
    if keys.EXPERTS + keys.MAX_LOAD in logs:  # a mixture of experts: the busiest expert over the mean one
        shown["expert load"] = f"{logs[keys.EXPERTS + keys.MAX_LOAD]:.2f}x"
    peaks = [logs[keys.MEMORY + key] for key in keys.PEAK_KEYS if keys.MEMORY + key in logs]
    if peaks:  # CUDA: the step's peak allocated memory
        shown["peak"] = f"{max(peaks):.2f} GiB"
    elif keys.MEMORY + keys.SAVED_MIB in logs:  # elsewhere: what the forward pass saved for backward
        shown["saved"] = f"{logs[keys.MEMORY + keys.SAVED_MIB]:.1f} MiB"
    return shown


def remaining(seconds: float, step: int, total: int) -> str:
    if step <= 0 or total <= 0:
        return "?"
    left = int(seconds / step * max(total - step, 0))
    return f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}"
