"""``--set`` overrides: a dotted key reaches a recipe field at any depth, and a value reaches it typed as
the field takes it (the YAML reading, or the text typed for a text field).

``Recipe.from_yaml(path, overrides=[...])`` and the CLI's ``--set`` call ``apply_overrides`` with the
recipe's schema; pydantic then validates the result and names an unknown key.
"""

from __future__ import annotations

import copy
import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from qlora_kit.errors import RecipeError


def apply_overrides(
    values: dict[str, Any], overrides: list[str] | dict[str, Any], schema: type[BaseModel]
) -> dict[str, Any]:
    """Apply dotted overrides to ``schema``'s values at any depth (``lora.rank=16``, ``data.preflight.min_end_token_share=0``).
    A value typed on the command line is read as YAML (``16``, ``true``, ``[a, b]``) where the field takes
    what YAML reads, and as the text typed where the field takes text but not that: YAML 1.1 reads ``no``,
    ``on`` and ``null`` as booleans and None, which reach a text field (``train.mixed_precision=no``, a
    revision ``1.10``) as the user typed them."""
    if isinstance(overrides, dict):
        pairs = list(overrides.items())
    else:
        pairs = []
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise RecipeError(f"--set {item!r}: expected section.field=value")
            try:
                parsed = yaml.safe_load(raw)
            except yaml.YAMLError:
                raise RecipeError(f"--set {key}: cannot parse value {raw!r}") from None
            pairs.append((key.strip(), as_typed(raw.strip(), parsed, field_annotation(schema, key.strip()))))
    merged = copy.deepcopy(values)
    for key, value in pairs:
        *sections, field = key.split(".")
        if not sections or not all(sections) or not field:
            raise RecipeError(f"--set {key}: expected section.field (for example lora.rank)")
        target = merged
        for depth, name in enumerate(sections):
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                raise RecipeError(f"{'.'.join(sections[: depth + 1])}: must be a mapping (got {target!r})")
        target[field] = value
    return merged


def field_annotation(schema: type[BaseModel], key: str) -> Any:
    """The type of the recipe field a dotted key names, or None where it names none (pydantic then says
    which key is unknown)."""
    model: Any = schema
    annotation = None
    for name in key.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or name not in model.model_fields:
            return None
        annotation = model.model_fields[name].annotation
        model = annotation
    return annotation


def as_typed(raw: str, parsed: Any, annotation: Any) -> Any:
    """``parsed`` (what YAML reads) where the field takes it, else ``raw`` where the field takes text."""
    if isinstance(parsed, str | list | dict) or annotation is None:
        return parsed
    types_, literals = _accepted(annotation)
    takes_text = str in types_ or any(isinstance(v, str) for v in literals)
    takes_parsed = any(type(parsed) is type(v) and parsed == v for v in literals) or (
        type(parsed) in types_ or (type(parsed) is int and float in types_)
    )
    return raw if takes_text and not takes_parsed else parsed


def _accepted(annotation: Any) -> tuple[set[type], list[Any]]:
    """The plain types and the literal values a field's annotation accepts (unions and Annotated unwrapped)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return set(), list(args)
    if origin is typing.Annotated:
        return _accepted(args[0])
    if origin in (typing.Union, types.UnionType):
        types_, literals = set(), []
        for arg in args:
            more = _accepted(arg)
            types_ |= more[0]
            literals += more[1]
        return types_, literals
    if annotation is None or annotation is type(None):
        return {type(None)}, []
    return ({annotation} if isinstance(annotation, type) else {origin}), []
