"""A command line's numeric option, checked as the recipe checks the field it stands for.

``qlora-kit plan --budget-gb -4`` asks what ``memory.budget_gb: -4`` would, so the option's value goes
through that field's own pydantic constraints and a refusal is one line naming the option:
``--budget-gb: must be > 0 (got -4.0), as memory.budget_gb``. An option that stands for no field
(``eval --max-examples``) states its bounds as a pydantic ``Field`` would. The CLI declares a ``Checked``
beside each numeric option (cli/exits.py ``user_errors`` checks them before the command runs), and a test
holds every numeric option to having one (tests/test_bad_input.py), so a new option cannot skip it.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import cached_property
from typing import Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from qlora_kit.errors import RecipeError
from qlora_kit.recipe.base import _message_for


@dataclass(frozen=True, eq=False)  # hashed by identity: typing caches the Annotated it sits in
class Checked:
    """How a numeric option is checked: as recipe field ``field`` (``section.name``), or by ``bounds``
    (pydantic's ``gt``/``ge``/``lt``/``le``), or ``by`` another named check (the sampling settings)."""

    option: str
    field: str | None = None
    bounds: dict[str, float] = dataclass_field(default_factory=dict)
    by: str | None = None  # where a value is checked instead (its check names the option itself)

    @cached_property
    def _field(self) -> TypeAdapter | None:
        if self.field is None:
            return None
        from qlora_kit.recipe.recipe import Recipe

        section, name = self.field.split(".")
        info = Recipe.model_fields[section].annotation.model_fields[name]
        return TypeAdapter(Annotated[info.annotation, info], config=_CONFIG)

    def check(self, value: Any) -> None:
        """One line naming the option (a RecipeError: exit 2) when ``value`` is out of its bounds."""
        if value is None or self.by is not None:
            return
        # the bounds in the value's own type: ``--max-examples: must be > 0``, not ``> 0.0``
        adapter = self._field or TypeAdapter(Annotated[type(value), Field(**self.bounds)], config=_CONFIG)
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            also = f", as {self.field}" if self.field else ""
            raise RecipeError(f"{self.option}: {_message_for(exc.errors()[0])}{also}") from None


_CONFIG = ConfigDict(allow_inf_nan=False)  # as every recipe section (recipe/base.py)
