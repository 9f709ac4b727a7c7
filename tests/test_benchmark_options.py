"""The benchmarks' shared command line: a ``--smoke`` run writes nowhere a committed table lives unless
``--out`` says so (issue 47: ``vs_trl.py --smoke`` overwrote results/vs-trl-cpu.md's full-size figures)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ("common.py", "gpu_rows.py", "tiny_configs.py", "vs_trl_profile.py")  # modules the scripts import
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name not in HELPERS)


def test_a_smoke_run_writes_outside_the_committed_tables_unless_out_says_so(tmp_path):
    options = common.parser("a benchmark")
    smoke = options.parse_args(["--smoke"]).out
    assert smoke == common.SMOKE_OUT and common.RESULTS.resolve() not in [
        smoke.resolve(),
        *smoke.resolve().parents,
    ]
    assert options.parse_args([]).out == common.RESULTS, "a full run writes the tables"
    assert options.parse_args(["--smoke", "--out", str(common.RESULTS)]).out == common.RESULTS
    assert options.parse_args(["--smoke", "--out", str(tmp_path)]).out == tmp_path
    # a script whose default is not the tables keeps it for a smoke run
    assert common.parser("x", out=tmp_path).parse_args(["--smoke"]).out == tmp_path


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_takes_its_command_line_and_folder_from_common(script):
    """The rule above holds for a script only if it parses with common.parser and writes to args.out."""
    source = script.read_text(encoding="utf-8")
    assert "parser(__doc__" in source, f"{script.name}: build the command line with common.parser"
    for call in re.findall(r"write_result\((.*?)\n    \)|write_result\((.*)\)", source, re.S):
        text = "".join(call)
        assert "args.out" in text, f"{script.name}: write_result without args.out writes into results/"
