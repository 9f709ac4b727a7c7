"""Data-parallel training on the CPU: 2 processes (torchrun, gloo, loopback only) against 1.

Two processes with micro-batch b must follow the loss curve of one process with micro-batch 2b (same
seed, same data order), only the main process writes, and the adapter it writes loads and generates.
"""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_kit import Recipe
from qlora_kit.after.generate import Sampling, generate
from qlora_kit.model.adapters import load_trained
from qlora_kit.model.loading import resolve_model_path
from qlora_kit.model.precision import resolve_mixed_precision
from tests.conftest import once_per_session, run_cli_output

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
# fp32 compute and 32-bit AdamW, so the comparison is exact up to reduction order; 8 steps stay in the
# first epoch (an epoch's last, short batch is split differently across processes).
SETTINGS = [
    "--set", "train.max_steps=8", "--set", "train.save_steps=4", "--set", "train.logging_steps=1",
    "--set", "train.eval_steps=null", "--set", "train.sample_prompts=0", "--set", "lora.dropout=0.0",
    "--set", "optimizer.name=adamw_torch", "--set", "quant.compute_dtype=float32",
]  # fmt: skip
# An SFT run's layout is named: data.packing auto times the layouts in one process and chooses by padding
# in several (memory/layout_costs.py), and these tests compare data parallelism, not layouts.
PACKED = ["--set", "data.packing=true"]
ONE = ["--set", "train.micro_batch_size=8"]  # the one process: both halves of the two processes' batch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def losses(out: Path) -> list[float]:
    return [
        row["loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "loss" in (row := json.loads(line))
    ]


def in_this_process(monkeypatch, capsys) -> Callable[[Path, list[str]], str]:
    """The one-process reference through the real CLI in this process (a process start is most of a
    tiny run's time): ``(out, argv) -> stderr``."""

    def single(out: Path, train: list[str]) -> str:
        code, _, err = run_cli_output([*train, "--output-dir", str(out), *ONE], monkeypatch, capsys)
        assert code == 0, err[-2000:]
        return err

    return single


def in_a_fresh_process(out: Path, train: list[str]) -> str:
    """The one-process reference in a process of its own: an in-process GRPO run can sample other
    completions than a fresh process does (tests/e2e/test_grpo_oom.py, DRIVER)."""
    command = [sys.executable, "-m", "qlora_kit", *train, "--output-dir", str(out), *ONE]
    single = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-2000:]
    return single.stderr


