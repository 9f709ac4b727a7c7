"""``train.objective: orpo``: TRL's ORPOTrainer with everything ``GuardedTrainer`` adds to a run.

ORPO (Hong et al., 2024) learns from preference pairs with no reference policy: the chosen answer's
cross-entropy plus ``preference.beta`` (the paper's lambda) times the log odds ratio of chosen over
rejected, so one adapter does SFT and preference tuning in a single run, and no second adapter is held.

What this module changes in TRL's behaviour, and why:
- The pairs arrive tokenized by qlora_kit (data/preference.py: the same rows, length policy and report as
  DPO's); ``tokenize_row`` lays them out as TRL's own tokenization would, and tokenizes nothing again.
- TRL's ORPOTrainer does not take the Trainer's ``optimizer_cls_and_kwargs``; the recipe's optimizer is
  handed to the Trainer after TRL's ``__init__`` instead.
- Each batch also carries the forward's own ``input_ids`` and ``labels`` (both answers after their prompts,
  as TRL concatenates them), which the throughput count reads as it reads every other objective's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from qlora_kit.data import prepare as data
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.errors import RecipeError
from qlora_kit.recipe.preference import PreferenceSection
from qlora_kit.training.step import private_hooks
from qlora_kit.training.step.arguments import training_settings
from qlora_kit.training.step.guards import TrainingGuard
from qlora_kit.training.step.trainer import GuardedTrainer

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def orpo_arguments(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str) -> ORPOConfig:
    """TRL's ORPOConfig: the Trainer's arguments from the recipe plus preference.beta (ORPO's lambda)."""
    if recipe.preference.loss_type != PreferenceSection().loss_type:
        raise RecipeError(
            f"preference.loss_type: {recipe.preference.loss_type} is DPO's; train.objective orpo has its own loss"
        )
    return ORPOConfig(
        **training_settings(recipe, output_dir, has_eval, precision),
        beta=recipe.preference.beta,
        # qlora_kit's length policy has already cut every pair to fit (data/preference.py)
        max_length=recipe.data.max_seq_len,
    )


def prepare(recipe: Recipe, tokenizer) -> data.PreparedData:
    """The pairs as prompt/chosen/rejected ids, prompts cut to ``preference.max_prompt_len`` tokens."""
    return data.prepare_datasets(recipe.data, tokenizer, recipe.train.seed, recipe.preference.max_prompt_len)


def trainer_parts(recipe: Recipe, tokenizer, output_dir: Path, has_eval: bool, precision: str):
    """(Trainer class, its arguments, the guard class, extra Trainer keyword arguments): TRL's
    DPODataCollatorWithPadding pads the pairs."""
    return GuardedORPOTrainer, orpo_arguments(recipe, output_dir, has_eval, precision), TrainingGuard, {}


@private_hooks.checked
class GuardedORPOTrainer(GuardedTrainer, ORPOTrainer):
    """ORPOTrainer with qlora_kit's guards, accounting and checkpoint layout (see the module docstring)."""

    def __init__(self, *args, optimizer_cls_and_kwargs=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.data_collator = _WithTheForwardsRows(self.data_collator, self.padding_value)

    def tokenize_row(self, feature: dict[str, Any], model=None) -> dict[str, list[int]]:
        """One prepared pair as TRL's columns: each answer after its prompt, the prompt's labels masked."""
        prompt = feature["prompt_ids"]
        row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
        for side in ("chosen", "rejected"):
            answer = feature[f"{side}_ids"]
            row[f"{side}_input_ids"] = prompt + answer
            row[f"{side}_attention_mask"] = [1] * (len(prompt) + len(answer))
            row[f"{side}_labels"] = [IGNORE_INDEX] * len(prompt) + answer
        return row


class _WithTheForwardsRows:
    """TRL's padded pairs plus the rows its forward runs: ``input_ids`` and ``labels``, chosen above
    rejected (``ORPOTrainer.concatenated_inputs``)."""

    def __init__(self, pad_pairs, padding_value: int):
        self.pad_pairs, self.padding_value = pad_pairs, padding_value

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.pad_pairs(features)
        both = ORPOTrainer.concatenated_inputs(batch, padding_value=self.padding_value)
        batch["input_ids"], batch["labels"] = both["concatenated_input_ids"], both["concatenated_labels"]
        return batch
