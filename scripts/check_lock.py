"""Compare installed packages (``pip list --format=freeze``) with a lock file.

    python scripts/check_lock.py docker/requirements-cpu.lock installed.txt          # the image: exact
    python scripts/check_lock.py --drift docker/requirements-cpu.lock installed.txt  # CI: what is newer
    python scripts/check_lock.py --floors .ci/floors.txt installed.txt                # CI: the floors' venv

Without ``--drift``: the same names, the same versions, nothing more, nothing less (the project itself
and pip aside); exit 1 otherwise. The image build checks its environment so (scripts/build_image.sh).

With ``--drift``: the lock's packages whose installed version differs, each on a line, and exit 0. CI's
suite runs on the newest releases pyproject.toml allows, as a user's ``pip install -e .`` gets them, so
this line in its log names each release that came out since the lock was written, beside the suite's
verdict on it; ``UPGRADE=1 bash scripts/lock.sh`` moves the lock (and the image) to them.

With ``--floors``: each pin of the constraints file installed at exactly its version (other packages
may be there too); exit 1 otherwise. CI's log so names the releases its floor stage ran on.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)")
IGNORED = {"pip", "qlora-kit"}


def pins(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        match = PIN.match(line.strip())
        if match:
            found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return {name: version for name, version in found.items() if name not in IGNORED}


def drift(lock: dict[str, str], installed: dict[str, str]) -> list[str]:
    """The lock's packages installed at another version (or not at all), one line each."""
    return [
        f"{name}: locked {version}, installed {installed.get(name, 'nothing')}"
        for name, version in sorted(lock.items())
        if installed.get(name) != version
    ]


def main(argv: list[str]) -> int:
    drift_only = argv[:1] == ["--drift"]
    floors_only = argv[:1] == ["--floors"]
    lock_file, installed_file = argv[1:3] if drift_only or floors_only else argv[:2]
    lock, installed = (pins(Path(arg).read_text()) for arg in (lock_file, installed_file))
    if floors_only:
        lines = drift(lock, installed)
        for line in lines:
            print(f"  {line}", file=sys.stderr)
        floors = ", ".join(f"{name} {version}" for name, version in lock.items())
        print(f"{'the floors' if not lines else 'NOT the floors'} ({lock_file}): {floors}")
        return 1 if lines else 0
    if drift_only:
        lines = drift(lock, installed)
        for line in lines:
            print(f"  {line}")
        print(
            f"{len(lines)} of {lock_file}'s {len(lock)} packages differ from this environment"
            + (" (UPGRADE=1 bash scripts/lock.sh moves the lock to them)" if lines else "")
        )
        return 0
    problems = [
        f"{n}: locked {lock.get(n)}, installed {installed.get(n)}"
        for n in sorted(set(lock) | set(installed))
        if lock.get(n) != installed.get(n)
    ]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(installed)} installed packages {'match' if not problems else 'DO NOT match'} {lock_file}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
