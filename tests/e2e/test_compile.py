"""train.compile: the decoder layers compiled (training/compiled.py, inductor) train to the same losses.

One run of ``benchmarks/compile.py --smoke`` (in this process) under bf16 autocast (the GPU's path: autocast around the
compiled forward) proves both the benchmark (its table, checked as tests/e2e/test_benchmarks.py checks
every script's) and the training: the runs it steps by hand, and the runs ``trainer.train()`` itself
trains on the demo recipe (the script stops on an assertion if the decoder layers are not compiled
exactly when ``train.compile`` asks)."""

import re

import pytest
import torch

from tests.benchmark_smoke import run_script
from tests.e2e.test_benchmarks import BENCHMARKS, check_smoke_table

pytestmark = pytest.mark.slow  # compiling takes tens of seconds on 2 cores

NUMBERS = r"((?:[\d.]+ ?)+)"


def test_compiled_run_trains_to_the_losses_of_the_eager_run(tmp_path):
    # In this process (tests/benchmark_smoke.py), as from the shell but for the ~7 s of a process's imports;
    # dynamo's caches emptied first, as a fresh process has them (an earlier test's graphs count towards
    # the recompile limit of the layers' code, past which dynamo runs them eager).
    torch._dynamo.reset()
    before = (BENCHMARKS / "results" / "compile-cpu.md").read_bytes()
    options = ("--mixed-precision", "bf16")
    status = run_script("compile.py", tmp_path, *options)
    assert status["exit"] == 0, status.get("error")
    text, tables = check_smoke_table("compile.py", tmp_path, before, options)
    assert "autocast: bf16" in text  # accelerate's mixed precision in the runs, not the option echoed

    # Through trainer.train() on the demo recipe: the losses it logged.
    found = re.search(
        rf"Through trainer\.train\(\).*eager losses {NUMBERS}, compiled losses {NUMBERS}\(", text
    )
    assert found, text
    eager, compiled = ([float(v) for v in group.split()] for group in found.groups())
    assert len(eager) == len(compiled) == 2  # the compile's step, then a compiled step after an update
    assert compiled == pytest.approx(eager, rel=1e-3)

    # Stepped by hand: 2 x 32 random tokens a step, so bf16's rounding shows more than on the demo's
    # batches (a few 1e-4); a compiled forward or backward that computes something else shows far more.
    ((_, rows),) = tables
    eager, compiled = [float(row[1]) for row in rows], [float(row[2]) for row in rows]
    assert len(eager) == 2 and compiled == pytest.approx(eager, rel=1e-2)
