"""What every recipe section shares: the error type, the pydantic base, telling local paths from hub ids,
and pydantic's validation errors as one line.

Kept apart from recipe.py so the section families (recipe_data.py) and the recipe can both import it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    # Attribute docstrings become field descriptions (shown by `qlora-kit validate`); unknown keys are errors.
    # allow_inf_nan=False: .inf / .nan in any float field is a mistake caught here, not by a guard later.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


def looks_local(value: str) -> bool:
    # A hub id is "org/name" or "name"; a local path starts with "." or "/" or "~", or has a file suffix.
    if value.startswith("builtin:"):
        return False
    return value.startswith((".", "/", "~")) or Path(value).suffix in {".jsonl", ".json", ".csv", ".parquet"}


def describe_validation_error(exc: ValidationError) -> str:
    """The first problem as one line: ``lora.rank: must be > 0 (got 0)``; a field that takes one of
    several types (``float | Literal["auto"]``) says what each would take: ``lora.dropout: must be < 1.0
    (got 1.5), or 'auto'``."""
    errors = exc.errors()
    first = errors[0]
    branches = _union_branches(errors)
    more = len(errors) - len(branches)
    more = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    loc = ".".join(str(part) for part in first["loc"][: -1 if len(branches) > 1 else None])
    if first["type"] == "value_error" and len(branches) == 1:
        message = str((first.get("ctx") or {}).get("error", first["msg"]))
        if not loc or message.startswith(f"{loc}."):
            return f"{message}{more}"  # recipe- and section-level validators name the field themselves
    if len(branches) == 1:
        return f"{loc}: {_message_for(first)}{more}"
    literals = [e["ctx"]["expected"] for e in branches if e["type"] == "literal_error"]
    messages = list(dict.fromkeys(_message_for(e) for e in branches if e["type"] != "literal_error"))
    return f"{loc}: {'; '.join(messages)}{', or ' + ' or '.join(literals) if literals else ''}{more}"


# pydantic names the branch of a union a value failed as the last part of its location: a type
# ("bool", "constrained-float", "literal['auto']", "list[str]"), never a field name
UNION_BRANCH = re.compile(r"^(bool|int|float|str|none|constrained-[a-z]+|[a-z-]+\[.*\])$")


def _union_branches(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first error and, where it is one branch of a union field, the other branches' errors too."""
    first = errors[0]
    tag = first["loc"][-1] if first["loc"] else None
    if not isinstance(tag, str) or not UNION_BRANCH.match(tag):
        return [first]
    return [
        e
        for e in errors
        if e["loc"][:-1] == first["loc"][:-1]
        and isinstance(e["loc"][-1], str)
        and UNION_BRANCH.match(e["loc"][-1])
    ]


def _message_for(error: dict[str, Any]) -> str:
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit} (got {got!r})"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')} (got {got!r})"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg'][0].lower()}{error['msg'][1:]} (got {got!r})"


def one_line(text: str) -> str:
    return " ".join(text.split())
