"""`qlora-kit doctor` proves a machine through the train command's own code path; CI runs it on the CPU."""

import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_cli_output

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def doctor(monkeypatch, capsys):
    """``qlora-kit doctor ARGS`` in this process (conftest.run_cli_output): its claims are its table and
    what it writes to a stream that is not a terminal (capsys's, as a pipe's), not a process's; a process
    of its own would add only its start (torch, transformers, peft: ~7 s on 2 cores)."""

    def run(*args: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(ROOT)
        monkeypatch.setenv("COLUMNS", "200")  # one table row per line
        code, out, err = run_cli_output(["doctor", *args], monkeypatch, capsys)
        return subprocess.CompletedProcess(["doctor", *args], code, out, err)

    return run


def rows(stdout: str) -> dict[str, str]:
    """check name -> pass / FAIL, read from the printed table."""
    found = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("│┃ ").split("│")]
        if len(cells) == 3 and cells[1] in ("pass", "FAIL"):
            found[cells[0]] = cells[1]
    return found


def test_doctor_passes_on_this_machine_and_fails_a_recipe_that_cannot_fit(doctor):
    result = doctor(
        "recipes/demo.yaml", "--set", "train.micro_batch_size=100000", "--set", "data.max_seq_len=65536"
    )
    checks = rows(result.stdout)
    assert list(checks) == [
        "versions",
        "device",
        "NVIDIA driver",
        "llama.cpp reader",
        "CUDA kernels",
        "bitsandbytes 4-bit",
        "compiler (torch.compile)",
        "train (tiny, this device)",
        "reload with plain peft",
        "merge and drift check",
        "plan builtin:tiny-llama",
    ], result.stdout + result.stderr[-2000:]
    assert [v for k, v in checks.items() if k != "plan builtin:tiny-llama"] == ["pass"] * 10, result.stdout
    assert checks["plan builtin:tiny-llama"] == "FAIL"  # 100,000 rows of 65,536 tokens fit nowhere
    assert result.returncode == 1
    assert "1 failed: plan builtin:tiny-llama" in result.stdout
    assert "Traceback" not in result.stderr
    # piped (CI, a log file): the table alone, none of the tiny run's Trainer dicts or tqdm bars (issue 35)
    assert "{'loss'" not in result.stdout + result.stderr and "step 12/12" not in result.stderr
    assert "it/s]" not in result.stderr and "s/it]" not in result.stderr


def test_doctor_verbose_shows_the_tiny_run_through_the_run_console(doctor):
    result = doctor("-v")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "step 12/12" in result.stderr  # the run console's plain line per logging step
    assert "{'loss'" not in result.stdout + result.stderr
    assert "all checks passed" in result.stdout


def test_doctor_with_a_broken_recipe_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """In this process (conftest.run_cli): the recipe is refused before any check runs, so a process of its
    own would add only its start (the one-line errors from a process: tests/e2e/test_cli.py)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  rank: 0\n")
    code, err = run_cli(["doctor", str(bad)], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == ["error: lora.rank: must be > 0 (got 0)"]
