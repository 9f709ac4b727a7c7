"""Shared fixtures: a private model cache, a quick recipe on the tiny model, one trained run reused by tests."""

from __future__ import annotations

import atexit
import getpass
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker, and per process a test starts: torch's OpenMP threads spin while they wait,
    # so workers sharing the cores with several threads each slow each other down many times over.
    os.environ["OMP_NUM_THREADS"] = "1"
    # inductor compiles in this process, not in a pool of its own: each worker's pool imports torch again
    # for cores the other worker holds (a cold-cache tests/e2e/test_compile.py: 87 -> 67 s of CPU)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The suite's results must not depend on the shell's hub settings (issue 47: HF_HUB_OFFLINE=1 turned a
# test red): huggingface_hub and datasets read them once, at import, so they go before anything imports
# those. A test of offline mode sets it for the process it starts (tests/e2e/test_hub.py).
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
    os.environ.pop(_name, None)
# Before datasets is imported anywhere: its cache folder is read once, at import. The process that makes
# it removes it when it exits (the workers and the processes tests start inherit the variable; each run
# left one or more folders of arrow files in /tmp before).
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="qlora-kit-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)


def inductor_cache_for(environ) -> str | None:
    """The inductor cache folder a suite run with torch's kernels held to one ISA must use, or None to
    keep torch's own. torch 2.13's FX graph cache keys leave out the vector ISA that ATEN_CPU_CAPABILITY
    picks: a cache written by a run held to avx2 and read by one that is not served AVX2-shaped code
    compiled with AVX-512 flags, which crashed the compile tests' workers and let flex attention's packed
    rows attend to each other (CI at stop 88, after an AVX2 run on the same machine; reproduced here)."""
    capability = environ.get("ATEN_CPU_CAPABILITY")
    if not capability or "TORCHINDUCTOR_CACHE_DIR" in environ:
        return None
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{capability}")


if _isa_cache := inductor_cache_for(os.environ):  # inductor reads it at each compile, not at import
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _isa_cache
DEMO = ROOT / "recipes" / "demo.yaml"


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory, worker_id) -> Path:
    """Build tiny models into a folder of the test session, never the user's cache: one folder for all
    of the session's xdist workers, so each builtin (the real model's 18 s conversion too) is built once,
    not once a worker. Builds are renamed into place whole and the real model's download is locked
    (builtin.build_into, pretrained._gguf_file), as for two runs sharing a user's cache."""
    if worker_id == "master":
        folder = tmp_path_factory.mktemp("qlora-kit-cache")
    else:  # the base temp folder's parent is this session's, shared by its workers only
        folder = tmp_path_factory.getbasetemp().parent / "qlora-kit-cache"
        folder.mkdir(exist_ok=True)
    os.environ["QLORA_KIT_CACHE"] = str(folder)
    return folder


@pytest.fixture(autouse=True)
def fast_tier_trains_nothing(request, monkeypatch):
    """`pytest -m "not slow"` is the inner loop: a test outside the slow tier that reaches the Trainer's
    training loop fails at once, saying so (building a run, refusals before training and forward passes
    are fine)."""
    if request.node.get_closest_marker("slow"):
        return
    from transformers import Trainer

    def refuse(self, *args, **kwargs):
        raise AssertionError("this test trains: mark it @pytest.mark.slow (the fast tier trains nothing)")

    monkeypatch.setattr(Trainer, "train", refuse)


def quick_recipe(output_dir: Path, **overrides):
    """The demo recipe cut down to a few steps (the test decides how many), its rows packed: what
    data.packing auto picks on the demo set (tests/test_layout.py proves the pick and the shell runs of
    tests/e2e time it), without timing the layouts again in each test (seconds each, more under bf16)."""
    from qlora_kit import Recipe

    values = {
        "train.output_dir": str(output_dir),
        "train.sample_prompts": 0,
        "train.eval_steps": None,
        "data.packing": True,
    }
    values.update(overrides)
    return Recipe.from_yaml(DEMO, overrides=gpu_compute_under_bf16(values))


def gpu_compute_under_bf16(overrides: dict) -> dict:
    """A test that asks for bf16 autocast and names no compute dtype gets bfloat16 compute under it, the
    GPU's pairing: the demo recipes compute in float32 for the CPU (README, Notes on the CPU)."""
    if overrides.get("train.mixed_precision") == "bf16":
        overrides.setdefault("quant.compute_dtype", "bfloat16")
    return overrides


# The Trainer's two code paths: no autocast (the CPU's default), and bf16 autocast with fp32 output
# conversion through accelerate (every bf16 GPU's default), which the CPU runs too.
PRECISIONS = ["no", "bf16"]


@pytest.fixture(scope="session", params=PRECISIONS)
def trained_run(request, tmp_path_factory):
    """One short real training run (30 steps on the tiny Llama) per precision, shared by read-only tests
    (a test that writes into a run copies it into its own tmp_path first). ``autocast``: what the training
    forward ran under (probes.AutocastProbe), so the precision is proven where it acts."""
    from qlora_kit import train

    from .probes import AutocastProbe

    out = tmp_path_factory.mktemp(f"run-{request.param}") / "out"
    settings = {"train.max_steps": 30, "train.logging_steps": 5, "train.mixed_precision": request.param}
    probe = AutocastProbe()
    result = train(quick_recipe(out, **settings), callbacks=[probe])
    result.autocast = probe.seen
    return result


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, worker_id) -> Path:
    """The folder of a small finished run (4 steps, no autocast), once per session across workers: for
    tests that need a run's files, not a falling loss or both precisions. Read-only: copy_run first."""

    def make(folder: Path) -> dict:
        from qlora_kit import train

        train(quick_recipe(folder / "out", **{"train.max_steps": 4, "train.logging_steps": 2}))
        return {}

    folder, _ = once_per_session(tmp_path_factory, worker_id, "finished-run", make)
    return folder / "out"


