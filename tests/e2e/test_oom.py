"""Out-of-memory inside a step (training/step/oom_recovery.py), made on the CPU by the fault injector
(testing/oom_faults.py, ``QLORA_KIT_OOM_CAP_BYTES``): every run here goes through the Trainer under
bf16 autocast, as on a GPU, and everything after the injected error is the real code path.

The data are short rows and one long one, so only the micro-batch holding the long row needs more than
the cap: the run splits at that step and not before.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import TrainerCallback

from qlora_kit import Recipe, train
from qlora_kit.model.builtin import ensure_tiny_model
from qlora_kit.registries import metric_keys as keys
from qlora_kit.testing import allocator_faults, oom_faults
from tests.conftest import once_per_session, run_cli_output
from tests.e2e.test_distributed import case_result, cases_command, free_port

pytestmark = pytest.mark.slow  # each test trains a few short runs

ROOT = Path(__file__).resolve().parents[2]
TWO_PROCESS_TIMEOUT = 300  # s: two processes train a few steps in about a minute
STEPS = 7  # 40 rows in 5 micro-batches of 8: the long row is in step 5 of the first epoch
# The FSDP test's own launch (tests/e2e/test_fsdp.py reads benchmarks/fsdp_check.py's runs): the launcher
# that lets accelerate run FSDP on CPU processes, and the demo cut to FSDP's settings.
LAUNCHER = ROOT / "tests" / "e2e" / "fsdp_launch.py"
FSDP_SETTINGS = [
    "--set", "train.max_steps=6", "--set", "train.save_steps=3", "--set", "train.logging_steps=1",
    "--set", "train.eval_steps=3", "--set", "train.sample_prompts=0", "--set", "lora.dropout=0.0",
    "--set", "train.mixed_precision=bf16", "--set", "quant.compute_dtype=bfloat16",
    "--set", "quant.quant_storage=bfloat16", "--set", "optimizer.name=adamw_torch",
    "--set", "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]",
    "--set", "data.packing=true",  # named: auto times the layouts in one process, chooses by padding in several
]  # fmt: skip


def rows() -> list[dict]:
    short = [{"instruction": f"Repeat the number {i}.", "input": "", "output": str(i)} for i in range(39)]
    long = {"instruction": "Repeat: " + " ".join(f"w{i}" for i in range(40)), "input": "", "output": "ok"}
    return [*short[:20], long, *short[20:]]


def recipe_values(folder: Path, **overrides) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    values = {
        "data": {"path": str(data), "packing": False, "max_seq_len": 128},
        "lora": {"dropout": 0.1},  # dropout draws: the redone step must draw as the split run does
        "memory": {"checkpointing": "none"},
        "optimizer": {"lr": 1.0e-3},
        "train": {
            "max_steps": STEPS, "logging_steps": 1, "micro_batch_size": 8, "mixed_precision": "bf16",
            "output_dir": str(folder / "out"), "report_to": [], "eval_steps": None, "sample_prompts": 0,
        },
    }  # fmt: skip
    for dotted, value in overrides.items():
        section, field = dotted.split(".")
        values[section][field] = value
    return values


def run(folder: Path, monkeypatch, cap: int | None = None, **overrides):
    monkeypatch.setenv(oom_faults.ENV, "" if cap is None else str(cap))
    recipe = Recipe.from_dict(recipe_values(folder, **overrides))
    oom_faults.INJECTOR.peaks.clear()
    return train(recipe)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def splits(out: Path) -> list[dict]:
    return [row for row in metrics(out) if keys.OOM_SPLIT in row]


def shared_run(
    tmp_path_factory, worker_id: str, name: str, cap: int, **overrides
) -> tuple[SimpleNamespace, Path]:
    """A run once per session across workers (the tests reading it spread over them), in the session's
    folder ``name``: (its output_dir, steps, training losses and the injector's largest peak; the folder)."""

    def make(folder: Path) -> dict:
        monkeypatch = pytest.MonkeyPatch()
        try:
            result = run(folder, monkeypatch, cap=cap, **overrides)
        finally:
            monkeypatch.undo()
        return {
            "steps": result.steps,
            "train_losses": result.train_losses,
            "peak": max(oom_faults.INJECTOR.peaks),
        }

    folder, done = once_per_session(tmp_path_factory, worker_id, name, make)
    return SimpleNamespace(output_dir=folder / "out", **done), folder


@pytest.fixture(scope="session")
def reference(tmp_path_factory, worker_id):
    """Micro-batch 4 with twice the accumulation, never capped; and the cap that only a micro-batch of
    8 holding the long row passes (1.5 times the largest forward pass of 4 rows)."""
    split = {"train.micro_batch_size": 4, "train.grad_accum": 2}
    result, _ = shared_run(tmp_path_factory, worker_id, "oom-reference", cap=10**15, **split)
    return result, int(1.5 * result.peak)


@pytest.fixture(scope="session")
def capped(reference, tmp_path_factory, worker_id):
    return shared_run(tmp_path_factory, worker_id, "oom-capped", cap=reference[1], **{"train.save_steps": 1})


def stopped_after(folder: Path, monkeypatch, step: int, cap: int | None = None, **overrides) -> Path:
    """A run stopped after optimizer step ``step`` (saved: train.save_steps 1) with its final files
    deleted: what --resume meets after a kill there, its newest checkpoint ``step``'s, without a process
    to kill (the resume reads only the checkpoint: the kill itself is tests/e2e/test_faults.py's).
    Returns its recipe file."""

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == step

    values = recipe_values(folder, **{"train.save_steps": 1, **overrides})
    recipe_file = folder / "recipe.yaml"
    recipe_file.write_text(Recipe.from_dict(values).to_yaml())
    monkeypatch.setenv(oom_faults.ENV, "" if cap is None else str(cap))
    result = train(Recipe.from_dict(values), callbacks=[StopAfter()])
    assert result.steps == step
    out = folder / "out"
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # the finished marker first
        (out / name).unlink()
    assert sorted(p.name for p in out.glob("checkpoint-*"))[-1:] == [f"checkpoint-{step}"]
    return recipe_file


def test_the_split_keeps_steps_examples_and_losses(reference, capped):
    (ref, _), (result, folder) = reference, capped
    out = folder / "out"
    [split] = splits(out)
    k = split["step"]
    assert 1 < k < STEPS, "only the micro-batch with the long row passes the cap"
    assert (
        split[keys.OOM_SPLIT][keys.MICRO_BATCH_BEFORE] == 8 and split[keys.OOM_SPLIT][keys.MICRO_BATCH] == 4
    )
    assert result.steps == ref.steps == STEPS
    # the same examples in every step: the trained tokens counted at each step are the reference's
    tokens = [r[keys.TRAINED_TOKENS] for r in metrics(out) if keys.TRAINED_TOKENS in r]
    assert tokens == [r[keys.TRAINED_TOKENS] for r in metrics(ref.output_dir) if keys.TRAINED_TOKENS in r]
    # from step k on, micro-batch 8 in two parts computes what micro-batch 4 with accumulation 2 does
    # (bf16 autocast: the same rows padded to the same length, summed in another order; before step k
    # the two runs already differed by bf16 rounding, micro-batch 8 against 4)
    assert result.train_losses[k - 1 :] == pytest.approx(ref.train_losses[k - 1 :], rel=1e-2)
    assert (out / f"checkpoint-{k}" / "micro_batch_split.json").is_file()
    assert not (out / f"checkpoint-{k - 1}" / "micro_batch_split.json").exists()


def test_an_out_of_memory_error_in_the_second_micro_batch_of_an_accumulating_step(tmp_path, monkeypatch):
    """grad_accum 2, dropout on: step 1's first micro-batch has run (its gradients accumulated, its dropout
    drawn) when the second, holding the long row, runs out of memory. The redone step trains what the
    uncapped run trains: the same tokens, and its loss and gradient norm, step by step; and it draws its
    dropout from the step's random state, wherever in the failed attempt the error came."""
    # train.seed 2 puts the long row in step 1's second micro-batch (the order of the injector's peaks);
    # without the worst-batch probe, which would split before step 1 and never meet the error in a step;
    # the chunked head named (chunked_loss auto picks full logits on a CPU), as the 1% bounds below were
    # set with it: the split draws other dropout masks, which move step 2's gradient norm 1.2% with full logits
    settings = {
        "train.micro_batch_size": 4, "train.grad_accum": 2, "train.seed": 2, "train.max_steps": 3,
        "train.probe_worst_batch": False, "memory.chunked_loss": True,
    }  # fmt: skip
    free = run(tmp_path / "free", monkeypatch, cap=10**15, **settings)
    peaks = list(oom_faults.INJECTOR.peaks)
    assert max(range(len(peaks)), key=peaks.__getitem__) == 1, peaks
    capped = run(tmp_path / "capped", monkeypatch, cap=int(0.75 * max(peaks)), **settings)
    [split] = splits(capped.output_dir)
    assert split["step"] == 1
    assert (
        split[keys.OOM_SPLIT][keys.MICRO_BATCH_BEFORE] == 4 and split[keys.OOM_SPLIT][keys.MICRO_BATCH] == 2
    )
    for key in (keys.TRAINED_TOKENS, "grad_norm", "loss"):
        got, want = ([r[key] for r in metrics(x.output_dir) if key in r] for x in (capped, free))
        assert len(got) == 3 and got == pytest.approx(want, rel=1e-2), key
    # A lower cap fails the same micro-batch earlier in its forward pass, after fewer dropout draws. The
    # redone step starts from the step's random state either way, so the two capped runs are identical
    # bit for bit (the uncapped run cannot be that oracle: its masks have the unsplit shapes).
    early = run(tmp_path / "early", monkeypatch, cap=int(0.55 * max(peaks)), **settings)
    [early_split] = splits(early.output_dir)
    assert early_split["step"] == 1 and early_split[keys.OOM_SPLIT][keys.MICRO_BATCH] == 2
    assert early_split[keys.OOM_SPLIT]["error"] != split[keys.OOM_SPLIT]["error"], "the same failure point"
    for key in ("grad_norm", "loss"):
        got, want = ([r[key] for r in metrics(x.output_dir) if key in r] for x in (early, capped))
        assert got == want, key


def test_resume_after_the_split_is_bit_identical(reference, capped, tmp_path, monkeypatch, capsys):
    """Resumed from the split step's own checkpoint, in this process (a fresh Trainer, which knows the
    split only from the checkpoint's micro_batch_split.json)."""
    (_, cap), (_, folder) = reference, capped
    k = splits(folder / "out")[0]["step"]
    recipe_file = stopped_after(tmp_path, monkeypatch, k, cap=cap)
    out = tmp_path / "out"
    argv = ["train", str(recipe_file), "--output-dir", str(out), "--resume"]
    code, _, err = run_cli_output(argv, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert f"resuming from {out / f'checkpoint-{k}'}" in " ".join(err.split())
    assert "resumed with the micro-batch split" in err
    assert len(splits(out)) == 1, "the resumed run starts split: no second out-of-memory error"
    got, want = (
        load_file(out / "adapter_model.safetensors"),
        load_file(folder / "out" / "adapter_model.safetensors"),
    )
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_micro_batch_of_one_row_that_does_not_fit_stops_with_one_line(tmp_path, monkeypatch, capsys):
    recipe_file = stopped_after(
        tmp_path, monkeypatch, 2, **{"train.max_steps": 4, "train.micro_batch_size": 2}
    )
    out = tmp_path / "out"
    before = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    monkeypatch.setenv(oom_faults.ENV, "1000")  # no row fits
    code, _, err = run_cli_output(
        ["train", str(recipe_file), "--output-dir", str(out), "--resume"], monkeypatch, capsys
    )
    assert code == 3, err[-2000:]
    line = next(x for x in err.splitlines() if "training stopped:" in x)
    assert "step 3: out of memory" in line and "a micro-batch of 1 row" in line
    assert (
        "data.max_seq_len" in line and "memory.checkpointing" in line and "memory.loss_chunk_tokens" in line
    )
    assert "the planner predicts" in line
    assert "checkpoint-2" in line and "Traceback" not in err
    after = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_on_oom_stop_stops_at_the_first_out_of_memory_error_with_one_line(
    reference, capped, tmp_path, monkeypatch, capsys
):
    """``train.on_oom: stop``: the micro-batch of 8 with the long row passes the cap and the run stops
    there, though splitting would fit it; the checkpoints before it are what the split run wrote."""
    (_, cap), (_, split_folder) = reference, capped
    k = splits(split_folder / "out")[0]["step"]
    values = recipe_values(tmp_path, **{"train.save_steps": 1, "train.on_oom": "stop"})
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(Recipe.from_dict(values).to_yaml())
    out = tmp_path / "out"
    monkeypatch.setenv(oom_faults.ENV, str(cap))
    code, _, err = run_cli_output(["train", str(recipe_file), "--output-dir", str(out)], monkeypatch, capsys)
    assert code == 3, err[-2000:]
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if "training stopped:" in x]
    assert f"step {k}: out of memory in micro-batch 1 of the step" in line
    assert "a micro-batch of 8 rows" in line and "tokens (8 x " in line  # the batch and its tokens
    assert (
        "memory.checkpointing" in line and "data.max_seq_len" in line and "memory.loss_chunk_tokens" in line
    )
    assert f"checkpoint-{k - 1}, is intact" in line
    assert not splits(out), "stop never splits"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted(f"checkpoint-{s}" for s in range(1, k))
    got = load_file(out / f"checkpoint-{k - 1}" / "adapter_model.safetensors")
    want = load_file(split_folder / "out" / f"checkpoint-{k - 1}" / "adapter_model.safetensors")
    assert all(torch.equal(got[n], want[n]) for n in want), "the newest checkpoint is the one before the stop"


def test_evaluation_out_of_memory_splits_the_evaluation_batch_only(tmp_path, monkeypatch):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in rows()[16:24]))  # the long row among them
    settings = {"data.val_path": str(val), "train.eval_steps": 2, "train.max_steps": 2}
    monkeypatch.setenv(oom_faults.EVAL_ENV, str(10**15))  # armed, never reached: measures
    oom_faults.INJECTOR.eval_peaks.clear()
    free = run(tmp_path / "free", monkeypatch, **settings)
    cap = int(0.75 * max(oom_faults.INJECTOR.eval_peaks))
    monkeypatch.setenv(oom_faults.EVAL_ENV, str(cap))
    capped = run(tmp_path / "capped", monkeypatch, **settings)
    events = [row[keys.OOM_SPLIT] for row in splits(capped.output_dir)]
    assert events and all(e["phase"] == "eval" for e in events), "training's micro-batch is never split"
    assert capped.train_losses == free.train_losses  # training untouched, bit for bit
    assert capped.eval_losses == pytest.approx(free.eval_losses, rel=1e-4)  # the same rows, in parts


