"""What every recipe section shares: the error type, the pydantic base, telling local paths from hub ids,
and pydantic's validation errors as one line.

Kept apart from recipe.py so the section families (recipe_data.py) and the recipe can both import it.
"""

from __future__ import annotations

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
    """The first problem as one line: ``lora.rank: must be > 0 (got 0)``."""
    errors = exc.errors()
    first = errors[0]
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    loc = ".".join(str(part) for part in first["loc"])
    if first["type"] == "value_error":
        message = str((first.get("ctx") or {}).get("error", first["msg"]))
        if not loc or message.startswith(f"{loc}."):
            return f"{message}{more}"  # recipe- and section-level validators name the field themselves
    return f"{loc}: {_message_for(first)}{more}"


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
