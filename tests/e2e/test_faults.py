"""Faults: SIGKILL at any moment, SIGTERM, two runs into one folder, an unwritable folder, a full disk.

Every killed run is resumed with the CLI's --resume and must end with the same adapter, bit for bit,
as a run that was never interrupted. The killed runs are processes of their own (the SIGKILL ones forked
one after another by one driver process after its imports: killed_runs); each resume and each
uninterrupted run (the shared reference, the mixture's) is the CLI in this process (conftest.qlora_kit_here,
as test_keep_best's): all a resume knows of the killed run is what that process left on disk, and a
process start (~8 s on 2 cores) was most of a resume's cost.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_kit.cli.app import main as cli_main
from qlora_kit.training.run_folder.outputs import is_complete_checkpoint
from tests.conftest import once_per_session, run_cli

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
# 48 rows in micro-batches of 8: 6 steps an epoch, so 12 steps are two epochs, and a resume can start
# inside the first epoch and cross into the second (whose order the sampler draws again) or start at
# the first epoch's end, without the 40 steps the demo's 168 rows took for that.
ROWS, STEPS, SAVE_EVERY = 48, 12, 3
# float32 compute: these CPUs lack AVX512-BF16 and emulate bfloat16 matmuls (11x slower); resume under
# bf16 is test_after_training's test_resumed_run_ends_with_the_same_adapter_bit_for_bit[bf16]
RECIPE = f"""
quant:
  compute_dtype: float32
lora:
  dropout: 0.1
data:
  path: train.jsonl  # beside the recipe, which it is read relative to
  max_seq_len: 64
  packing: false
optimizer:
  lr: 1.0e-3
train:
  max_steps: {STEPS}
  save_steps: {SAVE_EVERY}
  logging_steps: 1
  micro_batch_size: 8
