"""Compare installed packages (``pip list --format=freeze``) with a lock file: the same names, the same
versions, nothing more, nothing less (the project itself and pip aside).

    python scripts/check_lock.py docker/requirements-cpu.lock installed.txt
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


def main() -> int:
    lock, installed = (pins(Path(arg).read_text()) for arg in sys.argv[1:3])
    problems = [
        f"{n}: locked {lock.get(n)}, installed {installed.get(n)}"
        for n in sorted(set(lock) | set(installed))
        if lock.get(n) != installed.get(n)
    ]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(installed)} installed packages {'match' if not problems else 'DO NOT match'} {sys.argv[1]}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