def test_the_probe_meets_an_evaluation_out_of_memory_error_before_step_1(tmp_path, monkeypatch):
    """An evaluation that cannot fit is met before step 1 and split there, training untouched. Two paths
    meet it: the evaluation at the start (eval_on_start) and the worst-batch probe's largest evaluation
    batch under no-grad (what a run without the start evaluation relies on). Red only when neither does
    (both turned off: the split came at step 2's evaluation); each alone keeps it green."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in rows()[16:24]))  # the long row among them
    settings = {
        "data.val_path": str(val), "train.eval_steps": 2, "train.max_steps": 2, "train.probe_worst_batch": True,
    }  # fmt: skip
    monkeypatch.setenv(oom_faults.EVAL_ENV, str(10**15))  # armed, never reached: measures
    oom_faults.INJECTOR.eval_peaks.clear()
    free = run(tmp_path / "free", monkeypatch, **settings)
    monkeypatch.setenv(oom_faults.EVAL_ENV, str(int(0.75 * max(oom_faults.INJECTOR.eval_peaks))))
    capped = run(tmp_path / "capped", monkeypatch, **settings)
    [split] = splits(capped.output_dir)
    assert split["step"] == 0 and split[keys.OOM_SPLIT]["phase"] == "eval", split
    assert capped.train_losses == free.train_losses
    assert capped.eval_losses == pytest.approx(free.eval_losses, rel=1e-4)


def test_out_of_memory_in_the_recompute_leaves_no_partial_gradient(tmp_path, monkeypatch):
    # Layers 0 and 2 of 4 checkpointed: backward computes layer 3's LoRA gradients, then fails in
    # layer 2's recompute; those gradients must not stay in the redone step.
    settings = {"memory.checkpointing": "every_n", "memory.every_n": 2, "train.max_steps": 2}
    split = {"train.micro_batch_size": 4, "train.grad_accum": 2}
    oom_faults.INJECTOR.forwards.clear()
    reference = run(tmp_path / "reference", monkeypatch, cap=10**15, **settings, **split)
    forward, peak = max(oom_faults.INJECTOR.forwards), max(oom_faults.INJECTOR.peaks)
    cap = 2 * forward + (peak - forward)  # micro-batch 8: its forward pass fits, its recompute does not
    capped = run(tmp_path / "capped", monkeypatch, cap=cap, **settings)
    [event] = [row[keys.OOM_SPLIT] for row in splits(capped.output_dir)]
    assert (
        event["error"].startswith("qlora_kit fault injector")
        and "recomputing a checkpointed layer" in event["error"]
    )
    grad_norms = [
        [r["grad_norm"] for r in metrics(x.output_dir) if "grad_norm" in r] for x in (capped, reference)
    ]
    assert grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-2)
    assert capped.train_losses == pytest.approx(reference.train_losses, rel=1e-2)


def test_the_probe_changes_nothing_and_meets_the_worst_batch_before_step_1(reference, tmp_path, monkeypatch):
    settings = {"train.max_steps": 3}
    without = run(tmp_path / "without", monkeypatch, **settings, **{"train.probe_worst_batch": False})
    probed = run(tmp_path / "probed", monkeypatch, **settings, **{"train.probe_worst_batch": True})
    a, b = (load_file(r.output_dir / "adapter_model.safetensors") for r in (without, probed))
    assert all(torch.equal(a[n], b[n]) for n in a), "the probe leaves training bit-identical"
    assert probed.train_losses == without.train_losses
    capped = run(
        tmp_path / "capped", monkeypatch, cap=reference[1], **settings, **{"train.probe_worst_batch": True}
    )
    [row] = splits(capped.output_dir)
    assert row["step"] == 1 and row[keys.OOM_SPLIT][keys.MICRO_BATCH_PARTS] == 2
    assert capped.steps == 3


def why_failed(stderr: str) -> str:
    """A failed launch's cause first: the lines where a process died (a C++ abort's ``terminate called`` and
    ``what():``, a traceback's last line), which torchrun's closing summary pushes out of the tail."""
    marks = ("terminate called", "what():", "Error:", "error:", "Exception")
    causes = [line for line in stderr.splitlines() if any(mark in line for mark in marks)]
    return "\n".join([*causes[:20], "...", stderr[-2000:]])


def launched(
    command: list[str], env: dict[str, str], timeout: float = TWO_PROCESS_TIMEOUT
) -> subprocess.CompletedProcess:
    """A launcher and its processes in a session of their own: past the timeout (a process left waiting
    in a collective) all of them are killed and the test fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"2 processes still running after {timeout} s: {stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def two_process_runs(reference, tmp_path_factory, worker_id):
    """Both two-process tests' runs in one torchrun launch (DDP over gloo) whose ranks run them in turn
    (tests/e2e/ddp_driver.py, the faults installed as ``python -m qlora_kit.testing`` does, each case's
    caps in its own environment): the launcher and each rank start once. Past TWO_PROCESS_TIMEOUT a case
    (a process left waiting in a collective) the launch is killed and the tests fail.
    ``(case name -> CompletedProcess of that case, its output folder), the backward case's one process``."""

    def make(folder: Path) -> dict:
        logs = folder / "logs"
        logs.mkdir()
        cases, outs = {}, {}

        def case(name: str, values: dict, caps: dict[str, str]) -> None:
            recipe_file = folder / f"{name}.yaml"
            recipe_file.write_text(Recipe.from_dict(values).to_yaml())
            outs[name] = folder / name / "out"
            cases[name] = {"argv": ["train", str(recipe_file), "--output-dir", str(outs[name])], "env": caps}

        # micro-batch 4 per process: only the process whose micro-batch holds the long row passes the cap
        values = recipe_values(folder / "forward", **{"train.micro_batch_size": 4, "train.max_steps": 5})
        cap = reference[1] // 2  # 0.75 of a forward pass of 4 rows with the long one: over 2 of them
        case("forward", values, {oom_faults.ENV: str(cap)})

        short = folder / "short.jsonl"  # every micro-batch of 4 alike: rank 1's first one passes the cap
        short.write_text(
            "".join(json.dumps(r) + "\n" for r in rows() if not r["instruction"].startswith("Repeat:"))
        )
        settings = {
            "data.path": str(short), "memory.checkpointing": "full", "lora.dropout": 0.0, "train.max_steps": 3,
            "train.micro_batch_size": 4,
        }  # fmt: skip
        oom_faults.INJECTOR.forwards.clear()
        monkeypatch = pytest.MonkeyPatch()
        try:  # the one process: micro-batch 4 and accumulation 2, never capped
            one = run(folder / "one", monkeypatch, cap=10**15, **settings, **{"train.grad_accum": 2})
        finally:
            monkeypatch.undo()
        forward, peak = max(oom_faults.INJECTOR.forwards), min(oom_faults.INJECTOR.peaks)
        cap = int(0.75 * peak)  # over any micro-batch's recompute of 4 rows, under one of 2
        assert forward < cap, "the forward pass fits: the error comes in the backward pass"
        case(
            "backward",
            recipe_values(folder / "backward", **settings),
            {oom_faults.ENV: str(cap), oom_faults.RANK_ENV: "1"},
        )

        launch = launched(
            cases_command(logs, cases, "--faults"), {}, timeout=TWO_PROCESS_TIMEOUT * len(cases)
        )
        results = {name: case_result(logs, name, launch) for name in cases}
        return {
            "one": {"output_dir": str(one.output_dir), "train_losses": one.train_losses},
            "cases": {name: [r.returncode, r.stderr, str(outs[name])] for name, r in results.items()},
        }

    _, found = once_per_session(tmp_path_factory, worker_id, "oom-two-processes", make)
    cases = {
        name: (subprocess.CompletedProcess(name, code, "", stderr), Path(out))
        for name, (code, stderr, out) in found["cases"].items()
    }
    one = found["one"]
    return cases, SimpleNamespace(output_dir=Path(one["output_dir"]), train_losses=one["train_losses"])


