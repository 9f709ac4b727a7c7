"""The mutation check's table still points at the code: each row's snippet occurs exactly once in its
file and each named test exists. CI runs the check itself only after the whole suite (half an hour in),
so a module moved or a line reworded would otherwise fail the stop at its very end."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import mutation_check  # noqa: E402

NODE = re.compile(r"^(?P<file>tests/[\w/]+\.py)::(?P<test>\w+)(\[[^\]]+\])?$")


def _rows() -> list[mutation_check.Mutation]:
    return [mutation_check.Mutation(*row) for row in mutation_check.MUTATIONS]


def test_every_mutation_snippet_occurs_once_in_its_file():
    assert mutation_check.check_snippets(_rows()) == []


def test_every_named_test_is_defined_where_the_row_says():
    missing = []
    for m in _rows():
        for node in m.tests:
            match = NODE.match(node)
            path = ROOT / match["file"] if match else None
            if path is None or not path.is_file() or f"def {match['test']}(" not in path.read_text():
                missing.append(f"{m.name}: {node}")
    assert not missing, missing
