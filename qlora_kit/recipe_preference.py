"""The recipe's preference section: how ``train.objective: dpo`` scores pairs (TRL's DPOTrainer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from qlora_kit.recipe_base import Section

if TYPE_CHECKING:
    from qlora_kit.recipe import Recipe

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


def unpacked_for_pairs(values: Any) -> Any:
    """A dpo recipe that leaves data.packing unset gets false: TRL pads its pairs (it packs no pairs)."""
    if not isinstance(values, dict):
        return values
    train, data = values.get("train"), values.get("data")
    if isinstance(train, dict) and train.get("objective") == "dpo":
        data = dict(data) if isinstance(data, dict) else {}
        data.setdefault("packing", False)
        return {**values, "data": data}
    return values


def check_objective(recipe: Recipe) -> None:
    """The combinations train.objective, the data formats, the preference section and model.adapter allow."""
    from qlora_kit.data.formats import FORMATS

    dpo = recipe.train.objective == "dpo"
    pair_formats = {name for name, spec in FORMATS.items() if spec.pairs}
    used = recipe.data.formats_used()
    if dpo and not used <= pair_formats:
        wrong = sorted(used - pair_formats)[0]
        raise ValueError(
            f"data.format: train.objective dpo trains on preference pairs: use preference (prompt/chosen/rejected "
            f"texts) or preference_chat (got {wrong})"
        )
    if not dpo and used & pair_formats:
        raise ValueError(
            f"train.objective: format {sorted(used & pair_formats)[0]} holds preference pairs; set train.objective: dpo"
        )
    if not dpo and recipe.preference.model_fields_set:
        raise ValueError("preference: only applies to train.objective: dpo")
    if dpo:
        _check_dpo(recipe)


def _check_dpo(recipe: Recipe) -> None:
    if recipe.data.packing:
        raise ValueError("data.packing: not with train.objective dpo (TRL pads its pairs; it packs none)")
    if recipe.data.group_by_length:
        raise ValueError("data.group_by_length: not with train.objective dpo (pairs have no single length)")
    if recipe.lora.bias != "none":
        raise ValueError(
            f"lora.bias: {recipe.lora.bias} not with train.objective dpo (TRL's reference is a second adapter, "
            "and peft allows trained biases in one adapter only)"
        )
    if recipe.data.train_on_inputs:
        raise ValueError("data.train_on_inputs: not with train.objective dpo (pairs compare answers only)")
    if recipe.train.fsdp:
        raise ValueError("train.fsdp: not with train.objective dpo yet (untested under FSDP)")
    targets = recipe.lora.target_modules
    if isinstance(targets, list) and "lm_head" in targets:
        raise ValueError("lora.target_modules: TRL's DPOTrainer refuses LoRA on lm_head")
