"""The GPU check script runs end to end on a tiny model (on the CPU here), so it cannot rot between the
sessions that have a GPU to run it on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import TINY_SKIPS
from tests.benchmark_smoke import run_script

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]


# The cases the script runs, each in a process of its own: a case before the broken one and one after
# it (the others' rows are the same child's ROW line and report entry: their figures are checked in this
# process below, where a case's rows are gpu_rows' call without the ~7 s of imports a process pays)
IN_PROCESSES = ["selective", "oom", "defaults", "long"]
IN_THIS_PROCESS = ["auto", "policies", "optimizers"]


@pytest.fixture(scope="module")
def rows_here() -> dict:
    """The rows of IN_THIS_PROCESS at --tiny, as gpu_check's child computes them (gpu_rows.CASES)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))  # as the script imports it, beside common.py
        import gpu_rows

        setup = gpu_rows.Setup(tiny=True)
        return {case: gpu_rows.CASES[case](setup) for case in IN_THIS_PROCESS}


def test_gpu_check_tiny_runs_every_case_and_one_broken_case_loses_only_its_own_rows(tmp_path, rows_here):
    """Each case in a process of its own (the H200's first check lost its whole table to selective's
    crash): ``defaults`` is broken on purpose, and the cases before and after it have their rows, printed
    as each ended and in the report. The rows of the cases not run by the script here: rows_here."""
    cases = IN_PROCESSES
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path), "--cases", *cases,
         "--break", "defaults"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert list(report) == cases
    assert "broken on purpose" in report["defaults"]["error"]
    assert "defaults: exit 1: RuntimeError: defaults broken on purpose" in result.stdout
    assert (
        result.stdout.index("== selective")
        < result.stdout.index("== defaults")
        < result.stdout.index("== long")
    )
    report |= rows_here
    settings = [row["setting"] for case in ("selective", "policies") for row in report[case]["policies"]]
    assert settings == ["selective (full logits)" if "full logits" in settings[0] else "selective",
                        "none", "every_n=2", "full", "full (full logits)", "full + offload"]  # fmt: skip
    # auto half-way between full and none, resolved with costs timed here, beside the every_n fitting it
    auto, every = [row["setting"] for row in report["auto"]["policies"]]
    assert auto.startswith("auto @ 0.5 (") and "measured on cpu" in auto, auto
    assert every.split(" (")[0].endswith(" @ 0.5"), every
    for case in ("selective", "auto", "policies"):
        for row in report[case]["policies"]:
            # on the CPU the saved bytes are exact; the planner and the run agree within 5%
            assert abs(row["predicted_saved_mib"] / row["saved_mib"] - 1) < 0.05, row
    optimizers = report["optimizers"]["optimizers"]
    assert [row["optimizer"] for row in optimizers] == ["paged_adamw_8bit", "adamw_8bit"]
    assert all("error" not in row for row in optimizers)
    # resumed from its checkpoint with one more step (nothing pages on a CPU; on a GPU the paged one may)
    repaged = [row["repaged_after_resume"] for row in optimizers]
    assert repaged[1] == 0 and (repaged[0] == 0 or torch.cuda.is_available()), repaged
    # the longest row the plan gives in the budget trained (on the CPU no peak is measured)
    long_context = report["long"]["long_context"]
    assert long_context["seq"] >= 2048 and long_context["host_gib"] > 0
    assert "long context in " in result.stdout
    # the real out-of-memory case needs a GPU's memory (and a model bigger than the tiny one): skipped at
    # --tiny, and without a process of its own (a start that would only learn this: red if it starts one)
    assert report["oom"] == {"skipped": f"--tiny: {TINY_SKIPS['oom']}"}, report["oom"]
    assert f"oom: skipped, --tiny: {TINY_SKIPS['oom']}" in result.stdout
    assert not (tmp_path / "gpu-check-oom.log").exists()


def test_packing_check_runs_every_kernel_available_here(tmp_path):
    """The script's main in this process (its claim is its report, not a process's: a start would add
    ~7 s of imports); it exits only when a kernel let examples attend to each other."""
    status = run_script("packing_check.py", tmp_path)  # its argv and sys.path as from the shell
    assert status["exit"] == 0, status.get("error")
    report = json.loads((tmp_path / "packing-check.json").read_text())
    for kernel in ("sdpa", "eager", "flex_attention"):
        assert report[kernel]["ok"] and report[kernel]["max_difference"] < 1e-4, report[kernel]
    flash = report["flash_attention_2"]
    if torch.cuda.is_available():  # runs where flash-attn is installed, else says why not
        assert "skipped" in flash or (flash["ok"] and flash["max_difference"] < 1e-2), flash
    else:
        assert "skipped" in flash  # no CUDA here


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the case runs for real in gpu_check")
def test_the_experts_on_host_case_parses_and_says_in_one_line_that_it_needs_a_gpu(tmp_path):
    """benchmarks/experts_on_host.py is gpu_check's GPU-only case (the CPU proofs are
    tests/test_experts_on_host.py): here it must still import and parse its command line, then stop in one
    line naming why, so it cannot rot unseen between the sessions that have a GPU."""
    result = subprocess.run(
        [sys.executable, "benchmarks/experts_on_host.py", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "GPU-only case (no CUDA here)" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
