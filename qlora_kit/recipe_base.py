"""What every recipe section shares: the error type, the pydantic base, and telling local paths from hub ids.

Kept apart from recipe.py so the section families (recipe_data.py) and the recipe can both import it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class RecipeError(ValueError):
    """A user mistake in a recipe: one line naming the field and the value."""


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
