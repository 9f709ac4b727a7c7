"""The NVIDIA driver against the CUDA torch was built for, on the CPU: the driver's version comes from a
stand-in nvidia-smi (a real script, run as nvidia-smi is), torch's CUDA from QLORA_KIT_TORCH_CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlora_kit.cli.doctor import _driver
from qlora_kit.model import driver

from .conftest import run_cli

NEW_ENOUGH = "580.95.05"  # an R580 driver: runs CUDA 13.x
TOO_OLD = "535.104.05"  # an R535 driver, common on cloud images: runs CUDA 12.x only
CUDA_12_BUILD = "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu126"


def fake_smi(folder: Path, output: str, code: int = 0) -> Path:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{output}'\nexit {code}\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A machine with one GPU on the given driver, and torch built for CUDA 13.0 (PyPI's torch 2.13)."""

    def make(driver_version: str, torch_cuda: str = "13.0") -> None:
        smi = fake_smi(tmp_path, f"{driver_version}\\n{driver_version}\\n")  # two GPUs: one line each
        monkeypatch.setenv("QLORA_KIT_NVIDIA_SMI", str(smi))
        monkeypatch.setenv("QLORA_KIT_TORCH_CUDA", torch_cuda)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return make


def test_a_new_enough_driver_passes_and_doctor_shows_both_versions(machine):
    machine(NEW_ENOUGH)
    found = driver.report()
    assert (found.driver, found.torch_cuda, found.too_old) == (NEW_ENOUGH, "13.0", False)
    check = _driver()
    assert check.ok
    assert check.detail == f"NVIDIA driver {NEW_ENOUGH} (runs CUDA 13.x and older); torch built for CUDA 13.0"
    assert driver.unusable_gpu() is None


def test_a_too_old_driver_fails_in_one_line_with_both_ways_out(machine):
    machine(TOO_OLD)
    check = _driver()
    assert not check.ok
    assert "\n" not in check.detail
    assert check.detail.startswith(f"NVIDIA driver {TOO_OLD} is too old for torch ")
    assert "built for CUDA 13.0 (needs driver >= 580)" in check.detail
    assert "install a newer NVIDIA driver, or a torch built for CUDA 12: " + CUDA_12_BUILD in check.detail
    # the same line stops train, which also says how to train on the CPU on purpose
    assert driver.unusable_gpu() == f"{check.detail} (or CUDA_VISIBLE_DEVICES= to train on the CPU)"


@pytest.mark.parametrize(
    ("driver_version", "torch_cuda", "too_old", "way_out"),
    [
        ("525.60.13", "12.8", False, None),  # the oldest driver any CUDA 12 build runs on
        ("525.60.12", "12.1", True, "whl/cu118"),
        ("579.99", "13.0", True, "whl/cu126"),
        ("450.80.01", "12.1", True, "no PyTorch build runs on this one"),
        ("470.256.02", "11.8", False, None),
    ],
)
def test_the_minimum_driver_per_cuda_major(machine, driver_version, torch_cuda, too_old, way_out):
    machine(driver_version, torch_cuda)
    found = driver.report()
    assert found.too_old is too_old
    assert (found.problem() is None) is (not too_old)
    if way_out:
        assert way_out in found.problem()


def test_no_driver_or_a_failing_nvidia_smi_is_no_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("QLORA_KIT_TORCH_CUDA", "13.0")
    monkeypatch.setenv("QLORA_KIT_NVIDIA_SMI", str(tmp_path / "nowhere" / "nvidia-smi"))
    check = _driver()
    assert check.ok
    assert check.detail.startswith("no NVIDIA driver (") and "nvidia-smi not found" in check.detail
    failing = fake_smi(
        tmp_path, "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.", 9
    )
    monkeypatch.setenv("QLORA_KIT_NVIDIA_SMI", str(failing))
    found = driver.report()
    assert found.driver is None and "could not communicate with the NVIDIA driver" in found.no_driver
    assert found.problem() is None and driver.unusable_gpu() is None


def test_a_cpu_build_of_torch_on_a_gpu_machine_says_which_build_to_install(machine):
    machine(NEW_ENOUGH, torch_cuda="")
    check = _driver()
    assert not check.ok
    assert "is a CPU build and cannot use the NVIDIA GPU" in check.detail
    assert "--index-url https://download.pytorch.org/whl/cu130" in check.detail
    assert driver.unusable_gpu() is None  # train refuses only a driver too old for torch's CUDA


def test_train_stops_before_any_work_on_a_too_old_driver(machine, tmp_path, monkeypatch, capsys):
    machine(TOO_OLD)
    out = tmp_path / "run"
    argv = ["train", "demo", "--output-dir", str(out), "--set", "train.max_steps=1"]  # short if not stopped
    code, err = run_cli(argv, monkeypatch, capsys)
    assert code == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"training stopped: NVIDIA driver {TOO_OLD} is too old")
    assert CUDA_12_BUILD in lines[0]
    assert not out.exists()
    # GPUs hidden on purpose: the run goes ahead on the CPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert driver.unusable_gpu() is None


@pytest.mark.slow
def test_train_goes_ahead_on_a_new_enough_driver(machine, tmp_path, monkeypatch, capsys):
    machine(NEW_ENOUGH)
    out = tmp_path / "run"
    argv = ["train", "demo", "--output-dir", str(out), "--set", "train.max_steps=2"]
    argv += ["--set", "train.eval_steps=null", "--set", "train.sample_prompts=0", "--quiet"]
    code, err = run_cli(argv, monkeypatch, capsys)
    assert code == 0, err
    assert (out / "adapter_model.safetensors").is_file()
