"""The lock files and pyproject.toml agree, so the image installs what the project declares.

The lock is the image's: scripts/build_image.sh installs it with hashes and checks the image holds
exactly its versions. The suite itself runs on whatever the README's command installs (the newest
releases pyproject.toml allows, as a user gets them), so no test here asserts this environment's
versions; CI prints their drift from the lock (scripts/check_lock.py --drift)."""

import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = [ROOT / "docker" / "requirements.lock", ROOT / "docker" / "requirements-cpu.lock"]
CUDA_ONLY = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
sys.path.insert(0, str(ROOT / "scripts"))
from check_lock import pins  # noqa: E402


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(line) for line in project["dependencies"]]


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_declared_dependency_is_locked_within_its_range(lock):
    locked = pins(lock.read_text())
    for requirement in declared():
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in locked, f"{lock.name} lacks {name}"
        assert requirement.specifier.contains(Version(locked[name]), prereleases=True), (name, locked[name])


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_pin_carries_a_hash(lock):
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text())
    for entry in entries:
        if PIN_LINE.match(entry):
            assert "--hash=sha256:" in entry, entry.splitlines()[0]


PIN_LINE = re.compile(r"^[A-Za-z0-9_.\-]+==")


def test_cpu_and_gpu_locks_pin_the_same_versions_but_for_torch_and_cuda():
    gpu, cpu = (pins(lock.read_text()) for lock in LOCKS)
    assert gpu["torch"] == cpu["torch"].split("+")[0]
    shared = {name for name in gpu if not CUDA_ONLY.match(name)} - {"torch"}
    assert shared == set(cpu) - {"torch"}
    assert all(gpu[name] == cpu[name] for name in shared)


def test_the_images_cuda_12_variant_keeps_every_pin_but_torch_and_its_cuda_packages(tmp_path):
    """Dockerfile's TORCH_INDEX_URL branch filters the GPU lock with awk before a --require-hashes
    install: what it keeps must be every other entry whole (name line, hashes and all), nothing of
    torch's CUDA, so torch from the other index brings its own CUDA packages."""
    import subprocess

    dockerfile = (ROOT / "Dockerfile").read_text()
    program = re.search(r"awk '([^']+)' /tmp/requirements.lock", dockerfile).group(1)
    kept = subprocess.run(["awk", program, str(LOCKS[0])], capture_output=True, text=True, check=True).stdout
    gpu, cpu = (pins(lock.read_text()) for lock in LOCKS)
    assert pins(kept) == {name: version for name, version in cpu.items() if name != "torch"}
    entries = dict(
        (PIN_LINE.match(entry).group(0)[:-2].lower(), entry)
        for entry in re.split(r"\n(?=[A-Za-z0-9])", LOCKS[0].read_text())
        if PIN_LINE.match(entry)
    )
    for entry in re.split(r"\n(?=[A-Za-z0-9])", kept):
        if PIN_LINE.match(entry):
            assert entry.rstrip("\n") == entries[PIN_LINE.match(entry).group(0)[:-2].lower()].rstrip("\n")
    # the version the branch installs from the other index is the lock's
    line = re.search(r"grep -o '([^']+)' /tmp/requirements.lock", dockerfile).group(1)
    assert re.search(line, LOCKS[0].read_text(), re.MULTILINE).group(0) == f"torch=={gpu['torch']}"


def test_the_drift_names_each_locked_package_installed_at_another_version():
    from check_lock import drift

    lock = {"accelerate": "1.15.0", "torch": "2.13.0+cpu", "peft": "0.21.2"}
    installed = {"accelerate": "1.16.0", "torch": "2.13.0+cpu", "pytest": "9.2.0"}
    assert drift(lock, installed) == [
        "accelerate: locked 1.15.0, installed 1.16.0",
        "peft: locked 0.21.2, installed nothing",
    ]


FLOORS = ROOT / ".ci" / "floors.txt"


def lower_bound(requirement: Requirement) -> Version:
    """The release a ``>=`` bound names: the floor .ci/run installs."""
    bounds = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    assert len(bounds) == 1, (
        f"{requirement.name}: needs one >= bound, so CI knows its floor (got {requirement})"
    )
    return bounds[0]


def test_the_floors_ci_installs_are_each_dependencys_lower_bound():
    """.ci/floors.txt pins every declared dependency at its >= bound, and nothing else: a floor raised or
    added in pyproject.toml without the constraints file (or the reverse) is red here, not untested."""
    floors = {name: Version(version) for name, version in pins(FLOORS.read_text()).items()}
    expected = {re.sub(r"[-_.]+", "-", req.name).lower(): lower_bound(req) for req in declared()}
    assert floors == expected


def test_the_floor_check_fails_when_a_floor_is_installed_at_another_version(tmp_path, capsys):
    from check_lock import main

    (tmp_path / "floors.txt").write_text("# floors\ntorch==2.6.0\ntyper==0.27.0\n")
    (tmp_path / "exact.txt").write_text("torch==2.6.0\ntyper==0.27.0\npytest==9.2.0\n")
    (tmp_path / "newer.txt").write_text("torch==2.6.0\ntyper==0.29.2\n")
    floors = str(tmp_path / "floors.txt")
    assert main(["--floors", floors, str(tmp_path / "exact.txt")]) == 0
    assert main(["--floors", floors, str(tmp_path / "newer.txt")]) == 1
    assert "typer: locked 0.27.0, installed 0.29.2" in capsys.readouterr().err
