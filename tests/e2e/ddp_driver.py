"""One rank of a torchrun launch that runs several qlora-kit command lines in turn, so a group of
multi-process cases pays for the launcher and each rank's imports (torch, transformers, peft: ~7 s of
CPU a process) once:

    torchrun --nproc_per_node 2 tests/e2e/ddp_driver.py LOGS '{"case name": {"argv": ["train", "..."],
        "env": {"NAME": "value"}}, ...}' [--faults]

Each case is the real ``qlora_kit.cli.app.run_command`` with its own ``sys.argv`` and its environment
variables set for it alone (``--faults``: with the tests' faults installed, as ``python -m
qlora_kit.testing`` runs; they read their caps from the environment as each run is built), in the process group
the first case joined (``cli.main`` leaves it after a command; here it is left once, after the last
case). Each rank's output of a case (its file descriptors 1 and 2, so C++ and Python lines alike) goes
to ``LOGS/NAME.rankR.log``, and its exit code to ``LOGS/NAME.rankR.exit``. A case that fails ends the
rank with its exit code (the other rank may be waiting in one of its collectives; torchrun then stops
it): the later cases do not run, and their tests say so.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from qlora_kit.cli import app as cli
from qlora_kit.training.distributed import leave_process_group


def run_case(argv: list[str], log: Path) -> int | str:
    """``qlora-kit ARGV`` with this process's stdout and stderr written to ``log``: its exit code."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with log.open("w") as file:
        os.dup2(file.fileno(), 1), os.dup2(file.fileno(), 2)
        sys.argv = ["qlora-kit", *argv]
        try:
            cli.run_command()
            code = 0
        except SystemExit as exc:
            code = exc.code if exc.code is not None else 0
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    return code


def main() -> None:
    logs, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    if "--faults" in sys.argv[3:]:
        from qlora_kit.testing import faults

        faults.install()
    rank = os.environ["RANK"]
    try:
        for name, case in cases.items():
            before = dict(os.environ)
            os.environ.update(case.get("env", {}))
            code = run_case(case["argv"], logs / f"{name}.rank{rank}.log")
            os.environ.clear(), os.environ.update(before)
            (logs / f"{name}.rank{rank}.exit").write_text(str(code))
            if code != 0:
                sys.exit(code if isinstance(code, int) else 1)
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
