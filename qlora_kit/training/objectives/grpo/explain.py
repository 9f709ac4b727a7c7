"""What a GRPO run says about itself: why its loss can read 0, what its rewards do, when it cannot learn.

Three things GRPO users are most often puzzled by (TRL #3452, #2931, #3857; unsloth #2291):
- the loss reads (about) 0: with one optimisation pass per batch of rollouts (grpo.num_iterations 1) the
  policy ratio is exactly 1 and each group's advantages sum to 0, so the loss's value is the KL term
  alone (0 with grpo.beta 0) while its gradient is not zero. Said once, when training starts.
- each logging step: every reward function's mean and spread, the share of prompts whose completions
  all got the same reward, the completions' length and the KL to the reference: one line.
- when most prompts' completions all score alike their advantages are 0 and the step learns nothing:
  one warning, the first time it happens, saying what to change.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from qlora_kit.registries import metric_keys as keys

log = logging.getLogger(__name__)

# Above this share of prompts with no reward spread, a step learns from too few groups to move.
MOSTLY_SAME = 0.5


def loss_explanation(beta: float, num_iterations: int) -> str:
    """Why the loss can read 0, for this run's settings."""
    if num_iterations == 1:
        term = "the KL penalty alone" if beta else "0 (grpo.beta is 0: no KL term)"
        return (
            "grpo: the loss will read about "
            + term
            + ": with grpo.num_iterations 1 the policy ratio is 1 and "
            "each prompt's advantages sum to 0, so the loss's value says nothing while its gradient still "
            "trains; watch the reward curves instead"
        )
    return (
        "grpo: the loss stays near 0 (each prompt's advantages sum to 0; the policy ratio moves from 1 only "
        "within a batch's grpo.num_iterations passes): watch the reward curves instead"
    )


def same_reward_warning(share: float, generations: int) -> str:
    return (
        f"grpo: in {share:.0%} of prompts all {generations} completions got the same reward, so their advantage "
        "is 0 and they teach nothing. Raise grpo.temperature or grpo.num_generations, add a reward that gives "
        "partial credit (e.g. a format or length reward), or start from an adapter (model.adapter) that "
        "solves some of the prompts"
    )


def step_line(logs: dict[str, Any], names: list[str]) -> str | None:
    """The logging step's figures as one line, or None when the log has no rollout figures."""
    if keys.REWARD not in logs:
        return None
    parts = [
        f"{name} {logs[keys.reward_key(name)]:.3f}±{logs.get(keys.reward_key(name, keys.STD), 0.0):.3f}"
        for name in names
        if logs.get(keys.reward_key(name)) is not None
    ]
    if logs.get(keys.FRAC_REWARD_ZERO_STD) is not None:
        parts.append(f"same-reward prompts {logs[keys.FRAC_REWARD_ZERO_STD]:.0%}")
    if logs.get(keys.COMPLETION_LENGTH) is not None:
        parts.append(f"completion {logs[keys.COMPLETION_LENGTH]:.1f} tokens")
    if logs.get(keys.KL) is not None:
        parts.append(f"KL {logs[keys.KL]:.4f}")
    return "grpo rewards: " + "  ".join(parts)


class GrpoExplainer(TrainerCallback):
    """Logs the module docstring's three explanations (main process only)."""

    def __init__(self, reward_names: list[str], beta: float, num_iterations: int, generations: int) -> None:
        self.reward_names = reward_names
        self.beta, self.num_iterations, self.generations = beta, num_iterations, generations
        self.warned = False

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            log.info(loss_explanation(self.beta, self.num_iterations))

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not state.is_world_process_zero or not logs:
            return
        line = step_line(logs, self.reward_names)
        if line is not None:
            log.info("step %d %s", state.global_step, line)
        share = logs.get(keys.FRAC_REWARD_ZERO_STD)
        if share is not None and share > MOSTLY_SAME and not self.warned:
            self.warned = True
            log.warning(same_reward_warning(share, self.generations))
