"""Turning a failed dataset load into one line naming the file, the row and the problem.

``datasets`` reports a bad JSON line or a non-UTF-8 byte as a long chained error without the row.
Only when a load has failed, the file is read once more here, line by line, to find the first bad row.
"""

from __future__ import annotations

import json
from pathlib import Path

from qlora_kit.errors import DataError


def diagnose_load_failure(path: Path, source: str, exc: Exception) -> DataError:
    """The most specific DataError for a load that raised ``exc``."""
    if path.is_file():
        found = _first_bad_line(path)
        if found:
            return DataError(f"{path}: {found}")
    reason = " ".join(str(exc).split()) or exc.__class__.__name__
    if exc.__class__.__name__ == "DatasetNotFoundError" or "doesn't exist on the Hub" in reason:
        return DataError(
            f"{source}: not a local file or folder, and no hub dataset of that name ({reason[:160]})"
        )
    return DataError(f"{source}: cannot load ({exc.__class__.__name__}: {reason[:200]})")


def _first_bad_line(path: Path) -> str | None:
    raw = path.read_bytes()
    if not raw.strip():
        return "the file is empty"
    lines = raw.split(b"\n")
    for number, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as err:
            return f"row {_row(number, path)}: not UTF-8 text (byte {line[err.start]:#04x} at column {err.start + 1})"
    if path.suffix == ".jsonl":
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                return f"row {number}: malformed JSON ({err.msg} at column {err.colno})"
            if not isinstance(value, dict):
                return f"row {number}: not a JSON object (got {type(value).__name__})"
    if path.suffix == ".json":
        try:
            json.loads(raw)
        except json.JSONDecodeError as err:
            return f"malformed JSON ({err.msg} at line {err.lineno}, column {err.colno})"
    return None


def _row(line_number: int, path: Path) -> int:
    # A CSV's first line is its header: line 2 holds row 1.
    return line_number - 1 if path.suffix == ".csv" else line_number
