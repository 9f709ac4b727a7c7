"""FSDP-QLoRA on the CPU: 2 processes (accelerate launch, FSDP2 over gloo) against 1, killed and resumed.

The runs take the GPU's path: bf16 autocast with bf16 compute, the 4-bit weights stored as bfloat16,
the chunked loss head with LoRA on the output head, evaluation, the guards, the shipped accelerate
config (with ``use_cpu``). accelerate itself refuses FSDP on CPU processes (it silently trains with
DDP instead); ``fsdp_launch.py`` lifts exactly that refusal, so what runs below is accelerate's
and transformers' real FSDP path: sharded parameters, sharded checkpoints, their resume.

The one-process, FSDP, killed and resumed runs are ``benchmarks/fsdp_check.py --smoke``'s (its table
checked as tests/e2e/test_benchmarks.py checks every script's), with evaluation and sample prompts
added; the tests read its runs' folders and logs (``--work``).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qlora_kit.model.builtin import ensure_tiny_model
from qlora_kit.training.run_folder.outputs import CHECKPOINT
from tests.e2e.test_benchmarks import smoke_run
from tests.e2e.test_distributed import free_port, losses

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tests" / "e2e" / "fsdp_launch.py"
STEPS, SAVE, KILL = 4, 2, 3  # fsdp_check.py's smoke schedule: 4 steps, a checkpoint every 2, killed after 3
# Evaluation at the start and at every checkpoint; sample prompts: every rank generates with the sharded
# model, before training and after (after the resume too).
ADDED = ["--set", f"train.eval_steps={SAVE}", "--set", "train.sample_prompts=2"]
# What a run has written by the end of step KILL, but for its checkpoints: the folder's start
# (outputs.prepare_run_folder: manifest and resolved recipe) and what it logs as it goes.
BEFORE_THE_END = {"manifest.json", "recipe.yaml", "metrics.jsonl", "tensorboard"}


@pytest.fixture(scope="module")
def fsdp_check(tmp_path_factory) -> Path:
    """The folder of fsdp_check.py's runs (one, whole, killed: resumed into the same folder) and logs."""
    out = tmp_path_factory.mktemp("fsdp-check")
    smoke_run("fsdp_check.py", out, "--work", str(out / "runs"), *ADDED)
    return out / "runs"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def fsdp_train(config: Path, recipe: Path, out: Path, *extra: str):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    command = [*launch, str(LAUNCHER), "train", str(recipe), "--set", "train.fsdp=true"]
    command += ["--set", "train.micro_batch_size=4", "--output-dir", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_fsdp_trains_like_one_process_saves_one_adapter_and_resumes_bit_identically(fsdp_check):
    one, whole, killed = fsdp_check / "one", fsdp_check / "whole", fsdp_check / "killed"

    def log(run: str, stream: str) -> str:
        return (fsdp_check / f"{run}.{stream}").read_text()

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


def test_fsdp_with_a_mixed_per_layer_plan_trains_like_one_process_and_resumes_bit_identically(
    fsdp_check, tmp_path
):
    """Selective, full and no checkpointing on different layers under FSDP2 (the layers' forward is
    checkpointed inside FSDP's hooks): one process's losses, and a resume gives the same adapter."""
    mixed = [
        "--set",
        "memory.checkpointing=per_layer",
        "--set",
        "memory.layer_policies=[selective, full, none, selective]",
    ]
    # The reference is fsdp_check's one-process run, with full checkpointing: which layers recompute
    # changes no value, and its resolved recipe holds every other value the runs here train with.
    one = fsdp_check / "one"
    recipe, config = one / "recipe.yaml", fsdp_check / "accelerate.yaml"
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run = fsdp_train(config, recipe, whole, *mixed)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checkpointing: per_layer" in (whole / "recipe.yaml").read_text()  # not the reference's plan
    expected, got = losses(one), losses(whole)
    assert len(expected) == len(got) == STEPS
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a), (expected, got)

    # The folder a kill after step KILL leaves (the kill itself is the first test's): the uninterrupted
    # run's, less its later checkpoints and its final save. The resume then takes the path it takes
    # after a kill: the newest complete checkpoint, the metrics after it dropped, the sharded state loaded.
    shutil.copytree(whole, killed)
    for path in killed.iterdir():
        checkpoint = CHECKPOINT.match(path.name)
        written = int(checkpoint.group(1)) <= KILL if checkpoint else path.name in BEFORE_THE_END
        if not written and path.is_dir():
            shutil.rmtree(path)
        elif not written:
            path.unlink()
    resumed = fsdp_train(config, recipe, killed, *mixed, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {killed / f'checkpoint-{SAVE}'}" in resumed.stderr
    assert losses(killed) == got
    adapter, again = (
        load_file(whole / "adapter_model.safetensors"),
        load_file(killed / "adapter_model.safetensors"),
    )
    assert all(torch.equal(again[name], adapter[name]) for name in adapter)
