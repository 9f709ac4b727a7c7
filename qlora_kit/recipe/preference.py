"""The recipe's preference section: how ``train.objective: dpo`` scores pairs (TRL's DPOTrainer)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from qlora_kit.recipe.base import Section

# TRL 1.16's pairwise losses (DPOConfig.loss_type) for a chosen and a rejected answer.
LossType = Literal[
    "sigmoid",
    "ipo",
    "hinge",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
]


class PreferenceSection(Section):
    """Preference tuning (``train.objective: dpo``): the loss, its temperature and the length policy."""

    beta: float = Field(0.1, gt=0)
    """How far the trained policy may move from the reference: the DPO reward is beta * log(policy / reference)."""
    loss_type: LossType = "sigmoid"
    """TRL's loss: sigmoid (DPO), ipo, hinge, robust (conservative DPO, with label_smoothing), exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop or sigmoid_norm."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """The probability that a pair's preference is flipped (noisy labels); used by robust and exo_pair."""
    max_prompt_len: int | None = Field(None, gt=0)
    """Keep at most the last this many prompt tokens (its end, next to the answer); the pair's whole length is data.max_seq_len."""

    SMOOTHED: ClassVar[frozenset[str]] = frozenset({"robust", "exo_pair"})

    @model_validator(mode="after")
    def _check_smoothing(self) -> PreferenceSection:
        if self.label_smoothing and self.loss_type not in self.SMOOTHED:
            raise ValueError(
                f"preference.label_smoothing: the {self.loss_type} loss ignores it (TRL applies it to robust and "
                "exo_pair only); use loss_type: robust for conservative DPO"
            )
        if self.loss_type == "exo_pair" and not self.label_smoothing:
            raise ValueError("preference.label_smoothing: exo_pair needs it above 0 (e.g. 1e-3)")
        return self
