"""GRPO's reward functions checked where TRL calls them (``GRPOTrainer._calculate_rewards``): a reward
that raises, or returns other than one reward per completion, stops the run with one line naming
``grpo.rewards[i]``, the function and, for a raise, the completion and data row it failed on, instead of
a traceback from inside TRL's scoring loop. ``grpo.py`` wraps each function it hands to TRL.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from qlora_kit.errors import RecipeError

Reward = Callable[..., list]

SHOWN = 60  # characters of a prompt shown in the line


def checked(function: Reward, where: str) -> Reward:
    """``function`` as TRL calls it, raising a one-line RecipeError for a raise or a wrong count (an
    async reward, which TRL gathers itself, is returned as it is)."""
    if inspect.iscoroutinefunction(function):
        return function
    name = getattr(function, "__name__", repr(function))

    @functools.wraps(function)
    def reward(*args: Any, **kwargs: Any) -> list:
        expected = len(kwargs.get("completions") or [])
        try:
            scores = function(*args, **kwargs)
        except RecipeError:
            raise  # a builtin's own line (a missing column)
        except Exception as exc:  # a user's function may fail in any way
            failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            raise RecipeError(f"{where}: {name} raised {failed}{_failing_row(function, kwargs)}") from None
        count = len(scores) if isinstance(scores, list | tuple) else None
        if count != expected:
            got = f"{count} rewards" if count is not None else f"a {type(scores).__name__}"
            raise RecipeError(
                f"{where}: {name} returned {got} for {expected} completions; a reward function returns a "
                "list of one float (or None) per completion"
            )
        return scores

    return reward


def _failing_row(function: Reward, kwargs: dict[str, Any]) -> str:
    """`` on completion k of the batch (prompt ...)``: the first completion that raises alone, or ''."""
    completions = kwargs.get("completions") or []
    count = len(completions)
    for index in range(count):
        one = {
            k: v[index : index + 1] if isinstance(v, list) and len(v) == count else v
            for k, v in kwargs.items()
        }
        try:
            function(**one)
        except Exception:
            prompt = str((kwargs.get("prompts") or [""] * count)[index])
            shown = prompt if len(prompt) <= SHOWN else prompt[: SHOWN - 3] + "..."
            return f" on completion {index + 1} of {count} (prompt {shown!r})"
    return ""
