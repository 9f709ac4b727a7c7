"""FSDP-QLoRA on the CPU: 2 processes (accelerate launch, FSDP2 over gloo) against 1, killed and resumed.

The runs take the GPU's path: bf16 autocast with bf16 compute, the 4-bit weights stored as bfloat16,
the chunked loss head with LoRA on the output head, evaluation, the guards, the shipped accelerate
config (with ``use_cpu``). accelerate itself refuses FSDP on CPU processes (it silently trains with
DDP instead); ``fsdp_launch.py`` lifts exactly that refusal, so what runs below is accelerate's
and transformers' real FSDP path: sharded parameters, sharded checkpoints, their resume.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qlora_kit.model.builtin import ensure_tiny_model
from qlora_kit.training.outputs import complete_checkpoints
from tests.e2e.test_distributed import free_port, losses

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tests" / "e2e" / "fsdp_launch.py"
SETTINGS = [
    "--set", "train.max_steps=6", "--set", "train.save_steps=3", "--set", "train.logging_steps=1",
    "--set", "train.eval_steps=3", "--set", "train.sample_prompts=0", "--set", "lora.dropout=0.0",
    "--set", "train.mixed_precision=bf16", "--set", "quant.compute_dtype=bfloat16",
    "--set", "quant.quant_storage=bfloat16", "--set", "optimizer.name=adamw_torch",
    "--set", "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]",
    "--set", "data.packing=true",  # named: auto times the layouts in one process, chooses by padding in several
]  # fmt: skip


def cpu_config(tmp_path: Path) -> Path:
    """The shipped FSDP config, on CPU processes."""
    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / "fsdp-qlora.yaml").read_text())
    config.update(use_cpu=True, num_processes=2)
    path = tmp_path / "fsdp-cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fsdp_train(config: Path, out: Path, *extra: str, kill_after: int | None = None):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    command = [*launch, str(LAUNCHER), "train", "recipes/demo.yaml", *SETTINGS, "--set", "train.fsdp=true"]
    command += ["--set", "train.micro_batch_size=4", "--output-dir", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kill_after is not None:
        env["QLORA_KIT_TEST_KILL_AFTER_STEP"] = str(kill_after)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_fsdp_trains_like_one_process_saves_one_adapter_and_resumes_bit_identically(tmp_path):
    one, whole, killed = tmp_path / "one", tmp_path / "whole", tmp_path / "killed"
    single = subprocess.run(
        [sys.executable, "-m", "qlora_kit", "train", "recipes/demo.yaml", *SETTINGS,
         "--set", "train.micro_batch_size=8", "--output-dir", str(one)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    config = cpu_config(tmp_path)
    run = fsdp_train(config, whole)
    assert run.returncode == 0, run.stderr[-3000:]

    # Same global batch, same losses (bf16 matmuls: rounding differs with the split), evaluation too.
    expected, got = losses(one), losses(whole)
    assert len(expected) == len(got) == 6
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a), (expected, got)
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 3, 6]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7)), "the main process logs, once"
    assert run.stderr.count("run manifest:") == 1

    # One adapter, whole (not a shard), equal to the one-process adapter, loadable with plain peft.
    reference, adapter = (
        load_file(one / "adapter_model.safetensors"),
        load_file(whole / "adapter_model.safetensors"),
    )
    assert adapter.keys() == reference.keys() and any("lm_head" in name for name in adapter)
    largest = max(t.abs().max().item() for t in reference.values())
    for name, tensor in adapter.items():
        assert tensor.shape == reference[name].shape, name
        assert (tensor - reference[name]).abs().max().item() <= 2e-2 * largest, name
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model("tiny-llama"))
    loaded = PeftModel.from_pretrained(base, str(whole))
    state = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(state) == len(adapter)
    assert all(torch.equal(p.detach(), adapter[n.replace(".default", "")]) for n, p in state.items())
    assert not (whole / ".staging").exists()

    # Killed after step 4: checkpoint-3 is complete, in FSDP's sharded layout plus a plain adapter.
    dead = fsdp_train(config, killed, kill_after=4)
    assert dead.returncode != 0
    assert [p.name for p in complete_checkpoints(killed)] == ["checkpoint-3"]
    checkpoint = killed / "checkpoint-3"
    assert (checkpoint / "optimizer_0" / ".metadata").is_file()
    assert load_file(checkpoint / "adapter_model.safetensors").keys() == adapter.keys()

    # Resumed (with sample prompts: every rank generates with the sharded model): bit-identical.
    resumed = fsdp_train(config, killed, "--resume", "--set", "train.sample_prompts=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {checkpoint}" in resumed.stderr
    assert losses(killed) == got
    again = load_file(killed / "adapter_model.safetensors")
    assert all(torch.equal(again[name], adapter[name]) for name in adapter)
    assert resumed.stdout.count("Answers before and after fine-tuning") == 1, resumed.stdout[-2000:]


def test_fsdp_with_a_mixed_per_layer_plan_trains_like_one_process_and_resumes_bit_identically(tmp_path):
    """Selective, full and no checkpointing on different layers under FSDP2 (the layers' forward is
    checkpointed inside FSDP's hooks): one process's losses, and a kill + resume gives the same adapter."""
    mixed = [
        "--set",
        "memory.checkpointing=per_layer",
        "--set",
        "memory.layer_policies=[selective, full, none, selective]",
    ]
    one, whole, killed = tmp_path / "one", tmp_path / "whole", tmp_path / "killed"
    single = subprocess.run(
        [sys.executable, "-m", "qlora_kit", "train", "recipes/demo.yaml", *SETTINGS, *mixed,
         "--set", "train.micro_batch_size=8", "--output-dir", str(one)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    config = cpu_config(tmp_path)
    run = fsdp_train(config, whole, *mixed)
    assert run.returncode == 0, run.stderr[-3000:]
    expected, got = losses(one), losses(whole)
    assert len(expected) == len(got) == 6
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a), (expected, got)
    dead = fsdp_train(config, killed, *mixed, kill_after=4)
    assert dead.returncode != 0
    resumed = fsdp_train(config, killed, *mixed, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(killed) == got
    adapter, again = (
        load_file(whole / "adapter_model.safetensors"),
        load_file(killed / "adapter_model.safetensors"),
    )
    assert all(torch.equal(again[name], adapter[name]) for name in adapter)
