"""Can torch use this machine's NVIDIA GPU? The driver's version against the CUDA torch was built for.

torch's Linux wheels on PyPI are CUDA builds (torch 2.13: CUDA 13.0), and a CUDA build runs only on a
driver at least as new as NVIDIA's minimum for its CUDA major (minor version compatibility:
https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html). On an older driver
torch finds no usable GPU and says little; a run would fall back to the CPU. ``qlora-kit doctor``
reports both versions, and ``qlora-kit train`` stops with the same one line when ``nvidia-smi`` sees a
GPU that torch cannot use because of it.

The driver's version comes from ``nvidia-smi --query-gpu=driver_version --format=csv,noheader``.
``QLORA_KIT_NVIDIA_SMI`` names another command to ask (an nvidia-smi off PATH, or a test's stand-in),
and ``QLORA_KIT_TORCH_CUDA`` stands in for ``torch.version.cuda`` (so a CPU build of torch can test the
check; empty means a CPU build).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from importlib import metadata

# NVIDIA's minimum Linux driver for each CUDA major (the table in the page above).
MIN_DRIVER = {13: (580,), 12: (525, 60, 13), 11: (450, 80, 2)}
# PyTorch's own wheel index for a torch built for each CUDA major (the oldest minor it still publishes:
# any driver of that major runs it).
TORCH_INDEX = {13: "cu130", 12: "cu126", 11: "cu118"}
INDEX_URL = "https://download.pytorch.org/whl/{}"
QUERY = ["--query-gpu=driver_version", "--format=csv,noheader"]


@dataclass(frozen=True)
class DriverReport:
    driver: str | None
    """The NVIDIA driver's version ("535.104.05"), None when no driver answered."""
    no_driver: str
    """Why there is no driver version (nvidia-smi not found, or what it said); "" with one."""
    torch_cuda: str | None
    """The CUDA version torch was built for ("13.0"), None for a CPU build."""

    @property
    def needed(self) -> tuple[int, ...] | None:
        """The oldest driver torch's CUDA runs on (None: a CPU build, or a CUDA major not in the table)."""
        return MIN_DRIVER.get(int(self.torch_cuda.split(".")[0])) if self.torch_cuda else None

    @property
    def too_old(self) -> bool:
        return self.driver is not None and self.needed is not None and version(self.driver) < self.needed

    def problem(self) -> str | None:
        """One line when torch cannot use this driver's GPU, with the ways out; None otherwise."""
        if self.driver is None or not (self.too_old or self.torch_cuda is None):
            return None
        runs = driver_cuda(self.driver)
        build = (
            f"pip install --force-reinstall torch --index-url {INDEX_URL.format(TORCH_INDEX[runs])}"
            if runs is not None
            else "none of PyTorch's CUDA builds runs on this driver: install a newer one"
        )
        if self.torch_cuda is None:
            return (
                f"torch {torch_version()} is a CPU build and cannot use the NVIDIA GPU; a CUDA build: {build}"
            )
        head = (
            f"NVIDIA driver {self.driver} is too old for torch {torch_version()}, built for CUDA "
            f"{self.torch_cuda} (needs driver >= {'.'.join(map(str, self.needed))})"
        )
        if runs is None:
            return f"{head}: install a newer NVIDIA driver (no PyTorch build runs on this one)"
        return f"{head}: install a newer NVIDIA driver, or a torch built for CUDA {runs}: {build}"

    def summary(self) -> str:
        """Both versions, for doctor's row."""
        built = f"torch built for CUDA {self.torch_cuda}" if self.torch_cuda else "torch is a CPU build"
        if self.driver is None:
            return f"no NVIDIA driver ({self.no_driver}); {built}"
        runs = driver_cuda(self.driver)
        limit = f" (runs CUDA {runs}.x and older)" if runs else ""
        return f"NVIDIA driver {self.driver}{limit}; {built}"


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def driver_cuda(driver: str) -> int | None:
    """The newest CUDA major this driver runs, None when it is older than every one in the table."""
    return next((major for major, least in MIN_DRIVER.items() if version(driver) >= least), None)


def torch_version() -> str:
    return metadata.version("torch")


def torch_cuda() -> str | None:
    """The CUDA version torch was built for (None: a CPU build); QLORA_KIT_TORCH_CUDA overrides it."""
    if "QLORA_KIT_TORCH_CUDA" in os.environ:
        return os.environ["QLORA_KIT_TORCH_CUDA"] or None
    import torch

    return torch.version.cuda


def driver_version() -> tuple[str | None, str]:
    """(the first GPU's driver version, "") from nvidia-smi, or (None, why there is none)."""
    command = shlex.split(os.environ.get("QLORA_KIT_NVIDIA_SMI", "nvidia-smi")) + QUERY
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return None, f"{command[0]} not found"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{command[0]} failed: {exc}"
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    first = lines[0] if lines else f"exit code {result.returncode}, no output"
    if result.returncode != 0 or not re.fullmatch(r"\d+(\.\d+)*", first):
        return None, f"{command[0]} said: {first[:200]}"
    return first, ""


def report() -> DriverReport:
    driver, why = driver_version()
    return DriverReport(driver, why, torch_cuda())


def unusable_gpu() -> str | None:
    """The one line ``train`` stops with: torch cannot use a GPU that nvidia-smi sees, because the driver
    is too old for torch's CUDA. None on a working GPU, without an NVIDIA GPU, or when the GPUs are
    hidden on purpose (``CUDA_VISIBLE_DEVICES=``: train on the CPU)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    found = report()
    if not found.too_old:
        return None
    return f"{found.problem()} (or CUDA_VISIBLE_DEVICES= to train on the CPU)"
