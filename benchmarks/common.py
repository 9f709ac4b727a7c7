"""Shared by the benchmark scripts: their common command line (``--smoke``, ``--out``), the machine's
description, a hand-stepped training step, and writing a result table.

Every script takes ``--smoke``: a few steps on the smallest shapes, which the test suite runs
(tests/e2e/test_benchmarks.py) with ``--out`` pointing at a temporary folder, so a script that no
longer runs, or writes a table of NaNs, fails the suite instead of waiting for the next person to try it.
A ``--smoke`` run without ``--out`` writes to SMOKE_OUT, never over the committed tables in results/.
A script's runs, data and caches go in ``scratch_folder``, removed when it exits: the smoke test is red on
a folder a script leaves in the temporary folder, unless the script names it for reuse (``--work``).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


# Where a --smoke run writes without --out: never over the committed tables in RESULTS (issue 47: a smoke
# run of vs_trl.py overwrote vs-trl-cpu.md's full-size figures)
SMOKE_OUT = Path(tempfile.gettempdir()) / "qlora-kit-benchmark-smoke"


def scratch_folder(prefix: str) -> Path:
    """A new folder under the system's temporary folder, removed when this process exits: a benchmark's
    runs, data and caches (a GPU check's checkpoints, large_data.py's gigabytes of rows) are not left
    behind. Its figures go to ``--out``, never here."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


class _Parser(argparse.ArgumentParser):
    """``--out`` defaults to the script's folder, except that a ``--smoke`` run that would write into the
    committed tables writes to SMOKE_OUT instead (``--out benchmarks/results`` still writes there)."""

    def __init__(self, *args, full_out: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.full_out = full_out

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if parsed.out is None:
            at_tables = self.full_out.resolve() == RESULTS.resolve()
            parsed.out = SMOKE_OUT if parsed.smoke and at_tables else self.full_out
        return parsed


def parser(doc: str, out: Path = RESULTS) -> argparse.ArgumentParser:
    """The script's command line, described by its docstring's first line, with the shared options."""
    parser = _Parser(description=doc.splitlines()[0], full_out=out)
    parser.add_argument(
        "--smoke", action="store_true", help="a few steps on the smallest shapes: does it still run?"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder the results are written to (default: {out}; with --smoke, {SMOKE_OUT})",
    )
    parser.add_argument(
        "--real-model",
        action="store_true",
        help=f"the real pretrained builtin:{REAL_MODEL} (the real-model extra) instead of the random tiny "
        "model, at sizes that finish in minutes on 2 cores; writes NAME-real-DEVICE.md",
    )
    return parser


REAL_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct: 30 layers, hidden 576, vocabulary 49,152


def device_name() -> str:
    """``gpu`` or ``cpu``: the suffix of a result's file name."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def real_model_dir() -> Path:
    """The converted real model's folder (converted once into the builtin cache: model/pretrained.py)."""
    from qlora_kit.model import builtin, pretrained

    return pretrained.ensure_pretrained(REAL_MODEL, builtin.cache_root())


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        threads = torch.get_num_threads()
        device = (
            f"CPU only, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
            f"{threads} torch thread{'s' if threads > 1 else ''}"
        )
    return f"{device}; python {platform.python_version()}, torch {torch.__version__}"


def timed_step(trainer, batch: dict, model=None) -> tuple[float, float]:
    """(loss, seconds) of one step stepped by hand, so settings can interleave round by round: forward
    and backward through the Trainer's ``training_step`` (its autocast and loss), then the optimizer."""
    start = time.perf_counter()
    loss = trainer.training_step(model if model is not None else trainer.model, dict(batch))
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    return float(loss), time.perf_counter() - start


def profiled_step(trainer, batch: dict, model=None) -> tuple[dict[str, tuple[float, int]], float]:
    """``timed_step`` under torch's profiler: each op's (self CPU seconds, calls), and the step's wall seconds
    (the profiler's own overhead included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, wall = timed_step(trainer, batch, model)
    return {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}, wall


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, table: str, notes: str = "", folder: Path = RESULTS) -> Path:
    """Print the table and write it, with the command that made it, to FOLDER/NAME.md (by default
    benchmarks/results/NAME.md, the tables the README quotes)."""
    command = "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    if "OMP_NUM_THREADS" in os.environ:  # torch's thread count changes every timing on a CPU
        command = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} {command}"
    text = (
        f"# {title}\n\n"
        f"- command: `{command}`\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- machine: {machine()}\n\n"
        f"{table}\n"
    )
    if notes:
        text += f"\n{notes}\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.md"
    path.write_text(text, encoding="utf-8")
    print(text)
    return path


def budget_between(the_plan, fraction: float) -> float:
    """GiB ``fraction`` of the way from full checkpointing's planned peak to none's (auto's budgets)."""
    peaks = {row.policy: row.peak for row in the_plan.policies}
    return (peaks["full"] + fraction * (peaks["none"] - peaks["full"])) / 1024**3


def uniform_fitting(the_plan, budget_gb: float) -> tuple[str, dict]:
    """The planner's uniform choice for a budget, what auto chose before it mixed policies per layer: of
    the uniform policies but selective whose planned peak fits, the one recomputing the fewest layers;
    (its label, its memory fields)."""
    fitting = [r for r in the_plan.policies if r.policy != "selective" and r.peak <= budget_gb * 1024**3]
    fewest = min(fitting, key=lambda r: r.recompute_layers)
    n = int(fewest.policy.partition("=")[2] or 1)
    fields = {"checkpointing": "every_n", "every_n": n} if n > 1 else {"checkpointing": fewest.policy}
    return fewest.policy, fields
