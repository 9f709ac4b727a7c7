"""train.keep_best and train.early_stopping_patience, uninterrupted and through a SIGKILL and --resume.

The validation set pairs the demo's questions with wrong answers: its loss falls while the model learns
the format and rises once it learns the right answers, so the best evaluation is not the last one.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_kit.data import demo
from tests.conftest import run_cli_output

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]


def recipe_file(folder: Path) -> Path:
    train_file, val_file = demo.demo_data_files("demo-facts")
    rows = [json.loads(line) for line in Path(val_file).read_text().splitlines()]
    wrong = [dict(row, output=rows[(i + 7) % len(rows)]["output"]) for i, row in enumerate(rows)]
    (folder / "wrong.jsonl").write_text("".join(json.dumps(r) + "\n" for r in wrong))
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        # packed, as data.packing auto picks on the demo set: three runs need not time the layouts again
        f"data:\n  path: {train_file}\n  val_path: {folder / 'wrong.jsonl'}\n  max_seq_len: 64\n  packing: true\n"
        # float32 compute: a CPU without AVX512-BF16 emulates bfloat16 matmuls (11x slower)
        "quant:\n  compute_dtype: float32\n"
        "lora:\n  dropout: 0.0\noptimizer:\n  lr: 1.0e-3\n"
        # compile: false: auto would time a step (and compile, on a loaded machine) for three runs alike
        "train:\n  compile: false\n  max_steps: 60\n  micro_batch_size: 16\n  eval_steps: 4\n  save_steps: 4\n  logging_steps: 4\n"
        "  keep_best: eval_loss\n  early_stopping_patience: 2\n"
    )
    return recipe


def evaluations(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "eval_loss" in row]
    assert len(steps) == len(set(steps)), f"an evaluation logged twice: {steps}"
    return {row["step"]: row["eval_loss"] for row in rows if "eval_loss" in row}


def test_the_best_adapter_is_kept_and_training_stops_early_also_across_a_kill(tmp_path, monkeypatch, capsys):
    """The uninterrupted run and the resume run the CLI in this process (a process start is most of a
    tiny run's time); the killed run is a process of its own, as a kill needs."""
    recipe = recipe_file(tmp_path)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    code, _, err = run_cli_output(["train", str(recipe), "--output-dir", str(whole)], monkeypatch, capsys)
    assert code == 0, err[-2000:]
    evals = evaluations(whole)
    best_step = min(evals, key=evals.get)
    manifest = json.loads((whole / "manifest.json").read_text())
    assert manifest["best"] == {"metric": "eval_loss", "value": evals[best_step], "step": best_step}
    # stopped two evaluations after the best, long before max_steps
    assert max(evals) == manifest["steps"] == best_step + 2 * 4 < 60
    final = load_file(whole / "adapter_model.safetensors")
    best = load_file(whole / f"checkpoint-{best_step}" / "adapter_model.safetensors")
    last = load_file(whole / f"checkpoint-{manifest['steps']}" / "adapter_model.safetensors")
    assert all(torch.equal(final[k], best[k]) for k in final)
    assert not all(torch.equal(final[k], last[k]) for k in final)
    assert f"the final adapter is step {best_step}'s" in err

    # killed between the best evaluation and the stop, resumed: the same stop, the same adapter
    kill_at = best_step + 2
    driver = [sys.executable, str(ROOT / "tests" / "e2e" / "fault_driver.py"), str(recipe), str(killed)]
    dead = subprocess.run([*driver, f"step:{kill_at}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert dead.returncode == -signal.SIGKILL, dead.stderr[-2000:]  # killed there, not failed at start
    assert not (killed / "adapter_config.json").exists()
    survivors = sorted(int(p.name.split("-")[1]) for p in killed.glob("checkpoint-*"))
    assert survivors == list(range(4, kill_at + 1, 4)), survivors  # every save up to the kill
    argv = ["train", str(recipe), "--output-dir", str(killed), "--resume"]
    code, _, err = run_cli_output(argv, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert f"resuming from {killed / f'checkpoint-{survivors[-1]}'}" in " ".join(err.split())
    assert json.loads((killed / "manifest.json").read_text())["best"] == manifest["best"]
    again = load_file(killed / "adapter_model.safetensors")
    assert all(torch.equal(again[k], final[k]) for k in final)
    assert evaluations(killed) == evals
