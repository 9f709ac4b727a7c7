"""The suite's time, test by test: run it (or read a JUnit XML file of a run) and write the table.

    python scripts/suite_durations.py                       # the README's test command, then the table
    python scripts/suite_durations.py --junit run.xml       # the table of a run made earlier
    python scripts/suite_durations.py -- -m "not slow"      # pytest's own arguments after --

The table (tests/DURATIONS.md) lists every test over a second with its seconds (call, setup and teardown:
a session fixture's build is charged to the first test that asks for it), its tier and what it proves
(its docstring's first sentence, else its name), the files' totals, and the run's wall time against the
budget: 20 minutes for the whole suite on 2 cores, 60 seconds for the fast tier. A new slow test earns
its seconds by proving what no cheaper test can (README: Contributing).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "DURATIONS.md"
BUDGET_S = {"suite": 1200, "fast tier": 60}
SHOWN_OVER_S = 1.0


def run_suite(pytest_args: list[str], junit: Path) -> float:
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}", *pytest_args]
    subprocess.run(command, cwd=ROOT, check=False)
    return time.monotonic() - started


def what_it_proves(path: Path, name: str, cache: dict) -> tuple[str, bool]:
    """(the test function's docstring's first sentence or its name, whether it is marked slow)."""
    if path not in cache:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_slow = "pytest.mark.slow" in path.read_text(encoding="utf-8").split("\ndef ", 1)[0]
        functions = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                marked = any("slow" in ast.unparse(d) for d in node.decorator_list)
                doc = (ast.get_docstring(node) or "").split(". ")[0].split("\n\n")[0]
                functions[node.name] = (" ".join(doc.split()), marked or module_slow)
        cache[path] = functions
    doc, slow = cache[path].get(name.split("[")[0], ("", False))
    doc = doc if len(doc) <= 160 else doc[:157].rsplit(" ", 1)[0] + " ..."
    return doc or name.split("[")[0].removeprefix("test_").replace("_", " "), slow


def table(junit: Path, wall: float | None, command: str) -> str:
    rows, by_file, cache = [], defaultdict(float), {}
    for case in ET.parse(junit).iter("testcase"):
        seconds = float(case.get("time", 0))
        module = case.get("classname", "")
        path = ROOT / (module.replace(".", "/") + ".py")
        by_file[path.relative_to(ROOT).as_posix()] += seconds
        if seconds >= SHOWN_OVER_S:
            proves, slow = (
                what_it_proves(path, case.get("name", ""), cache) if path.is_file() else ("", False)
            )
            rows.append((seconds, f"{path.relative_to(ROOT).as_posix()}::{case.get('name')}", slow, proves))
    rows.sort(reverse=True)
    total = sum(by_file.values())
    lines = [
        "# The suite's time, test by test",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {os.cpu_count()} cores ({platform.machine()}), python {platform.python_version()}",
        f"- wall time: {wall:,.0f} s (budget: {BUDGET_S['suite']:,} s for the suite, {BUDGET_S['fast tier']} s "
        f"for the fast tier); tests' own seconds summed over the workers: {total:,.0f} s"
        if wall is not None
        else f"- tests' own seconds summed over the workers: {total:,.0f} s",
        "",
        "| seconds | test | tier | what it proves |",
        "|---|---|---|---|",
        *(
            f"| {s:.1f} | `{name}` | {'slow' if slow else 'fast'} | {proves} |"
            for s, name, slow, proves in rows
        ),
        "",
        "| seconds | file |",
        "|---|---|",
        *(f"| {s:.0f} | `{f}` |" for f, s in sorted(by_file.items(), key=lambda kv: -kv[1]) if s >= 5),
        "",
    ]
    return "\n".join(lines)


MOVES = "\n## What moved where"


def moves(old_table: Path) -> str:
    """The section of the old table that says which tests were made cheaper or changed tier, and why
    (written by hand), to keep below the new one; empty when there is none."""
    text = old_table.read_text(encoding="utf-8") if old_table.is_file() else ""
    return "\n" + text[text.index(MOVES) :].lstrip("\n") if MOVES in text else ""


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--junit", type=Path, help="a JUnit XML file of a run made earlier (no run then)")
    args.add_argument("--out", type=Path, default=TABLE, help=f"where the table goes (default: {TABLE})")
    args.add_argument("pytest_args", nargs="*", help="pytest's own arguments (after --)")
    options = args.parse_args()
    wall = None
    command = "python -m pytest -q " + " ".join(options.pytest_args)
    junit = options.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "suite.xml"
        wall = run_suite(options.pytest_args, junit)
        command = f"python scripts/suite_durations.py {' '.join(options.pytest_args)}".strip()
    kept = moves(options.out)  # the hand-written record of what moved where survives a new table
    options.out.write_text(table(junit, wall, command) + kept, encoding="utf-8")
    print(f"{options.out}: written" + (f" (wall time {wall:,.0f} s)" if wall is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
