"""``micro_batch_split.json`` in each checkpoint: the parts a split run reached, which a ``--resume`` continues
with (a checkpoint without it was never split)."""

from __future__ import annotations

import json
from pathlib import Path

SPLIT_FILE = "micro_batch_split.json"  # in each checkpoint: the parts a resumed run continues with


def write_split(folder: Path, parts: int, eval_parts: int, generation_parts: int = 1) -> None:
    saved = {"parts": parts, "eval_parts": eval_parts}
    if generation_parts > 1:  # GRPO's rollouts: generate calls per generation batch (grpo/oom.py)
        saved["generation_parts"] = generation_parts
    (folder / SPLIT_FILE).write_text(json.dumps(saved) + "\n")


def read_split(folder: Path) -> tuple[int, int]:
    """(parts, eval parts) a checkpoint was written with; (1, 1) when it has no file (never split)."""
    path = folder / SPLIT_FILE
    if not path.is_file():
        return 1, 1
    saved = json.loads(path.read_text())
    return int(saved["parts"]), int(saved["eval_parts"])


def read_generation_parts(folder: Path) -> int:
    """The generate calls a GRPO checkpoint's rollouts were split in; 1 when never split."""
    path = folder / SPLIT_FILE
    return int(json.loads(path.read_text()).get("generation_parts", 1)) if path.is_file() else 1
