"""Installed, not cloned: the built wheel in a fresh virtual environment, used from an empty folder.

The wheel is built from a copy of the checkout's package files (what `docker build` and an sdist see),
installed with --no-deps into a new venv, and run with no PYTHONPATH from a folder holding nothing:
only what the wheel itself contains can answer. The dependencies are not what is tested; they are
lent from the running environment by a .pth line (after the venv's own site-packages, so the wheel's
qlora_kit is the one imported), which keeps the test offline and fast.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a build, a venv and a short training run: the full suite runs it

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--set", "train.max_steps=2", "--set", "train.eval_steps=null", "--set", "train.sample_prompts=0"]


def run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from the package's files (copied: the build writes into its source)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("qlora_kit", "recipes"):  # symlinks=True: qlora_kit/recipes stays the link it is in git
        shutil.copytree(
            ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    dist = tmp_path_factory.mktemp("dist")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source, cwd=source)
    (found,) = dist.glob("qlora_kit-*.whl")
    return found


def test_the_wheel_holds_every_shipped_recipe(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "recipes").rglob("*.yaml"))]
    assert shipped and "recipes/accelerate/fsdp-qlora.yaml" in shipped
    for path in shipped:
        assert f"qlora_kit/{path}" in names, path


def test_installed_wheel_lists_copies_and_trains_the_demo(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python, cli = venv / "bin" / "python", venv / "bin" / "qlora-kit"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python]
    run(*pip, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp_path)
    own = Path(
        run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
        ).stdout.strip()
    )
    (own / "lent-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONWARNINGS": "ignore"}

    found = run(python, "-c", "import qlora_kit; print(qlora_kit.__file__)", cwd=empty, env=env).stdout
    assert Path(found.strip()).is_relative_to(own), found  # the wheel's copy, not the checkout's

    listing = run(cli, "recipes", cwd=empty, env=env).stdout
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        assert any(line.startswith(f"{path.stem} ") for line in listing.splitlines()), path.stem
    assert "accelerate/fsdp-qlora" in listing

    copied = run(cli, "recipes", "copy", "demo", cwd=empty, env=env)
    assert (empty / "demo.yaml").read_text() == (ROOT / "recipes" / "demo.yaml").read_text(), copied.stdout

    # by its shipped name: the recipe read from inside the installed wheel, not from the copy beside it
    (empty / "demo.yaml").unlink()
    trained = run(cli, "train", "demo", *SHORT, "--output-dir", "out", cwd=empty, env=env)
    assert (empty / "out" / "adapter_model.safetensors").is_file(), trained.stdout
    assert "adapter written to" in trained.stdout
