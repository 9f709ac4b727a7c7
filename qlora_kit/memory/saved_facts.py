"""Figures a run measured once and keeps beside its checkpoints (layer_costs.py, layout_costs.py), so a
resumed run decides as the first one did instead of timing again on another machine's load."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

Facts = TypeVar("Facts")


def write(folder: Path, filename: str, facts) -> None:
    (folder / filename).write_text(json.dumps(asdict(facts)) + "\n")


def read(folder: Path | None, filename: str, kind: type[Facts]) -> Facts | None:
    """``kind`` as written into ``folder``; None when the folder has none (its run measured nothing)."""
    path = folder / filename if folder is not None else None
    if path is None or not path.is_file():
        return None
    return kind(**json.loads(path.read_text()))
