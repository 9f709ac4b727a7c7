"""FSDP-QLoRA on the CPU: 2 processes (accelerate launch, FSDP2 over gloo) against 1, killed and resumed.

The runs take the GPU's path: bf16 autocast with bf16 compute, the 4-bit weights stored as bfloat16,
the chunked loss head with LoRA on the output head, evaluation, the guards, the shipped accelerate
config (with ``use_cpu``). accelerate itself refuses FSDP on CPU processes (it silently trains with
DDP instead); ``fsdp_launch.py`` lifts exactly that refusal, so what runs below is accelerate's
and transformers' real FSDP path: sharded parameters, sharded checkpoints, their resume.

The one-process, FSDP, killed and resumed runs are ``benchmarks/fsdp_check.py --smoke``'s (its table
checked as tests/e2e/test_benchmarks.py checks every script's), with evaluation, sample prompts and a
mixed per-layer checkpointing plan added; the tests read its runs' folders and logs (``--work``).
"""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qlora_kit.model.builtin import ensure_tiny_model
from tests.e2e.test_benchmarks import smoke_run
from tests.e2e.test_distributed import losses

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE, KILL = 4, 2, 3  # fsdp_check.py's smoke schedule: 4 steps, a checkpoint every 2, killed after 3
# Evaluation at the start and at every checkpoint; sample prompts: every rank generates with the sharded
# model, before training and after (after the resume too).
ADDED = ["--set", f"train.eval_steps={SAVE}", "--set", "train.sample_prompts=2"]
# Selective, full and no checkpointing on different layers (each layer's forward checkpointed inside
# FSDP's hooks, or not): every run, the one process's too, so the FSDP runs and their resume prove the
# mixed plan and each policy in it (full checkpointing, the shipped default, on layer 1).
MIXED = ["memory.checkpointing=per_layer", "memory.layer_policies=[selective, full, none, selective]"]
ADDED += [arg for value in MIXED for arg in ("--set", value)]


@pytest.fixture(scope="module")
def fsdp_check(tmp_path_factory) -> Path:
    """The folder of fsdp_check.py's runs (one, whole, killed: resumed into the same folder) and logs."""
    out = tmp_path_factory.mktemp("fsdp-check")
    smoke_run("fsdp_check.py", out, "--work", str(out / "runs"), *ADDED)
    return out / "runs"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fsdp_with_a_mixed_per_layer_plan_trains_like_one_process_saves_one_adapter_and_resumes_bit_identically(
    fsdp_check,
):
    """Selective, full and no checkpointing on different layers under FSDP2 (MIXED): one process's
    losses and adapter; killed and resumed, the same adapter bit for bit."""
    one, whole, killed = fsdp_check / "one", fsdp_check / "whole", fsdp_check / "killed"

    def log(run: str, stream: str) -> str:
        return (fsdp_check / f"{run}.{stream}").read_text()

    # The plan the FSDP runs trained with: the layers that recompute, in each of them and in the resume.
    assert "checkpointing: per_layer" in (whole / "recipe.yaml").read_text()
    for run in ("whole", "resumed"):
        assert "checkpointed decoder layers: [0, 1, 3]" in log(run, "stderr"), run

    # Same global batch, same losses (bf16 matmuls: rounding differs with the split), evaluation too.
    expected, got = losses(one), losses(whole)
    assert len(expected) == len(got) == STEPS
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a), (expected, got)
    rows = metrics(whole)
    assert [r["step"] for r in rows if "eval_loss" in r] == list(range(0, STEPS + 1, SAVE))
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1)), (
        "the main process logs, once"
    )
    assert log("whole", "stderr").count("run manifest:") == 1
    assert log("whole", "stdout").count("Answers before and after fine-tuning") == 1

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

    # Killed after step KILL (the table holds its non-zero exit): the resume found the checkpoint of step
    # SAVE the newest complete one (a later or a finished run would have been found instead), in FSDP's
    # sharded layout plus a plain adapter; the resume writes only later checkpoints.
    checkpoint = killed / f"checkpoint-{SAVE}"
    assert f"resuming from {checkpoint}" in log("resumed", "stderr")
    assert (checkpoint / "optimizer_0" / ".metadata").is_file()
    assert load_file(checkpoint / "adapter_model.safetensors").keys() == adapter.keys()

    # Resumed (with sample prompts: every rank generates with the sharded model): bit-identical.
    assert losses(killed) == got
    again = load_file(killed / "adapter_model.safetensors")
    assert all(torch.equal(again[name], adapter[name]) for name in adapter)
    assert log("resumed", "stdout").count("Answers before and after fine-tuning") == 1
