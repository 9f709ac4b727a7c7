"""Run several benchmark scripts at ``--smoke`` size in this one process, one after another, as
``python benchmarks/SCRIPT --smoke --out OUT/SCRIPT`` would (tests/e2e/test_benchmarks.py): a process
start (torch, transformers, peft, bitsandbytes: ~7 s on 2 cores) is paid once, not once a script.

    python -m tests.benchmark_smoke OUT SCRIPT...

Each script runs as ``__main__`` with its own ``sys.argv`` and ``benchmarks/`` first on ``sys.path``, as
from the shell; the environment is put back after each (oom_recovery.py sets its fault variable).
OUT/SCRIPT/status.json holds its exit code, its wall and CPU seconds and, on failure, the traceback's tail."""

from __future__ import annotations

import gc
import json
import os
import resource
import runpy
import sys
import time
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(script: str, out: Path, *options: str) -> dict:
    argv, environ, path = sys.argv, dict(os.environ), list(sys.path)
    sys.argv = [f"benchmarks/{script}", "--smoke", "--out", str(out), *options]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
        return {"exit": 0}
    except SystemExit as stop:  # argparse's or the script's own sys.exit
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return {"exit": code, "error": "" if code == 0 else str(stop.code)[-3000:]}
    except Exception:  # the next script still runs; the test reports this one
        return {"exit": 1, "error": traceback.format_exc()[-3000:]}
    finally:
        sys.argv, sys.path[:] = argv, path
        os.environ.clear()
        os.environ.update(environ)
        gc.collect()


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its waited-for children (families_matrix's forks,
    vs_trl's runs): on shared cores a script's wall seconds count the waits for a core too."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    out, scripts = Path(sys.argv[1]), sys.argv[2:]
    for script in scripts:
        folder = out / script
        folder.mkdir(parents=True, exist_ok=True)
        started, cpu_started = time.monotonic(), cpu_seconds()
        status = run_script(script, folder)
        status["seconds"] = round(time.monotonic() - started, 1)  # what each script costs the suite
        status["cpu_seconds"] = round(cpu_seconds() - cpu_started, 1)
        (folder / "status.json").write_text(json.dumps(status))
        print(
            f"{script}: exit {status['exit']} ({status['seconds']} s, {status['cpu_seconds']} s of CPU)",
            flush=True,
        )


if __name__ == "__main__":
    main()
