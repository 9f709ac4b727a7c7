"""The recipe's grpo section: how ``train.objective: grpo`` samples, scores and learns (TRL's GRPOTrainer).

Field names are TRL 1.16's (``GRPOConfig``), so its documentation reads across. ``rewards`` lists the
functions that score each sampled completion: a builtin by name (``registries/rewards.py``), or a Python
function ``module:function`` with TRL's reward signature, each with a weight.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from qlora_kit.recipe.base import Section
from qlora_kit.registries import objectives
from qlora_kit.registries.rewards import ARGUMENTS, REWARDS, is_python_reward

# TRL 1.16's GRPOConfig.loss_type values: how token losses are summed into one number
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]


class RewardSection(Section):
    """One reward function of ``grpo.rewards``."""

    name: str
    """A builtin (exact_match, number_match, regex, length) or a Python function as module:function (TRL's reward signature)."""
    weight: float = 1.0
    """Its weight in the summed reward the advantages are computed from."""
    field: str | None = None
    """exact_match, number_match: the data column to compare with (default: the row's reference answer, the format's output)."""
    pattern: str | None = None
    """regex: the regular expression a completion must contain (re.search; anchor it with ^...$ for a whole match)."""
    min_chars: int | None = Field(None, ge=0)
    """length: the fewest characters a stripped completion may have (default 0)."""
    max_chars: int | None = Field(None, ge=0)
    """length: the most characters a stripped completion may have (default: no limit)."""


class GrpoSection(Section):
    """Reinforcement learning with rewards a program checks (``train.objective: grpo``)."""

    num_generations: int = 8  # below 2 refused with the reason (_check_group)
    """Completions sampled per prompt; each one's advantage is its reward against the group's mean."""
    max_completion_length: int = Field(256, gt=0)
    """The most tokens a sampled completion may have (a prompt gets data.max_seq_len minus this)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts: higher spreads the group's rewards, which GRPO learns from."""
    beta: float = Field(0.04, ge=0)
    """Weight of the KL penalty to the reference policy (the starting adapter, or the base); 0 skips the reference forward and the KL figure."""
    loss_type: LossType = "dapo"
    """TRL's loss: dapo (tokens of the whole accumulated batch), grpo (per sequence), dr_grpo, bnpo, cispo, sapo, luspo or vespo."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the reward spread of the group, of the batch, or not at all (Dr. GRPO)."""
    num_iterations: int = Field(1, ge=1)
    """Optimisation passes over each batch of rollouts (GRPO's mu); above 1 the clipped policy ratio matters."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """Clipping of the policy ratio to [1 - epsilon, 1 + epsilon]."""
    rewards: list[RewardSection] = Field(default_factory=list)
    """The reward functions, summed by weight: builtins by name (exact_match, number_match, regex, length) or module:function."""
    seed_each_completion: bool = False
    """Draw each completion's tokens from a random stream seeded by (train.seed, step, prompt, copy), inside the batched generate call: rollouts are the same on any number of processes and across a split generation (an out-of-memory split)."""

    @field_validator("num_generations")
    @classmethod
    def _check_group(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                f"must be >= 2 (got {value}): each completion's advantage is its reward against its group's mean, "
                "so a group of one has advantage 0 and nothing learns"
            )
        return value

    @model_validator(mode="after")
    def _check_rewards(self) -> GrpoSection:
        for index, reward in enumerate(self.rewards):
            check_reward(reward, f"grpo.rewards[{index}]")
        return self


def check_reward(reward: RewardSection, where: str) -> None:
    """A builtin's name and arguments (a Python function is imported when the run starts)."""
    given = [name for name in ARGUMENTS if getattr(reward, name) is not None]
    if is_python_reward(reward.name):
        module, _, function = reward.name.partition(":")
        if not module or not function:
            raise ValueError(f"{where}.name: expected module:function (got {reward.name!r})")
        if given:
            raise ValueError(
                f"{where}.{given[0]}: only for builtin rewards; {reward.name} gets every data column"
            )
        return
    spec = REWARDS.get(reward.name)
    if spec is None:
        raise ValueError(
            f"{where}.name: unknown reward {reward.name!r} (builtins: {', '.join(REWARDS)}; or module:function)"
        )
    for name in spec.required:
        if getattr(reward, name) is None:
            raise ValueError(f"{where}.{name}: required by the {spec.name} reward")
    for name in given:
        if name not in spec.required + spec.optional:
            raise ValueError(f"{where}.{name}: the {spec.name} reward does not take it")
    if reward.pattern is not None:
        try:
            re.compile(reward.pattern)
        except re.error as exc:
            raise ValueError(f"{where}.pattern: not a regular expression ({exc})") from None
    if reward.min_chars is not None and reward.max_chars is not None and reward.min_chars > reward.max_chars:
        raise ValueError(f"{where}.min_chars: above max_chars ({reward.min_chars} > {reward.max_chars})")


# Rows GRPO can ask from: a prompt and one reference answer (registries/formats.py)
PROMPT_FORMATS = ("alpaca", "chat", "sharegpt", "completion")


def check_grpo(recipe) -> None:
    """The combinations train.objective grpo allows (``recipe``: the whole Recipe; recipe.py calls this)."""
    grpo = objectives.of(recipe).section == "grpo"
    if not grpo:
        if recipe.grpo != GrpoSection():  # from values: a saved recipe holds the defaults
            raise ValueError("grpo: only applies to train.objective: grpo")
        return
    if not recipe.grpo.rewards:
        raise ValueError(
            "grpo.rewards: train.objective grpo needs at least one reward, e.g. [{name: exact_match}]"
        )
    wrong = sorted(recipe.data.formats_used() - set(PROMPT_FORMATS))
    if wrong:
        raise ValueError(
            f"data.format: train.objective grpo samples answers to prompts: use {', '.join(PROMPT_FORMATS)} "
            f"(got {wrong[0]})"
        )
    if recipe.grpo.max_completion_length >= recipe.data.max_seq_len:
        raise ValueError(
            f"grpo.max_completion_length: must be below data.max_seq_len ({recipe.data.max_seq_len}), "
            f"which holds the prompt and the completion (got {recipe.grpo.max_completion_length})"
        )
    refused = {
        "data.packing": recipe.data.packing is True,
        "data.group_by_length": recipe.data.group_by_length,
        "data.train_on_inputs": recipe.data.train_on_inputs,
        "train.fsdp": recipe.train.fsdp,
    }
    for field, set_ in refused.items():
        if set_:
            raise ValueError(f"{field}: not with train.objective grpo (it trains on sampled completions)")
    if recipe.lora.bias != "none":
        raise ValueError(
            f"lora.bias: {recipe.lora.bias} not with train.objective grpo (TRL's reference is a second adapter, "
            "and peft allows trained biases in one adapter only)"
        )
    targets = recipe.lora.target_modules
    if isinstance(targets, list) and "lm_head" in targets:
        raise ValueError("lora.target_modules: TRL's GRPOTrainer refuses LoRA on lm_head")
