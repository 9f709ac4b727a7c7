"""Shared by the benchmark scripts: the machine's description, a hand-stepped training step, and
writing a result table."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = f"CPU only, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"
    return f"{device}; python {platform.python_version()}, torch {torch.__version__}"


def timed_step(trainer, batch: dict, model=None) -> tuple[float, float]:
    """(loss, seconds) of one step stepped by hand, so settings can interleave round by round: forward
    and backward through the Trainer's ``training_step`` (its autocast and loss), then the optimizer."""
    start = time.perf_counter()
    loss = trainer.training_step(model if model is not None else trainer.model, dict(batch))
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    return float(loss), time.perf_counter() - start


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, table: str, notes: str = "") -> Path:
    """Print the table and write it, with the command that made it, to benchmarks/results/NAME.md."""
    command = "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    text = (
        f"# {title}\n\n"
        f"- command: `{command}`\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- machine: {machine()}\n\n"
        f"{table}\n"
    )
    if notes:
        text += f"\n{notes}\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text, encoding="utf-8")
    print(text)
    return path
