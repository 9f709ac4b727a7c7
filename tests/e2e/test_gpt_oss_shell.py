"""gpt-oss from the shell, short: `qlora-kit train` on builtin:tiny-gpt-oss (experts in 4 bits with their LoRA,
eager attention with its sinks), then `merge` into a folder plain transformers loads, its experts back in
their own transposed, biased layout. The MoE demo's e2e test (test_moe_demo.py) proves the learning; this
one proves gpt-oss's layout survives the whole path."""

from __future__ import annotations

import json

import pytest
import torch

from .test_cli import ROOT, qlora_kit

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it


def test_gpt_oss_trains_from_the_shell_and_merges_into_a_folder_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "gpt-oss"
    trained = qlora_kit(
        "train",
        str(ROOT / "recipes" / "demo-moe.yaml"),
        "--output-dir",
        str(out),
        *("--set", "model.path=builtin:tiny-gpt-oss"),
        *("--set", "train.max_steps=2", "--set", "train.micro_batch_size=2", "--set", "data.max_seq_len=32"),
        *("--set", "train.sample_prompts=0", "--set", "train.eval_steps=null", "--set", "data.packing=true"),
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    log = " ".join(trained.stderr.split())
    assert "attention: eager" in log and "experts: every expert in 4 bits" in log
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]

    merged = tmp_path / "merged"
    # bfloat16, gpt-oss's own dtype: float16 (merge's default) rounds the tiny model's untrained positions
    # just past the default bound (mean KL 0.0024 against 0.002; 1e-8 in float32)
    result = qlora_kit("merge", "--adapter", str(out), "--out", str(merged), "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(merged)
    experts = model.model.layers[0].mlp.experts
    config = model.config
    assert experts.gate_up_proj.shape == (8, config.hidden_size, 2 * config.intermediate_size)  # (E, in, out)
    assert experts.gate_up_proj.dtype != torch.uint8 and experts.down_proj_bias.shape == (
        8,
        config.hidden_size,
    )