@pytest.fixture(scope="session")
def tokenizer():
    """The builtin tiny model's tokenizer (a byte-level BPE trained on the demo data, with a chat template)."""
    from qlora_kit import Recipe
    from qlora_kit.model import loading as model

    return model.load_tokenizer(Recipe().model)


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    """A private copy of a shared run's folder, for a test that writes into it (or might, if broken):
    the session's runs are read by other tests, in any order, on any worker."""
    return Path(shutil.copytree(run_dir, tmp_path / "run-copy"))


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a JSON-lines file at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def lora_model(compute_dtype: str = "bfloat16", targets="all-linear"):
    """The tiny 4-bit model with LoRA, in training mode, B drawn non-zero so every LoRA matrix gets a
    gradient from the first step (peft starts B at zero)."""
    import torch

    from qlora_kit import Recipe
    from qlora_kit.model import adapters
    from qlora_kit.model import loading as model

    recipe = Recipe.from_dict(
        {"quant": {"compute_dtype": compute_dtype}, "lora": {"dropout": 0.0, "target_modules": targets}}
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    torch.manual_seed(0)
    peft_model = adapters.attach_lora(base, recipe.lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return peft_model.train()


def once_per_session(tmp_path_factory, worker_id: str, name: str, make):
    """``make(folder)`` (returning JSON) once per test session, even across xdist workers: the first
    worker to ask builds it under a file lock in the session's base temp folder, the others wait for it
    and read its result (pytest-xdist's "making session-scoped fixtures execute only once").
    Returns (folder, result)."""
    if worker_id == "master":  # no xdist: this process is the session
        folder = tmp_path_factory.mktemp(name)
        return folder, make(folder)
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # shared by this session's workers, and only by them
    folder, done = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            if folder.exists():  # a worker failed building it: start again
                shutil.rmtree(folder)
            folder.mkdir()
            done.write_text(json.dumps(make(folder)))
    return folder, json.loads(done.read_text())


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, worker_id):
    """The README's first command, once per session (whichever worker asks first runs it; about two
    minutes): the full demo recipe through the real CLI. Tests read the folder, never write into it."""
    import subprocess
    import sys

    def run_demo(folder: Path) -> dict:
        result = subprocess.run(
            [sys.executable, "-m", "qlora_kit", "train", str(DEMO), "--output-dir", str(folder / "out")],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return {"args": result.args, "stdout": result.stdout, "stderr": result.stderr}

    folder, done = once_per_session(tmp_path_factory, worker_id, "demo", run_demo)
    return folder / "out", subprocess.CompletedProcess(done["args"], 0, done["stdout"], done["stderr"])


@pytest.fixture(scope="session", autouse=True)
def faults_installed():
    """The fault injectors' caps (qlora_kit/testing/) in force through the run's one fault seam
    (memory/fault_seam.py): each inert until a test sets its environment variable."""
    from qlora_kit.testing import faults

    faults.install()


@pytest.fixture(autouse=True)
def log_streams_open():
    """Every test starts with no log handler on a closed stream (rebind_closed_log_streams)."""
    rebind_closed_log_streams()


@pytest.fixture(autouse=True)
def autocast_left_as_found():
    """A test that leaves torch's autocast changed fails itself, not the next test its worker runs: left on,
    autocast's cache of casts is never emptied, and a later run in the process trains on LoRA weights as
    they were cast then (CI, 2026-12-05: a GRPO test's failed probe, then an unrelated test's run whose
    every LoRA A got no gradient). training/step/oom/autocast_state.py's autocast_kept is the fix."""
    from qlora_kit.training.step.oom.autocast_state import AutocastState

    before = AutocastState.now()
    yield
    after = AutocastState.now()
    if after != before:
        before.restore()  # so only this test fails
        pytest.fail(f"this test left torch's autocast as {after}, not as it found it ({before})")


def rebind_closed_log_streams() -> None:
    """Point every log handler whose stream is closed at this test's stderr. A library's handler (as
    transformers' own) binds the sys.stderr of the moment it is made: made inside an earlier in-process
    test, that is pytest's capture, closed since, and the next record logged there prints a "Logging
    error" traceback into this test's stderr."""
    import logging
    import sys

    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and getattr(stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed stream first


def run_cli_output(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``qlora-kit ARGV`` in this process (the real typer app): its exit code, stdout and stderr."""
    import sys

    from qlora_kit.cli import app as cli

    monkeypatch.setattr(sys, "argv", ["qlora-kit", *argv])
    rebind_closed_log_streams()
    capsys.readouterr()  # what ran before the command (a fixture's training run, say) is not its output
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.fixture
def qlora_kit_here(monkeypatch, capsys):
    """``qlora-kit ARGS`` in this process, as a CompletedProcess (the shape of the tests' subprocess
    helpers): for the commands a test runs on a run it trained from the shell (eval, generate, show,
    merge), where starting a process (torch, transformers, peft: ~7 s on 2 cores) is most of their cost."""
    import subprocess

    def run(*args) -> subprocess.CompletedProcess:
        code, out, err = run_cli_output([str(a) for a in args], monkeypatch, capsys)
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``qlora-kit ARGV`` in this process: its exit code and stderr (where its one-line errors go)."""
    code, _, err = run_cli_output(argv, monkeypatch, capsys)
    return code, err
