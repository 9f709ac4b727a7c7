"""Every benchmark script runs at ``--smoke`` size and writes its table, in the form the committed one
has, with finite figures (all of them in one process, tests/benchmark_smoke.py: 85 s against 166 s a
process each, measured with ``pytest -n 0`` on this file): a script that stops running, or starts writing NaNs, fails the suite instead
of leaving a stale table in benchmarks/results/ for the README to quote (vs_trl.py crashed for weeks
while its table stood). The tables go to a temporary folder (``--out``), never over the committed ones.
gpu_check.py and packing_check.py write JSON and are run by tests/e2e/test_gpu_check.py; compile.py and
fsdp_check.py are run at smoke size by tests/e2e/test_compile.py and tests/e2e/test_fsdp.py, whose checks of
the training are made on those very runs (``smoke_run`` checks their tables as here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# A figure as the scripts print it: 1,013 / 0.508 / -3 / +1.2 / 1.23e-05 (never nan or inf).
N = r"[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]\d+)?"
WITH_ERROR = rf"{N} \({N}%\)"  # 12.3 (+1.2%): a prediction and its error against the measurement
SECONDS = N
# How Python prints a NaN or an infinity, alone or as a ratio or share ("nan", "-inf", "nanx", "nan%"),
# but not inside a word ("inference").
NOT_FINITE = re.compile(r"(?<![a-z])(nan|inf)(?=x\b|%|\b)", re.IGNORECASE)

PLANNER_COLUMNS = [
    ("model", r"tiny-[\w.-]+"),
    ("policy", "none|every_n=2|selective|full"),
    ("batch x tokens", r"\d+ x \d+"),
    ("format", "alpaca|chat|completion|text"),
    ("packing", "on|off"),
    ("LoRA dropout", N),
    ("chunked head", "off|on|on, 64-token chunks"),
    ("autocast", "no|bf16"),
    ("measured MiB", N),
    ("planned MiB (error)", WITH_ERROR),
    ("of which untrained positions, MiB (error without them)", WITH_ERROR),
]
# script -> (its result file, then per table: each column's name and the form of its cells, and the
# number of rows at --smoke size)
TABLES = {
    "attention.py": ("attention-cpu.md", [(
        [("kernel", "sdpa|eager"), ("packing", "on|off"), ("saved for backward (MiB)", N),
         ("planner (MiB)", WITH_ERROR), ("median step (s)", SECONDS), ("vs sdpa unpacked", rf"{N}x")], 4,
    )]),
    "export_floor_bounds.py": ("export-floor-bounds-untrained-cpu.md", [(
        [("reader", "transformers|llama.cpp"), ("type", "q8_0|f16"), ("products", r"\d+"), ("q8_0 peak ratio", N),
         ("variance a product", N), ("mean Var(log p)", N), ("answer positions", r"\d+"), ("modelled KL", N),
         ("measured q8_0 inputs' KL", rf"{N}|-"), ("bound against the floor", N)], 3,
    )]),
    "compile.py": ("compile-cpu.md", [(
        [("step", r"\d+"), ("eager loss", N), ("compiled loss", N), ("eager s", SECONDS), ("compiled s", SECONDS), ("eager CPU s", SECONDS), ("compiled CPU s", SECONDS)], 2,
    )]),
    "step_overhead.py": ("step-overhead-cpu.md", [(
        [("component", r"[a-z' :()-]+"), ("ms / step", N), ("share of the step", rf"{N}%")], 8,
    )]),
    "data_throughput.py": ("data-throughput-cpu.md", [(
        [("mode", "padding|group_by_length|packing"), ("pad share", rf"{N}%"), ("median step (s)", SECONDS),
         ("real tokens/s", N), ("vs padding", rf"{N}x")], 3,
    ), (
        [("op (self CPU time)", r"`[^`]+`|all ops"), ("padding s / 1k positions", N),
         ("packing s / 1k positions", N), ("packing - padding", N)], 13,
    )]),
    "export_calibration.py": ("export-calibration-cpu.md", [(
        [("adapter", ".+"), ("candidate", ".+"), ("reference", "as trained|fp32"), ("all KL", N),
         ("all top-1", rf"{N}%"), ("answer KL", N), ("answer top-1", rf"{N}%"), ("top-1 at margin 0.5", rf"{N}%"),
         ("top-1 at margin 1", rf"{N}%"), ("answer positions", r"\d+")], 12,
    ), (
        [("reference", "as trained|fp32"), ("statistic", ".+"), ("worst correct", rf"{N}%?"),
         ("best wrong", rf"{N}%?")], 12,
    ), (
        [("reader", ".+"), ("worst correct (top-1, KL)", rf"{N}%, {N}|-"), ("best wrong (top-1, KL)", rf"{N}%, {N}|-")], 0,
    ), (
        [("adapter", ".+"), ("export", ".+"), ("against", "trained|floor"), ("top-1", rf"{N}%"), ("mean KL", N),
         ("positions", r"\d+")], 0,
    )]),
    "export_precision.py": ("export-precision-cpu.md", [(
        [("weights", ".+"), ("answer top-1", rf"{N}%"), ("answer mean KL", N), ("all-position top-1", rf"{N}%"),
         ("all-position mean KL", N)], 9,
    )]),
    "fsdp_check.py": ("fsdp-cpu.md", [(
        [("run", ".+"), ("exit", r"-?\d+"), ("wall s", SECONDS),
         ("losses (or last line)", rf"{N}( {N})*|killed after step \d+"),
         ("max abs diff vs one process", rf"{N}|-"), ("resume bit-identical", "yes|-")], 4,
    )]),
    "guards.py": ("guards-cpu.md", [(
        [("run", "guards on|guards off|overhead"), ("median ms / optimizer step", rf"{N}%?"),
         ("each round (ms)", rf"({N}( {N})*)?")], 3,
    )]),
    "large_data.py": ("large-data-cpu.md", [(
        [("JSONL file", rf"{N} GiB"), ("rows", N), ("tokens", rf"{N} M"), ("packed rows", N),
         ("prepare s", SECONDS), ("peak anonymous", rf"{N} MiB"), ("peak RSS (with mapped files)", rf"{N} MiB"),
         ("arrow cache", rf"{N} GiB"), ("checks", "pass")], 1,
    )]),
    "checkpointing_frontier.py": ("checkpointing-frontier-cpu.md", [(
        [("model", "builtin|realistic"), ("setting", r"none|every_n=\d+|selective|selective floor \(saves every op\)|full|(auto|none|every_n=\d+|full) @ [\d.]+"),
         ("budget (MiB)", rf"{N}|-"), ("layers none/selective/full", r"\d+/\d+/\d+"), ("saved for backward (MiB)", N),
         ("vs none", N), ("planner (MiB)", rf"{WITH_ERROR}|-"), ("median step (s)", SECONDS), ("time vs none", rf"{N}x"), ("CPU s / step", SECONDS),
         ("CPU time vs none", rf"{N}x")], 7,
    )]),
    "selective_floor.py": ("selective-floor-cpu.md", [(
        [("LoRA dropout", N), ("setting", r"none|full|selective|selective, bare policy|selective floor \(saves every op\)"),
         ("forward (ms)", N), ("backward (ms)", N), ("layers' step (ms)", N), ("vs none", rf"{N}x"),
         ("extra vs full's extra", rf"{N}|-")], 5,
    )]),
    "long_context.py": ("long-context-cpu.md", [
        ([("model, GPU", ".+"), ("memory", r"none|selective|full|full \+ offload|full \+ offload \+ tiles"),
          ("longest row (tokens)", r"[\d,]+"), ("device peak (GiB)", N), ("host (GiB)", rf"{N}|-"),
          ("published", ".+")], 1),
        ([("tokens", r"[\d,]+"), ("memory", r"none|full|full \+ offload|full \+ offload \+ tiles"),
          ("saved on device (MiB)", N), ("planned (MiB, error)", WITH_ERROR), ("host (MiB)", rf"{N}|-"),
          ("forward + backward (s)", SECONDS), ("time vs full", rf"{N}x")], 4),
    ]),
    "memory.py": ("memory-cpu.md", [
        ([("policy", r"none|every_2|full|full \+ offload"), ("saved for backward (MiB)", N), ("vs none", N),
          ("planner (MiB)", WITH_ERROR), ("median step (s)", SECONDS), ("time vs none", rf"{N}x")], 4),
        ([("setting", "full, transformers loss|full, chunked loss"), ("saved for backward (MiB)", N),
          ("planner (MiB)", WITH_ERROR), ("median step (s)", SECONDS), ("time vs unchunked", rf"{N}x")], 2),
    ]),
    "oom_recovery.py": ("oom-recovery-cpu.md", [(
        [("run", r"micro-batch 4 x accumulation 2|micro-batch 8, uncapped|micro-batch 8, capped \(splits\)"),
         ("optimizer steps", r"\d+"), ("rows per step", r"\d+"), ("trained tokens of each step as uncapped", "yes"),
         ("split at step", r"\d+|-"), ("max loss difference to micro-batch 4 x 2 from the split on", N), ("train s", N),
         ("s lost to failed attempts", N)], 3,
    )]),
    "planner_accuracy.py": ("planner-accuracy-cpu.md", [
        (PLANNER_COLUMNS, 2),  # the smoke grid: one case for each of planner_accuracy.SMOKE_FAMILIES
        ([("recipe", ".+"), ("layers", r"\d+"), ("activations", "traced"), ("plan seconds", SECONDS)], 4),
    ]),
    "families_matrix.py": ("families-matrix.md", [(
        [("model_type", r"`[\w.-]+`"), ("result", r"works|(refused|failed) \(\w+\): .+|skipped: .+"),
         ("weights in 4 bits", rf"{N}%|-"), ("saved for backward, measured (MiB)", rf"{N}|-"),
         ("planned (MiB, error)", rf"{WITH_ERROR}|-"), ("s", SECONDS)], 3,  # works, refused, skipped
    )]),
    "moe.py": ("moe-cpu.md", [
        ([("experts", r"4-bit experts \(qlora_kit\)|16-bit experts, same loop|transformers' experts \+ peft's ParamWrapper"),
          ("median forward+backward (s)", SECONDS), ("vs 16-bit, same loop", rf"{N}x"), ("vs transformers'", rf"{N}x")], 3),
        ([("model", r"Qwen/Qwen3-30B-A3B|mistralai/Mixtral-8x7B-v0.1"), ("LoRA on", "attention and experts|attention"),
          ("expert weights", rf"{N} B \({N} B active\)"),
          ("experts in 4 bits (GiB)", N), ("other weights (GiB)", N), ("LoRA parameters", rf"{N} M"),
          ("planned peak (GiB)", N), ("published", ".+")], 4),
    ]),
    "vs_trl.py": ("vs-trl-cpu.md", [(
        [("comparison", r"equal settings \(padded batches\)|defaults \(qlora_kit packs\)"),
         ("system", "qlora_kit|TRL SFTTrainer"), ("median step (s)", SECONDS), ("trained tokens/s", N),
         ("median step CPU (s)", SECONDS), ("trained tokens per CPU s", N), ("peak RSS (MiB)", N), ("final loss", rf"{N} \(seeds span {N}\)")], 4,
    )]),
}  # fmt: skip


def fsdp_runs_did_what_they_should(rows: list[list[str]]) -> None:
    exits = [row[1] for row in rows]
    assert exits[0] == exits[1] == exits[3] == "0" and exits[2] != "0", rows  # the third is SIGKILLed
    assert rows[3][5] == "yes", "the resumed FSDP adapter equals the uninterrupted one bit for bit"


# What some tables' figures must say beyond their form, checked on the smoke run's first table.
MEANING = {"fsdp_check.py": fsdp_runs_did_what_they_should}
# Scripts whose smoke runs live in another test file, and the file. compile.py and fsdp_check.py stay in
# TABLES: their committed tables are checked here, their smoke runs' tables by smoke_run in that file.
ELSEWHERE = {
    "gpu_check.py": "test_gpu_check.py",
    "packing_check.py": "test_gpu_check.py",
    "experts_on_host.py": "test_gpu_check.py",  # GPU only: gpu_check's case, skipped at --tiny
    "compile.py": "test_compile.py",
    "export_floor_bounds.py": "../test_export_bounds.py",  # its --untrained table (the default trains)
    "fsdp_check.py": "test_fsdp.py",
}


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Each markdown table in ``text``: its header cells and its rows' cells."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            tables.append((block[0], block[2:]))  # block[1] is the |---| line
            block = []
    return tables


def check_table(header: list[str], rows: list[list[str]], columns: list[tuple[str, str]], count: int) -> None:
    assert header == [name for name, _ in columns], header
    assert len(rows) == count, rows
    for row in rows:
        assert len(row) == len(header), row
        for (name, pattern), cell in zip(columns, row, strict=True):
            assert re.fullmatch(pattern, cell), f"{name}: {cell!r} is not of the form {pattern!r} (row {row})"


def smoke_run(script: str, out: Path, *options: str) -> tuple[str, list[tuple[list[str], list[list[str]]]]]:
    """Run ``script --smoke --out OUT [options]`` in a process of its own and check what it wrote (as
    check_smoke_table does). Returns the text and its tables."""
    name, _ = TABLES[script]
    committed = BENCHMARKS / "results" / name
    before = committed.read_bytes() if committed.exists() else None
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--smoke", "--out", str(out), *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return check_smoke_table(script, out, before, options)


def check_smoke_table(script: str, out: Path, before: bytes | None, options=()):
    """What a smoke run of ``script`` wrote to ``out``: the table in its committed form, finite figures,
    what MEANING asks, the committed table untouched (``before``: its bytes before the run)."""
    name, tables = TABLES[script]
    committed = BENCHMARKS / "results" / name
    text = (out / name).read_text()
    command = " ".join([f"python benchmarks/{script} --smoke --out {out}", *options])
    assert f"{command}`" in text  # the command that made it
    found = markdown_tables(text)
    # a table of no rows at smoke size is written only where its tool is (export_calibration's llama.cpp)
    smoke_tables = [table for table in tables if table[1]]
    assert len(found) == len(smoke_tables), text
    for (header, rows), (columns, count) in zip(found, smoke_tables, strict=True):
        check_table(header, rows, columns, count)
    assert not NOT_FINITE.search(text), text  # in the notes either
    if script in MEANING:
        MEANING[script](found[0][1])
    assert (committed.read_bytes() if committed.exists() else None) == before, "the committed table changed"
    return text, found


# families_matrix.py forks a process per row: first, before the other scripts start torch's thread pools in
# this process (forked after them, its children died of SIGSEGV, exit -11, on every row)
SMOKED_HERE = ["families_matrix.py", *sorted(set(TABLES) - set(ELSEWHERE) - {"families_matrix.py"})]


@pytest.mark.slow
def test_every_benchmark_runs_at_smoke_size_and_writes_a_table_of_finite_figures(tmp_path):
    """All of SMOKED_HERE in one process, one after another (tests/benchmark_smoke.py): each script's exit
    and table are judged on their own, and every script's finding is reported, not only the first. Their
    temporary folders are gone when the process ends (common.scratch_folder: a GPU check's checkpoints and
    large_data.py's gigabytes were left in /tmp), but for a work folder a script names for reuse."""
    committed = {script: BENCHMARKS / "results" / TABLES[script][0] for script in SMOKED_HERE}
    before = {script: path.read_bytes() if path.exists() else None for script, path in committed.items()}
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tests.benchmark_smoke", str(tmp_path / "out"), *SMOKED_HERE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "TMPDIR": str(temporary)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    findings = {}
    for script in SMOKED_HERE:
        status = json.loads((tmp_path / "out" / script / "status.json").read_text())
        try:
            assert status["exit"] == 0, status.get("error")
            check_smoke_table(script, tmp_path / "out" / script, before[script])
        except AssertionError as finding:
            findings[script] = str(finding)[-1500:]
    assert not findings, "\n\n".join(f"{script}: {finding}" for script, finding in findings.items())
    left = {path.name for path in temporary.iterdir()}
    announced = {name for name in left if f"in {temporary / name} (--work reuses them)" in result.stdout}
    assert left == announced, f"left in the temporary folder: {sorted(left - announced)}"


@pytest.mark.parametrize("script", sorted(TABLES))
def test_committed_table_has_the_form_its_script_writes_now(script):
    """The README quotes these: each must still be what its script writes (its columns, finite figures)."""
    name, tables = TABLES[script]
    text = (BENCHMARKS / "results" / name).read_text()
    forms = {tuple(column for column, _ in columns): columns for columns, _ in tables}
    for header, rows in markdown_tables(text):
        assert tuple(header) in forms, f"{name}: a table the script no longer writes: {header}"
        check_table(header, rows, forms[tuple(header)], len(rows))
    assert not NOT_FINITE.search(text), text


def test_every_benchmark_script_is_run_by_the_suite():
    # modules the scripts import (vs_trl_profile.py: vs_trl.py --profile's)
    helpers = {"common.py", "gpu_rows.py", "tiny_configs.py", "vs_trl_profile.py"}
    scripts = {path.name for path in BENCHMARKS.glob("*.py")} - helpers
    assert scripts == set(TABLES) | set(ELSEWHERE)
    for script, test_file in ELSEWHERE.items():
        # a script with a table there goes through smoke_run, which checks its table as here; either runs
        # in the test's process through benchmark_smoke.run_script (its argv and sys.path as from the shell)
        runs = (
            f'smoke_run("{script}"' if script in TABLES else f"benchmarks/{script}",
            f'run_script("{script}"',
        )
        text = (Path(__file__).parent / test_file).read_text()
        assert any(run in text for run in runs), f"{test_file} runs no {script}"
    for script in scripts:
        # --smoke and --out come from common.parser
        assert "parser(__doc__" in (BENCHMARKS / script).read_text(), f"{script} takes no --smoke"


@pytest.mark.slow  # a subprocess (the inner loop starts none)
@pytest.mark.parametrize("script", sorted(path.name for path in BENCHMARKS.glob("*.sh")))
def test_benchmark_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(BENCHMARKS / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