def cases_command(logs: Path, cases: dict[str, dict], *flags: str) -> list[str]:
    """A torchrun launch (2 processes, gloo) whose ranks run ``cases`` in turn (tests/e2e/ddp_driver.py:
    ``{name: {"argv": [...], "env": {...}}}``, ``flags`` its own), each case's lines in ``logs``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [*command, str(ROOT / "tests/e2e/ddp_driver.py"), str(logs), json.dumps(cases), *flags]


def case_result(logs: Path, name: str, launched: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """One case of a cases_command launch as if it had been a launch of its own: its exit (a rank's
    failure, or the launch's exit when it never ran: an earlier case failed), both ranks' lines."""
    exits = [logs / f"{name}.rank{rank}.exit" for rank in (0, 1)]
    lines = "".join(log.read_text() for log in sorted(logs.glob(f"{name}.rank*.log")))
    if not all(e.exists() for e in exits):
        code = launched.returncode or 1
        return subprocess.CompletedProcess(name, code, "", f"{name} did not run: {lines}{launched.stderr}")
    failed = [int(e.read_text()) for e in exits if e.read_text() != "0"]
    return subprocess.CompletedProcess(name, failed[0] if failed else 0, "", lines)


def grpo_recipe(folder: Path, name: str, **grpo) -> str:
    """A GRPO recipe on the demo: 4 completions of 5 tokens per prompt, rewarded by length (the lengths
    vary, so the groups' advantages are not all 0)."""
    recipe = folder / f"{name}.yaml"
    rewards = [{"name": "length", "max_chars": 8}]
    values = {
        "data": {"max_seq_len": 64},
        "optimizer": {"lr": 1.0e-3},
        "train": {"objective": "grpo"},
        "grpo": {"num_generations": 4, "max_completion_length": 5, "rewards": rewards, **grpo},
    }
    recipe.write_text(json.dumps(values))  # YAML reads JSON
    return str(recipe)


SELECTIVE = ("--set", "memory.checkpointing=selective")
BF16_HEAD = [
    "--set", "train.mixed_precision=bf16", "--set", "quant.compute_dtype=bfloat16",
    "--set", "lora.target_modules=[q_proj, v_proj, lm_head]", "--set", "train.max_steps=6",
    "--set", "memory.chunked_loss=true",  # auto would choose full logits in the host's memory
]  # fmt: skip
DPO_BF16 = ["--set", "train.mixed_precision=bf16", "--set", "quant.compute_dtype=bfloat16"]
GRPO_STEPS = ["--set", "train.max_steps=4"]  # the first checkpoint's (train.save_steps 4)


def cases(folder: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Each test's training: (``qlora-kit train`` arguments both sides run, the two processes' own
    settings). The seeded GRPO run is first: in a process that trained before, a GRPO run can sample
    other completions than a fresh process does (tests/e2e/test_grpo_oom.py, DRIVER), and its reference
    is a fresh process."""

    def train(recipe: str, *settings: str) -> list[str]:
        return ["train", recipe, *SETTINGS, *settings]

    demo = str(ROOT / "recipes/demo.yaml")
    return {
        "grpo seeded": (train(grpo_recipe(folder, "seeded", seed_each_completion=True), *GRPO_STEPS), []),
        "grpo": (train(grpo_recipe(folder, "grpo"), *GRPO_STEPS), []),
        "sft": (train(demo, *PACKED), list(SELECTIVE)),
        "moe": (train(str(ROOT / "recipes/demo-moe.yaml"), *PACKED), []),
        "bf16 head": (train(demo, *BF16_HEAD, *PACKED), []),
        "dpo": (train(str(ROOT / "recipes/demo-dpo.yaml"), *DPO_BF16), []),
    }


@pytest.fixture(scope="module")
def launch(tmp_path_factory, worker_id) -> Callable[[str], tuple[Path, list[str], str]]:
    """Every test's two-process run, in one torchrun launch (gloo, micro-batch 4 per process) whose ranks
    run the cases in turn (tests/e2e/ddp_driver.py): the launcher and each rank start once, not once a
    test, and once per session across xdist workers (the tests spread over them).
    ``launch(case) -> (two's output, the case's train arguments, two's stderr)``: both ranks' lines,
    as one launch's stderr holds them."""

    def make(folder: Path) -> dict:
        logs = folder / "logs"
        logs.mkdir()
        runs = cases(folder)
        for train, _ in runs.values():
            # each builtin model built here first, as a user's earlier command would have: a launch on an
            # empty cache builds it in both ranks at once, and transformers saves the weights on rank 0
            # alone (should_save_on_this_rank), so rank 1's build can win the cache with the tokenizer alone
            resolve_model_path(Recipe.from_yaml(train[1], overrides=train[3::2]).model)
        four = ["--set", "train.micro_batch_size=4"]
        argv = {
            name: {"argv": [*train, *only, "--output-dir", str(folder / name), *four]}
            for name, (train, only) in runs.items()
        }
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = cases_command(logs, argv)
        launched = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        results = {name: case_result(logs, name, launched) for name in runs}
        return {name: [r.returncode, r.stderr, runs[name][0]] for name, r in results.items()}

    folder, found = once_per_session(tmp_path_factory, worker_id, "ddp-cases", make)

    def case(name: str) -> tuple[Path, list[str], str]:
        code, stderr, train = found[name]
        assert code == 0, stderr[-3000:]
        return folder / name, train, stderr

    return case


def one_and_two_processes(
    tmp_path: Path, single: Callable[[Path, list[str]], str], two: tuple[Path, list[str], str]
) -> tuple[Path, Path, str]:
    """The case trained by one process with micro-batch 8 (``single``: in_this_process or
    in_a_fresh_process) beside its two processes with 4 each (``launch(case)``; their own settings, as
    selective checkpointing, they must match one without): (one's output, two's output, two's stderr)."""
    one = tmp_path / "one"
    out, train, parallel = two
    reference = single(one, train)
    # both runs trained under the same autocast, as accelerate holds it (pipeline.run logs it)
    precision = [line for line in reference.splitlines() if "mixed precision: " in line]
    assert len(precision) == 1 and precision[0].split("mixed precision: ")[1] in parallel, precision
    return one, out, parallel


def test_two_processes_match_one_process_with_twice_the_batch(launch, tmp_path, monkeypatch, capsys):
    """The two processes checkpoint selectively, the one process fully (the default, which the MoE, bf16
    and DPO tests below run under DDP): selective's recompute runs inside DDP's backward, whose gradient
    hooks must fire as without checkpointing, and it computes what full checkpointing does, so the loss
    curves match either way. One pair of runs proves both (a run's process start is most of its time)."""
    one, two, stderr = one_and_two_processes(tmp_path, in_this_process(monkeypatch, capsys), launch("sft"))
    assert "checkpointing: selective" in (two / "recipe.yaml").read_text(), "the two processes ran selective"
    assert "checkpointed decoder layers: [0, 1, 2, 3]" in stderr
    expected, got = losses(one), losses(two)
    assert len(expected) == len(got) == 8
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b) <= 1e-3 * abs(a), (expected, got)

    # Only the main process wrote: each step logged once, one tensorboard file, one manifest, whole files.
    steps = [json.loads(line)["step"] for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert len(list((two / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in (two / "checkpoint-8").glob("rng_state_*.pth")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    assert not (two / ".staging").exists(), "a finished run leaves no staging folder"
    assert stderr.count("run manifest:") == 1, "logs come from the main process only"
    adapter = load_file(two / "adapter_model.safetensors")
    assert all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name), "the adapter trained"
    answers = generate(str(two), ["What sound does a cow make?"], Sampling(max_new_tokens=4))
    assert len(answers) == 1 and isinstance(answers[0], str)  # (8 steps in, the answer may be empty)
    # The adapter loads and acts: its logits are the one-process adapter's, far from the bare base's.
    _, tokenizer, two_lm = load_trained(two)
    one_lm = load_trained(one)[2]
    ids = tokenizer("What sound does a cow make?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got, expected = two_lm(input_ids=ids).logits, one_lm(input_ids=ids).logits
        with two_lm.disable_adapter():
            base = two_lm(input_ids=ids).logits
    moved = (got - base).abs().max()
    assert moved > 0 and (got - expected).abs().max() < 0.05 * moved, (moved, (got - expected).abs().max())


def test_a_mixture_of_experts_under_ddp_matches_one_process(launch, tmp_path, monkeypatch, capsys):
    """The MoE demo (4-bit experts, LoRA on every expert as one stacked factor per weight, so each LoRA
    parameter gets a gradient every step whatever the routing) under DDP follows one process."""
    single = in_this_process(monkeypatch, capsys)
    one, two, _ = one_and_two_processes(tmp_path, single, launch("moe"))
    expected, got = losses(one), losses(two)
    assert len(expected) == len(got) == 8 and expected[-1] < expected[0] - 1.0
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b) <= 1e-3 * abs(a), (expected, got)


def test_bf16_autocast_with_lora_on_the_output_head_trains_under_ddp(launch, tmp_path, monkeypatch, capsys):
    """The GPU's default path on 2 processes: bf16 autocast, the chunked head applying a LoRA lm_head
    outside the forward pass (DDP must not search for unused parameters, or it fails there): BF16_HEAD."""
    single = in_this_process(monkeypatch, capsys)
    one, two, stderr = one_and_two_processes(tmp_path, single, launch("bf16 head"))
    assert "mixed precision: bf16" in stderr
    expected, got = losses(one), losses(two)
    assert len(expected) == len(got) == 6
    for a, b in zip(expected, got, strict=True):  # bf16 matmuls: rounding differs with the split
        assert abs(a - b) <= 2e-2 * abs(a), (expected, got)
    adapter = load_file(two / "adapter_model.safetensors")
    head = [name for name in adapter if "lm_head.lora_B" in name]
    assert head and all(adapter[name].abs().sum() > 0 for name in head), "the head's LoRA trained"


def test_dpo_under_ddp_matches_one_process_under_bf16_autocast(launch, tmp_path, monkeypatch, capsys):
    """train.objective dpo on 2 processes, the GPU's default precision: the same pair losses as one
    process with both halves of the batch, one trained adapter written (TRL's reference copy is not)."""
    single = in_this_process(monkeypatch, capsys)
    one, two, stderr = one_and_two_processes(tmp_path, single, launch("dpo"))
    expected, got = losses(one), losses(two)
    assert len(expected) == len(got) == 8
    for a, b in zip(expected, got, strict=True):  # bf16 matmuls: rounding differs with the split
        assert abs(a - b) <= 2e-2 * abs(a), (expected, got)
    assert expected[-1] < expected[0] < 0.7, expected  # log 2 at the start: the pairs are being learned
    adapter = load_file(two / "adapter_model.safetensors")
    assert adapter and not any(
        ".ref." in name or ("lora_B" in name and not t.abs().sum()) for name, t in adapter.items()
    )
    assert stderr.count("the reference policy is") == 1
    assert "mixed precision: bf16" in stderr


def test_grpo_under_ddp_trains_on_the_configured_global_batch(launch):
    """train.objective grpo on 2 processes: what can equal one process does. TRL 1.16 seeds each process's
    sampling differently (set_seed(seed, device_specific=True)) and samples a process's prompts in one
    generate call, so without grpo.seed_each_completion (the next test) the rollouts cannot equal one
    process's; the prompts per step, the completions trained per step and the checkpoint's per-process
    rollout random state can (README, GRPO).

    No one-process run: what it would show here, its epochs and its autocast, follows from the recipe.
    4 steps, the first checkpoint's (train.save_steps 4): each step's count is the same at any step."""
    two, train, stderr = launch("grpo")
    got = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(1, 5)), "each step logged once, by the main process"
    # 2 prompts x 4 completions per optimizer step, as one process with micro-batch 8 samples: step s is
    # s * 2 of the 168 training prompts into the epoch (the Trainer's step / steps per epoch), the same
    # count of sampled completions (the rewards are means over both processes' completions, gathered)
    assert [r["epoch"] for r in got] == pytest.approx(
        [s * 2 / 168 for s in range(1, 5)], abs=1e-4
    )  # logged to 4 places
    one_process = resolve_mixed_precision(Recipe.from_yaml(train[1], overrides=SETTINGS[1::2]))
    assert f"mixed precision: {one_process}" in stderr, "the autocast one process picks for the recipe"
    assert all(r["reward"] is not None and "frac_reward_zero_std" in r for r in got)
    assert sorted(p.name for p in (two / "checkpoint-4").glob("rng_state_*.pth")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]  # each process's rollout random state, for an exact resume
    assert stderr.count("the loss will read about") == 1, "the explanation comes from the main process only"
    adapter = load_file(two / "adapter_model.safetensors")
    assert adapter and not any(".ref." in name for name in adapter)
    assert any("lora_B" in name and t.abs().sum() > 0 for name, t in adapter.items()), "the adapter trained"


def test_grpo_with_seeded_completions_under_ddp_equals_one_process(launch, tmp_path):
    """grpo.seed_each_completion on 2 processes: the same rollouts as one process with both halves of
    the batch, so the same rewards step for step, the same losses and the same adapter (without the
    option TRL's rollouts depend on the process: the test above).

    fp32 compute, as the first test here: under bf16 autocast the two runs' weights differ by rounding
    after the first update (Adam turns each tiny gradient entry's sign into a full step: ~5% of the
    adapter's update), and sooner or later a sampled token flips (train.seed 1: at step 4), after which
    the runs rightly part; that is rounding, not seeding. The seeding under bf16 autocast:
    tests/test_grpo.py (a prompt sampled alone or beside others)."""
    one, two, _ = one_and_two_processes(tmp_path, in_a_fresh_process, launch("grpo seeded"))

    def rows(out: Path) -> list[dict]:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    expected, got = rows(one), rows(two)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3, 4]
    sampled = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length"]
    # the same completions: every figure computed from them alone is equal, not close
    assert [[r[k] for k in sampled] for r in got] == [[r[k] for k in sampled] for r in expected]
    assert any(r["reward_std"] > 0 for r in expected), "no reward spread: nothing trained on the rollouts"
    for a, b in zip(expected, got, strict=True):  # exact up to reduction order, as the first test here
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (expected, got)
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * a["loss"] + 1e-6, (expected, got)
    # The adapter's weight update, B @ A per module (different rollouts move it by about its own size)
    one_, two_ = (load_file(out / "adapter_model.safetensors") for out in (one, two))
    assert one_.keys() == two_.keys()
    pairs = [(name, name.replace("lora_B", "lora_A")) for name in one_ if "lora_B" in name]
    update = {out: [t[b] @ t[a] for b, a in pairs] for out, t in (("one", one_), ("two", two_))}
    size = sum(u.norm() ** 2 for u in update["one"]) ** 0.5
    diff = sum((u - v).norm() ** 2 for u, v in zip(update["one"], update["two"], strict=True)) ** 0.5
    assert size > 0 and diff < 1e-3 * size, (float(size), float(diff))