def test_two_processes_where_one_runs_out_of_memory_split_together(two_process_runs):
    """DDP over gloo, micro-batch 4 per process: only the process whose micro-batch holds the long row
    passes the cap. Both agree at the flag after that forward pass, before any backward, split and redo
    the step together: no process waits forever."""
    result, out = two_process_runs[0]["forward"]
    assert result.returncode == 0, why_failed(result.stderr)
    [event] = [row[keys.OOM_SPLIT] for row in splits(out)]
    assert event[keys.MICRO_BATCH_BEFORE] == 4 and event[keys.MICRO_BATCH] == 2
    assert "another process" in result.stderr or "fault injector" in result.stderr
    steps = [row["step"] for row in metrics(out) if "loss" in row]
    assert steps == list(range(1, 6))


def test_two_processes_where_one_runs_out_of_memory_in_the_all_reducing_backward_split_together(
    two_process_runs,
):
    """DDP over gloo, micro-batch 4 per process and no accumulation, every layer checkpointed; only
    rank 1 is capped, and its forward pass fits: it runs out of memory recomputing a layer in the
    backward pass of the step's last (here only) micro-batch, the backward pass in which DDP would
    all-reduce the gradients. No backward pass all-reduces (oom_recovery.py): both processes split at
    step 1 and train on, as one process does with micro-batch 4 and accumulation 2."""
    (result, out), one = two_process_runs[0]["backward"], two_process_runs[1]
    assert result.returncode == 0, why_failed(result.stderr)
    [row] = splits(out)
    event = row[keys.OOM_SPLIT]
    assert row["step"] == 1 and event[keys.MICRO_BATCH_BEFORE] == 4 and event[keys.MICRO_BATCH] == 2
    assert "another process" in event["error"], "rank 0 (which writes the metrics) did not fail itself"
    assert "recomputing a checkpointed layer" in result.stderr  # rank 1's own line
    # the gradients all-reduced once per step average as DDP's would: one process's norms and losses
    norms = [[r["grad_norm"] for r in metrics(o) if "grad_norm" in r] for o in (out, one.output_dir)]
    assert len(norms[0]) == 3 and norms[0] == pytest.approx(norms[1], rel=1e-2)
    losses = [r["loss"] for r in metrics(out) if "loss" in r]
    assert losses == pytest.approx(one.train_losses, rel=1e-2)


