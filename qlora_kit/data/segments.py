"""What a rendered row is made of: text segments, each trained or not; and a row's own mistakes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RowError(ValueError):
    """What is wrong with one row; the caller adds the file and the row number."""


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool


def show(value: Any, limit: int = 40) -> str:
    """A value as a row error quotes it: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
