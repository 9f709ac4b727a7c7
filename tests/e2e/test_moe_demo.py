"""The mixture-of-experts demo from the shell, as a user runs it: train, show, merge.

`qlora-kit train recipes/demo-moe.yaml` (the shipped recipe, unchanged), in this process (the README's
command as a process of its own is conftest's demo_run): the held-out loss falls and the answers before
and after are printed; `show` states the loaded model's bytes by kind and the tokens each
expert got; `merge` writes a folder plain transformers loads, its experts back in 16 bits, within the
merge's drift limits of the run as trained (4-bit experts and their LoRA)."""

from __future__ import annotations

import json

import pytest
import torch

from .test_cli import ROOT

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it


def test_moe_demo_learns_from_the_shell_and_merges_into_a_folder_transformers_loads(tmp_path, qlora_kit_here):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "demo-moe"
    trained = qlora_kit_here("train", ROOT / "recipes" / "demo-moe.yaml", "--output-dir", out)
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert evals[-1] <= 0.5 * evals[0], evals
    assert "Answers before and after fine-tuning" in trained.stdout
    assert "trainable parameters by kind: attention" in " ".join(trained.stderr.split())
    loads = [row["tokens_per_expert"] for row in rows if "tokens_per_expert" in row]
    assert loads and all(len(load) == 4 and len(load[0]) == 8 for load in loads)

    shown = qlora_kit_here("show", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "tokens per expert (fewest-most)" in shown.stdout and "layer 3:" in shown.stdout
    assert "experts" in shown.stdout.split("weights (MiB)")[1]

    merged = tmp_path / "merged"
    result = qlora_kit_here("merge", "--adapter", str(out), "--out", str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(merged)
    stacks = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert len(stacks) == 4 and all(p.dim() == 3 and p.dtype != torch.uint8 for p in stacks)
