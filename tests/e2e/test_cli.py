"""The real CLI as a user runs it: trains, chat, kills and one-line errors each in a process of its own
(what a user sees on stderr includes anything printed at import); eval, generate, merge, validate, data,
a resume and the refusal of a folder in use in the test's process (qlora_kit_here), where a process
start was most of their time."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qlora_kit import Recipe
from qlora_kit.memory import layout_costs

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo.yaml"


def qlora_kit(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qlora_kit", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_demo_learns_and_shows_answers_before_and_after(demo_run):
    """The README's first command: the full demo recipe, unchanged."""
    out, result = demo_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert rows[0]["step"] == 0 and "eval_loss" in rows[0], "first evaluation happens before training"
    assert evals[-1] <= 0.5 * evals[0], evals
    assert "Answers before and after fine-tuning" in result.stdout
    assert "paged" in result.stderr and "nothing to page" in result.stderr  # said once, clearly
    assert result.stderr.count("nothing to page") == 1
    assert "Paged optimizers are not supported" not in result.stderr
    assert "kernels-community" not in result.stderr
    assert f"run manifest: {out / 'manifest.json'}" in " ".join(result.stderr.split())
    # Not a terminal (as in CI or a log file): whole lines, no carriage returns or escape codes, no raw
    # log dicts; progress as plain lines, then the summary table.
    for stream in (result.stdout, result.stderr):
        assert "\r" not in stream and "\x1b" not in stream
        assert "{'loss'" not in stream and "{'eval_loss'" not in stream and "{'train_runtime'" not in stream
    assert re.search(
        r"^step 200/200 .*  loss [0-9.]+  lr .*tok/s .*left 0:00:00$", result.stderr, re.MULTILINE
    )
    assert "eval loss, first -> best -> last" in result.stdout and "run summary" in result.stdout
    # scripts/build_image.sh checks the demo inside the image by these lines of its output
    script = (ROOT / "scripts" / "build_image.sh").read_text()
    image_checks = re.findall(r'"([^"$/]+)[^"$]*"', re.search(r"for line in (.*); do", script).group(1))
    assert len(image_checks) == 2, image_checks
    for line in image_checks:
        assert line in result.stdout, line


def test_validate_prints_resolved_values_with_overrides(qlora_kit_here):
    result = qlora_kit_here("validate", str(DEMO), "--set", "lora.rank=8", "--set", "quant.quant_type=fp4")
    assert result.returncode == 0, result.stderr
    assert "rank: 8" in result.stdout and "quant_type: fp4" in result.stdout
    assert "max_grad_norm: 0.3" in result.stdout  # defaults are printed too