"""


@pytest.fixture(scope="session")
def recipe(tmp_path_factory, worker_id) -> Path:
    """The recipe on the first ROWS rows of the demo set, once per session: read-only, as its data."""

    def make(folder: Path) -> dict:
        from qlora_kit.data import demo

        train_file, _ = demo.demo_data_files("demo-facts")
        rows = Path(train_file).read_text(encoding="utf-8").splitlines()[:ROWS]
        (folder / "train.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        (folder / "recipe.yaml").write_text(RECIPE)
        return {}

    folder, _ = once_per_session(tmp_path_factory, worker_id, "faults-recipe", make)
    return folder / "recipe.yaml"


@pytest.fixture(scope="session")
def reference_run(recipe, tmp_path_factory, worker_id) -> Path:
    """The output folder of a run that nobody interrupts, once per session across workers (the tests
    that compare with it run on any of them): the CLI in this process, as the resumes it is compared
    with bit for bit. Read-only: its checkpoints serve a resume elsewhere as copies."""

    def make(folder: Path) -> dict:
        monkeypatch = pytest.MonkeyPatch()
        try:
            argv = ["qlora-kit", "train", str(recipe), "--output-dir", str(folder / "out")]
            monkeypatch.setattr(sys, "argv", argv)
            with pytest.raises(SystemExit) as exit_info:
                cli_main()
        finally:
            monkeypatch.undo()
        assert exit_info.value.code == 0
        return {}

    folder, _ = once_per_session(tmp_path_factory, worker_id, "faults-reference", make)
    return folder / "out"


@pytest.fixture(scope="session")
def reference(reference_run):
    """The adapter the uninterrupted run wrote."""
    return load_file(reference_run / "adapter_model.safetensors")


def assert_same_adapter(out: Path, reference) -> None:
    got = load_file(out / "adapter_model.safetensors")
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in got)


def assert_only_complete_checkpoints(out: Path) -> list[int]:
    steps = []
    for folder in out.glob("checkpoint-*"):
        assert is_complete_checkpoint(folder), folder
        steps.append(int(folder.name.split("-")[1]))
    return sorted(steps)


# where each run is killed (tests/e2e/fault_driver.py) -> the checkpoints it leaves
KILLS = {
    "step:2": [],  # before the first checkpoint
    "save:6": [3],  # half-way through writing checkpoint-6: resumed from 3, across the epochs' seam
    "step:8": [3, 6],  # between checkpoints: resumed from 6, the first epoch's last step
    "final": [3, 6, 9, 12],  # half-way through moving the final adapter into place
}


@pytest.fixture(scope="session")
def killed_runs(recipe, tmp_path_factory, worker_id) -> dict[str, tuple[Path, int, str]]:
    """Every killed run of this module, once per session across workers: the four KILLS of the shared
    recipe and the mixture's at step 4, each a process of its own killed by a real SIGKILL, forked one
    after another by one driver process after its imports (fault_driver.py --cases: a process start is
    most of a short killed run's cost). ``where -> (output folder, exit code, its output)``; each test
    resumes its own folder, so each folder is one test's."""

    def make(folder: Path) -> dict:
        mixture = folder / "mixture"
        mixture.mkdir()
        from qlora_kit.data import demo

        train_file, _ = demo.demo_data_files("demo-facts")
        rows = Path(train_file).read_text(encoding="utf-8").splitlines()[:24]
        (mixture / "extra.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        (mixture / "mix.yaml").write_text(MIXTURE)
        kills = [(where, recipe) for where in KILLS] + [("mixture", mixture / "mix.yaml")]
        cases = [
            {
                "recipe": str(path), "output_dir": str(folder / f"kill-{i}" / "out"),
                "where": "step:4" if where == "mixture" else where, "log": str(folder / f"kill-{i}.log"),
            }
            for i, (where, path) in enumerate(kills)
        ]  # fmt: skip
        (folder / "cases.json").write_text(json.dumps(cases))
        driver = [sys.executable, "tests/e2e/fault_driver.py", "--cases", str(folder / "cases.json")]
        done = subprocess.run(driver, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        codes = json.loads(done.stdout.splitlines()[-1])
        return {
            where: [case["output_dir"], codes[case["output_dir"]], Path(case["log"]).read_text()[-2000:]]
            for (where, _), case in zip(kills, cases, strict=True)
        }

    _, found = once_per_session(tmp_path_factory, worker_id, "faults-killed", make)
    return {where: (Path(out), code, log) for where, (out, code, log) in found.items()}


@pytest.mark.parametrize(("where", "checkpoints_left"), KILLS.items())
def test_sigkill_anywhere_then_resume_gives_the_same_adapter(
    where, checkpoints_left, recipe, reference, killed_runs, qlora_kit_here
):
    out, code, log = killed_runs[where]
    assert code == -signal.SIGKILL, log
    assert not (out / "adapter_config.json").exists(), "a killed run never looks finished"
    assert assert_only_complete_checkpoints(out) == checkpoints_left
    resumed = qlora_kit_here("train", str(recipe), "--output-dir", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_adapter(out, reference)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s] == list(range(1, STEPS + 1)), "each step logged once, resume or not"
    assert not (out / ".staging").exists(), "a finished run leaves no staging folder"


def wait_for_step(out: Path, step: int, process, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and any(
            json.loads(line)["step"] >= step for line in metrics.read_text().splitlines() if line
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}")


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_says_how_to_resume(
    recipe, reference, tmp_path, qlora_kit_here
):
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "qlora_kit", "train", str(recipe), "--output-dir", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(out, 1, process)  # early: the stop must come before the run's last step
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert "stopped by SIGTERM after step" in last and "--resume" in last
    stopped_at = int(last.split("after step ")[1].split(";")[0])
    assert stopped_at < STEPS and stopped_at in assert_only_complete_checkpoints(out)
    resumed = qlora_kit_here("train", str(recipe), "--output-dir", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_adapter(out, reference)


def test_second_run_into_a_folder_in_use_refuses(recipe, tmp_path, qlora_kit_here):
    """While one run holds the folder (here: this test, through the same lock a run takes), another run
    refuses at once: the CLI in this process, whose lock is a file lock of its own on the same file, as
    another process's would be (it is refused before any work). That a killed run leaves no stuck lock,
    every resume above shows."""
    from qlora_kit.training.run_folder.outputs import exclusive

    out = tmp_path / "out"
    with exclusive(out):
        second = qlora_kit_here("train", str(recipe), "--output-dir", str(out))
    assert second.returncode == 2
    assert second.stderr.strip() == (
        f"error: train.output_dir: {out} is in use by another run; wait for it to end or choose another --output-dir"
    )
    assert not out.exists() or not any(out.iterdir()), "the refused run wrote nothing"


def test_unwritable_output_folder_is_one_line_before_any_work(recipe, tmp_path, monkeypatch, capsys):
    """In this process: the refusal is the CLI's, not a fresh process's (that a user mistake in a fresh
    process is one line on stderr, tests/e2e/test_cli.py shows)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, err = run_cli(["train", str(recipe), "--output-dir", str(blocker / "out")], monkeypatch, capsys)
    assert code == 2
    assert err.strip() == f"error: train.output_dir: {blocker} is a file, so {blocker / 'out'} cannot be made"


def test_full_disk_is_refused_by_train_before_training(recipe, tmp_path, monkeypatch, capsys):
    """The command, not the helper: `qlora-kit train` asks the disk before its first step. The disk's
    answer is the one thing faked (a full disk cannot be made here): a few MiB free under tmp_path."""
    real_usage = shutil.disk_usage

    def nearly_full(path):
        usage = real_usage(path)
        return usage._replace(free=3 * 2**20) if str(path).startswith(str(tmp_path)) else usage

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    out = tmp_path / "out"
    # one step: were the check skipped, the run would fail this test in seconds, not after 40 steps
    argv = ["qlora-kit", "train", str(recipe), "--output-dir", str(out), "--set", "train.max_steps=1"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        cli_main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"train.output_dir: 3 MiB free on the disk of {out}" in errors[0], err
    assert "Traceback" not in err
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("checkpoint-*")), "nothing trained"


def test_resume_reads_torch_files_only_with_weights_only(recipe, reference_run, tmp_path, monkeypatch):
    """Nothing is unpickled: every torch.load on resume passes weights_only=True. The resume starts from
    the uninterrupted run's first checkpoint (a copy of its folder as a stop there leaves it: the later
    checkpoints and the final adapter gone), every file a checkpoint holds read as a resume reads it."""
    from qlora_kit import Recipe, train

    out = tmp_path / "out"
    shutil.copytree(reference_run, out)
    for later in out.glob("checkpoint-*"):
        if int(later.name.split("-")[1]) > SAVE_EVERY:
            shutil.rmtree(later)
    for final in ("adapter_config.json", "adapter_model.safetensors"):
        (out / final).unlink()
    config = Recipe.from_yaml(recipe, overrides={"train.output_dir": str(out), "train.max_steps": 12})
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    train(config, resume=True)
    assert calls and all(flag is True for flag in calls)
    assert not list(out.rglob("*.bin")) or all(p.name == "training_args.bin" for p in out.rglob("*.bin"))


MIXTURE_STEPS = 6
MIXTURE = f"""
lora:
  dropout: 0.1
data:
  max_seq_len: 64
  packing: false
  sources:
    - path: builtin:demo-facts
      weight: 3
    - path: extra.jsonl
      weight: 1
optimizer:
  lr: 1.0e-3
train:
  max_steps: {MIXTURE_STEPS}
  save_steps: 3
  logging_steps: 1
  micro_batch_size: 4
"""


def test_a_mixture_run_killed_and_resumed_from_its_own_recipe_gives_the_same_adapter(
    killed_runs, tmp_path, qlora_kit_here
):
    """Issue 35: a recipe naming its data through data.sources only. `train mix.yaml --output-dir` used
    to be refused, and the run's recipe.yaml (data.path written beside the sources) could not --resume.
    The killed run (at step 4) is killed_runs' "mixture"; its recipe, mix.yaml, lies beside its folder."""
    out, code, log = killed_runs["mixture"]
    mix = out.parents[1] / "mixture" / "mix.yaml"
    reference_dir = tmp_path / "reference"
    uninterrupted = qlora_kit_here("train", str(mix), "--output-dir", str(reference_dir))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]

    assert code == -signal.SIGKILL, log
    assert assert_only_complete_checkpoints(out) == [3]
    # the run's own recipe, nothing else
    resumed = qlora_kit_here("train", str(out / "recipe.yaml"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_adapter(out, load_file(reference_dir / "adapter_model.safetensors"))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s] == list(range(1, MIXTURE_STEPS + 1))
