"""train.compile: the decoder layers compiled (training/compiled.py, inductor) train to the same losses.

One run of ``benchmarks/compile.py --smoke`` under bf16 autocast (the GPU's path: autocast around the
compiled forward) proves both the benchmark (its table, checked as tests/e2e/test_benchmarks.py checks
every script's) and the training: the runs it steps by hand, and the runs ``trainer.train()`` itself
trains on the demo recipe (the script stops on an assertion if the decoder layers are not compiled
exactly when ``train.compile`` asks)."""

import re

import pytest

from tests.e2e.test_benchmarks import smoke_run

pytestmark = pytest.mark.slow  # compiling takes tens of seconds on 2 cores

NUMBERS = r"((?:[\d.]+ ?)+)"


def test_compiled_run_trains_to_the_losses_of_the_eager_run(tmp_path):
    text, tables = smoke_run("compile.py", tmp_path, "--mixed-precision", "bf16")
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