def test_user_mistakes_are_one_line_and_exit_2(tmp_path):
    cases = [
        (("validate", str(DEMO), "--set", "lora.rank=0"), "lora.rank: must be > 0 (got 0)"),
        (("validate", str(tmp_path / "missing.yaml")), "missing.yaml: cannot read recipe"),
        (
            (
                "train",
                str(DEMO),
                "--output-dir",
                str(tmp_path / "out"),
                "--set",
                f"data.path={tmp_path / 'none.jsonl'}",
                "--set",
                "data.val_fraction=0.1",
            ),
            "data.path: no such file or folder",
        ),
    ]
    for args, message in cases:
        result = qlora_kit(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
        assert "Traceback" not in result.stderr


def test_train_refuses_an_output_dir_in_use(tmp_path, qlora_kit_here):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = qlora_kit_here("train", str(DEMO), "--output-dir", str(out), "--set", "train.max_steps=1")
    assert result.returncode == 2
    assert "already holds files" in result.stderr and "--overwrite" in result.stderr
    assert (out / "notes.txt").read_text() == "mine"


def test_data_command_shows_marked_examples_lengths_and_padding(qlora_kit_here):
    result = qlora_kit_here("data", str(DEMO), "--examples", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("example ") == 2 and "⟦" in result.stdout
    assert "p50" in result.stdout and "p99" in result.stdout
    assert "168 of 168 rows kept" in result.stdout
    assert "padding 29.7%" in result.stdout and "packing 10.6%" in result.stdout
    # the preflight: every check shown with its result (the demo passes them all)
    checks = [
        "untrained examples",
        "end token trained",
        "single BOS",
        "end token kept by padding",
        "chat template prefix",
    ]
    lines = {line for line in result.stdout.splitlines() if any(c in line for c in checks)}
    assert all(any(c in line and "pass" in line for line in lines) for c in checks), result.stdout[-2500:]


def test_bad_data_is_one_line_and_leaves_the_output_dir_alone(tmp_path, qlora_kit_here):
    """In this process: the row is refused before any training (the one-line errors from a process are
    test_user_mistakes_are_one_line_and_exit_2's)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_config.json").write_text("{}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", output: 1}\n')
    args = (
        "--set",
        f"data.path={bad}",
        "--set",
        "data.val_fraction=0.5",
        "--output-dir",
        str(out),
        "--overwrite",
    )
    result = qlora_kit_here("train", str(DEMO), *args)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"error: {bad}: row 2: malformed JSON (Expecting property name enclosed in double quotes at column 22)"
    )
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json"]


def test_eval_generate_chat_and_merge_from_the_shell(demo_run, tmp_path, qlora_kit_here):
    """chat reads its stdin in a process of its own; eval, generate and merge run in this one."""
    out, _ = demo_run
    evaluated = qlora_kit_here("eval", "--adapter", str(out), "--output", str(tmp_path / "eval.json"))
    assert evaluated.returncode == 0, evaluated.stderr
    assert "exact_match" in evaluated.stdout
    assert json.loads((tmp_path / "eval.json").read_text())["exact_match"] >= 0.9

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What sound does a dog make?"}\n')
    generated = qlora_kit_here(
        "generate", "--adapter", str(out), "What sound does a cow make?", "--file", str(prompts)
    )
    assert generated.returncode == 0, generated.stderr
    lines = [line.strip() for line in generated.stdout.splitlines()]
    assert lines[-4:] == ["> What sound does a cow make?", "moo", "> What sound does a dog make?", "woof"]

    chat = subprocess.run(
        [sys.executable, "-m", "qlora_kit", "chat", "--adapter", str(out)],
        input="What color is snow?\n\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert chat.returncode == 0, chat.stderr
    assert "model> white" in chat.stdout

    refused = qlora_kit_here(
        "merge", "--adapter", str(out), "--out", str(tmp_path / "m"), "--base", "original"
    )
    assert refused.returncode == 3 and "refused: merged model drifts" in refused.stderr
    assert not (tmp_path / "m").exists()
    merged = qlora_kit_here("merge", "--adapter", str(out), "--out", str(tmp_path / "m"))
    assert merged.returncode == 0, merged.stderr
    assert "top-1 agreement 100.0%" in " ".join(merged.stdout.split())  # the console wraps long lines


def test_resume_from_the_shell_continues_the_newest_checkpoint(tmp_path, qlora_kit_here):
    """Killed (SIGKILL) right after step 3, with checkpoint-2 on disk: --resume starts at step 3 and
    trains steps 3 and 4 only, each logged once."""
    out, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    settings = {"train.max_steps": 4, "train.save_steps": 2, "train.logging_steps": 1}
    settings |= {"train.sample_prompts": 0, "train.eval_steps": None}
    recipe.write_text(Recipe.from_yaml(DEMO, overrides=settings).to_yaml())
    driver = [sys.executable, str(ROOT / "tests" / "e2e" / "fault_driver.py"), str(recipe), str(out)]
    killed = subprocess.run([*driver, "step:3"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "adapter_config.json").exists()

    # the resume in this process (the killed run had one of its own)
    resumed = qlora_kit_here("train", str(recipe), "--output-dir", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {out / 'checkpoint-2'}" in " ".join(resumed.stderr.split())
    trained = re.findall(r"^step (\d+)/4 ", resumed.stderr, re.MULTILINE)
    assert trained == ["3", "4"], resumed.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert json.loads((out / "manifest.json").read_text())["steps"] == 4
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    # 4 steps are too few to repay timing the layouts: the run chose by padding, and so does its resume
    # (a resume by the figures a timed run wrote: tests/test_layout.py)
    assert layout_costs.read(out / "checkpoint-2") is None and layout_costs.read(out / "checkpoint-4") is None
    assert (
        "data.packing auto: 4 planned micro-batches, fewer than" not in resumed.stderr
    )  # resumed: not asked
    assert "the least padding on this data" in resumed.stderr


def test_quiet_shows_only_the_summary_and_verbose_adds_debug_lines(tmp_path, qlora_kit_here):
    """--quiet in a process of its own (nothing a library prints at import may reach its stderr either);
    -v in this one, its DEBUG lines asserted (the loggers' levels it sets are put back after)."""
    short = [
        "--set",
        "train.max_steps=4",
        "--set",
        "train.logging_steps=2",
        "--set",
        "train.sample_prompts=0",
    ]
    short += ["--set", "train.eval_steps=null"]
    quiet = qlora_kit("train", str(DEMO), "--quiet", *short, "--output-dir", str(tmp_path / "quiet"))
    assert quiet.returncode == 0, quiet.stderr
    assert "INFO" not in quiet.stderr and "step 4/4" not in quiet.stderr
    assert "run summary" in quiet.stdout
    levels = {name: logging.getLogger(name).level for name in ("qlora_kit", "transformers")}
    try:
        verbose = qlora_kit_here("train", DEMO, "-v", *short, "--output-dir", tmp_path / "verbose")
    finally:  # -v leaves transformers' INFO on: not for the tests this process runs next
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    assert verbose.returncode == 0, verbose.stderr
    assert "DEBUG" in verbose.stderr and "step 4/4" in verbose.stderr