def fsdp_cpu_config(tmp_path: Path) -> Path:
    """The shipped FSDP config, on 2 CPU processes."""
    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / "fsdp-qlora.yaml").read_text())
    config.update(use_cpu=True, num_processes=2)
    path = tmp_path / "fsdp-cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_under_fsdp_an_out_of_memory_error_stops_the_run_and_no_process_hangs(tmp_path):
    """FSDP2 over 2 CPU processes (tests/e2e/fsdp_launch.py): its gathers run inside the forward and
    backward passes, where no flag can stand between them, so ``train.on_oom: split`` falls back to stop.
    Rank 1 alone runs out of memory in step 1's forward pass, between two of FSDP's gathers: it stops
    with the line and enters no collective, and the launcher ends rank 0 (bounded by the timeout)."""
    ensure_tiny_model("tiny-llama")  # built once here: two processes would both build it
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(fsdp_cpu_config(tmp_path)),
    ]
    command += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), str(LAUNCHER)]
    command += ["train", "recipes/demo.yaml", *FSDP_SETTINGS, "--set", "train.fsdp=true"]
    command += ["--set", "train.micro_batch_size=4", "--output-dir", str(tmp_path / "out")]
    caps = {oom_faults.ENV: "1000", oom_faults.EVAL_ENV: str(10**15), oom_faults.RANK_ENV: "1"}
    result = launched(command, caps)  # training fails on rank 1; evaluation never
    assert result.returncode != 0
    assert "train.on_oom: split is not available under FSDP" in result.stderr
    [line] = [x for x in result.stderr.splitlines() if "training stopped:" in x]  # rank 1's
    assert "step 1: out of memory" in line and "fault injector" in line and "data.max_seq_len" in line


