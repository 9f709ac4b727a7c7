"""The reward functions of ``grpo.rewards``, with TRL's reward signature, built from the recipe.

TRL calls each one as ``f(prompts=..., completions=..., completion_ids=..., **columns)`` and takes one
float per completion (``GRPOTrainer._calculate_rewards``); the columns are the data row's, ``reference``
included (data/prompts.py). A builtin (registries/rewards.py) becomes a function named after the
builtin, so TRL logs ``rewards/<name>/mean``; a ``module:function`` entry is imported as it is.
A conversation's completion is a list of messages: the builtins score its text.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qlora_kit.errors import RecipeError
from qlora_kit.recipe.grpo import RewardSection
from qlora_kit.registries.rewards import is_python_reward

Reward = Callable[..., list[float]]


def reward_functions(rewards: list[RewardSection]) -> list[Reward]:
    """One function per ``grpo.rewards`` entry, in order (the recipe has checked the builtins' arguments)."""
    return [_reward(entry, f"grpo.rewards[{i}]") for i, entry in enumerate(rewards)]


def check_importable(names: list[str]) -> None:
    """Import every ``module:function`` among the rewards' ``names`` (``grpo.rewards``' in order) now: a
    missing one is a one-line RecipeError before any work."""
    for index, name in enumerate(names):
        if is_python_reward(name):
            import_reward(name, f"grpo.rewards[{index}].name")


def import_reward(name: str, where: str) -> Reward:
    """``module:function`` -> the function, imported as Python imports it from the working directory
    (the CLI's entry point does not put it on the path itself) or PYTHONPATH."""
    module_name, _, function_name = name.partition(":")
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user's module may fail in any way while importing
        raise RecipeError(f"{where}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RecipeError(f"{where}: {module_name} has no function {function_name!r}")
    return function


def completion_text(completion: Any) -> str:
    """A completion as text: TRL gives a string, or for conversations a list of assistant messages."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def _reward(entry: RewardSection, where: str) -> Reward:
    if is_python_reward(entry.name):
        return import_reward(entry.name, f"{where}.name")
    if entry.name == "exact_match":
        return _exact_match(entry.field or "reference")
    if entry.name == "number_match":
        return _number_match(entry.field or "reference")
    if entry.name == "regex":
        return _regex(re.compile(entry.pattern))
    if entry.name == "length":
        return _length(entry.min_chars or 0, entry.max_chars)
    raise RecipeError(f"{where}.name: unknown reward {entry.name!r}")  # the recipe refuses it first


def _exact_match(column: str) -> Reward:
    def exact_match(completions: list, **columns: Any) -> list[float]:
        references = _column(columns, column, "exact_match")
        return [
            float(completion_text(c).strip() == str(r).strip())
            for c, r in zip(completions, references, strict=True)
        ]

    return exact_match


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands commas allowed: 1,200), or None."""
    found = NUMBER.findall(text)
    try:
        return float(found[-1].replace(",", "")) if found else None
    except ValueError:
        return None


def _number_match(column: str) -> Reward:
    def number_match(completions: list, **columns: Any) -> list[float]:
        references = _column(columns, column, "number_match")
        scores = []
        for completion, reference in zip(completions, references, strict=True):
            got, wanted = last_number(completion_text(completion)), last_number(str(reference))
            scores.append(float(got is not None and got == wanted))
        return scores

    return number_match


def _column(columns: dict[str, Any], column: str, reward: str) -> list:
    if column not in columns:
        shown = ", ".join(sorted(k for k in columns if not k.startswith(("trainer_", "log_"))))
        raise RecipeError(
            f"grpo.rewards: {reward} compares with column {column!r}, which the data has not (it has {shown})"
        )
    return columns[column]


def _regex(pattern: re.Pattern) -> Reward:
    def regex(completions: list, **_: Any) -> list[float]:
        return [float(pattern.search(completion_text(c)) is not None) for c in completions]

    return regex


def _length(low: int, high: int | None) -> Reward:
    def length(completions: list, **_: Any) -> list[float]:
        sizes = [len(completion_text(c).strip()) for c in completions]
        return [float(low <= n and (high is None or n <= high)) for n in sizes]

    return length
