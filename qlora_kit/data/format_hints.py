"""Which other format a refused row is in: the hint a row error ends with.

Formats of the same kind of rows differ by their fields' names (chat's ``messages``, sharegpt's
``conversations``) or by text against message lists (feedback and feedback_chat, preference and
preference_chat: TRL's standard and conversational shapes). A row refused under ``data.format`` that has
another such format's shape gets that format named: ``row 3: field 'prompt' must be text (got list [...])
(data.format: feedback_chat reads message lists)``. Only formats serving the same objectives are named
(the registry's ``rows``: sequences, pairs, labelled answers), so the hint never asks for another
objective. Read by every place a row error gets its file and row (row_tokens.py, feedback.py, prompts.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qlora_kit.registries.formats import FORMATS, FormatSpec

if TYPE_CHECKING:
    from datasets import Dataset

CONVERSATIONS = ("messages", "conversations")  # always a list, whatever the format


def _required(spec: FormatSpec) -> list[str]:
    return [name for name in spec.fields if name not in spec.optional] + (["label"] if spec.labelled else [])


def _what(spec: FormatSpec, other: FormatSpec) -> str:
    if other.chat_template != spec.chat_template:
        return "message lists" if other.chat_template else "text"
    return ", ".join(repr(name) for name in _required(other))


def _others(fmt: str) -> list[FormatSpec]:
    spec = FORMATS[fmt]
    return [o for o in FORMATS.values() if o.name != fmt and o.rows == spec.rows]


def row_hint(row: dict[str, Any], fmt: str) -> str:
    """`` (data.format: NAME reads ...)`` for the first other format ``row`` has the shape of, else ''."""
    spec = FORMATS[fmt]
    for other in _others(fmt):
        if _has_shape(row, other, spec):
            return f" (data.format: {other.name} reads {_what(spec, other)})"
    return ""


def columns_hint(rows: Dataset, fmt: str) -> str:
    """The same for rows that all lack one of ``fmt``'s fields: the first row's other format."""
    return row_hint(rows[0], fmt) if len(rows) else ""


def _has_shape(row: dict[str, Any], other: FormatSpec, spec: FormatSpec) -> bool:
    required = _required(other)
    for name in required:
        value = row.get(name)
        if name == "label":
            if not isinstance(value, bool):
                return False
        elif name in CONVERSATIONS or (other.chat_template and not spec.chat_template):
            # a chat format read from a text one's row: named only where the row holds message lists
            if not (isinstance(value, list) and value) and not (
                name not in CONVERSATIONS and isinstance(value, str)
            ):
                return False
        elif not isinstance(value, str):
            return False
    if other.chat_template and not spec.chat_template:
        return any(isinstance(row.get(name), list) for name in required)
    return True