def allocation_capped(folder: Path, monkeypatch, cap: int, policy: str):
    """A run under the allocation cap (testing/allocator_faults.py): every tensor the step's attempts
    allocate counts while it lives, and the error comes from the operator that passes the cap."""
    monkeypatch.setenv(allocator_faults.ENV, str(cap))
    # train.seed 2 puts the long row in step 1 (the default's order: step 5), so 2 steps train through
    # the split step and one after it
    overrides = {"memory.checkpointing": "full" if policy == "offload" else policy, "train.max_steps": 2}
    overrides["train.seed"] = 2
    if policy == "offload":
        overrides["memory.offload_activations"] = True
    allocations = allocator_faults.ALLOCATIONS
    allocations.peaks.clear()
    allocations.survivors.clear()
    allocations.raised = 0
    result = train(Recipe.from_dict(recipe_values(folder, **overrides)))
    return result, allocations


@pytest.mark.parametrize("policy", ["none", "full", "selective", "offload"])
def test_a_failed_attempt_leaves_nothing_allocated_for_the_retry(tmp_path, monkeypatch, policy):
    """Out of memory raised from the allocation path, as CUDA's allocator raises it (the H200's step
    split 4 -> 2 -> 1 with 13.3 GiB of a 13.46 GiB cap still held at every retry): the micro-batch
    holding the long row passes a cap at 0.8 of its own peak, the step is split and redone, and no
    tensor allocated by the failed attempt is alive when the retry begins: under none a forward pass's
    graph (accounting.py's saved tensors, held detached), under the checkpointing policies a failed
    recompute's nodes left in autograd's ready queue (oom/failure.py's release_memory drains it)."""
    _, allocations = allocation_capped(tmp_path / "free", monkeypatch, 10**15, policy)
    assert max(range(len(allocations.peaks)), key=allocations.peaks.__getitem__) == 0, (
        "the long row in step 1"
    )
    cap = int(0.8 * max(allocations.peaks))
    result, allocations = allocation_capped(tmp_path / "capped", monkeypatch, cap, policy)
    assert result.steps == 2
    assert allocations.raised >= 1 and allocations.survivors, "the cap made a retry"
    assert allocations.survivors == [0] * len(allocations.survivors)
