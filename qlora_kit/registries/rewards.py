"""The reward registry: one ``RewardSpec`` per builtin reward a ``grpo.rewards`` entry may name.

A builtin reward scores each completion a program can check: against the row's reference answer, a
regular expression, or a length. The recipe validates an entry's arguments against its spec (which it
needs, which it ignores); ``data/rewards.py`` turns each entry into a function with TRL's reward
signature. Adding a builtin is one entry here plus its scoring function there (and its tests).
Standard library only: the recipe reads it.

A reward that is not builtin is named ``module:function``: a Python function with TRL's signature
``f(prompts, completions, **columns) -> list[float]`` (every column of the data row is a keyword).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RewardSpec:
    """One builtin reward: the arguments it needs and may take, and what it scores."""

    name: str
    required: tuple[str, ...]  # arguments of the grpo.rewards entry it cannot score without
    optional: tuple[str, ...]  # arguments it may take
    describe: str  # one line: what scores 1 and what scores 0


REWARDS: dict[str, RewardSpec] = {
    spec.name: spec
    for spec in (
        RewardSpec(
            "exact_match",
            (),
            ("field",),
            "1 when the completion, stripped, equals the row's reference answer (or the column `field`), else 0",
        ),
        RewardSpec(
            "number_match",
            (),
            ("field",),
            "1 when the last number in the completion equals the last number in the reference (or the column "
            "`field`; gsm8k's '#### 72'), else 0",
        ),
        RewardSpec(
            "regex",
            ("pattern",),
            (),
            "1 when the regular expression `pattern` matches somewhere in the completion (re.search), else 0",
        ),
        RewardSpec(
            "length",
            (),
            ("min_chars", "max_chars"),
            "1 when the stripped completion has between min_chars and max_chars characters, else 0",
        ),
    )
}
ARGUMENTS = ("field", "pattern", "min_chars", "max_chars")  # every builtin argument a recipe may set


def is_python_reward(name: str) -> bool:
    """``module:function`` (a user's function) rather than a builtin name."""
    return ":" in name
