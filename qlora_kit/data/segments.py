"""What a rendered row is made of: text segments, each trained or not; and a row's own mistakes."""

from __future__ import annotations

from dataclasses import dataclass


class RowError(ValueError):
    """What is wrong with one row; the caller adds the file and the row number."""


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool
