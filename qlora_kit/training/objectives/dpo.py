"""``train.objective: dpo``: TRL's DPOTrainer with everything ``GuardedTrainer`` adds to a run.

``GuardedDPOTrainer`` is ``GuardedTrainer`` on top of TRL's ``DPOTrainer`` (one class each, nothing
copied): the guards, the memory and throughput accounting, atomic checkpoints, the adapter-only save and
a resumed paged optimizer all come from GuardedTrainer; the pair loss, the reference log-probabilities
and the reward metrics from TRL.

The reference policy is TRL's frozen second adapter "ref" on the same 4-bit base (reference_adapter.py's
``take_over_reference``, shared with KTO, gives the policy its fp32 LoRA weights back after TRL's bf16
cast, leaves the recipe's checkpointing alone around the reference forward and sends no telemetry).

What this module changes in TRL's behaviour besides, and why:
- The data arrive tokenized by qlora_kit (data/preference.py); TRL does not tokenize them again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trl import DPOConfig, DPOTrainer

from qlora_kit.data import prepare as data
from qlora_kit.training.objectives.reference_adapter import reference_trainer
from qlora_kit.training.step.arguments import training_settings
from qlora_kit.training.step.guards import TrainingGuard

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def dpo_arguments(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str) -> DPOConfig:
    """TRL's DPOConfig: the Trainer's arguments from the recipe plus the preference section."""
    preference = recipe.preference
    return DPOConfig(
        **training_settings(recipe, output_dir, has_eval, precision),
        beta=preference.beta,
        loss_type=[preference.loss_type],
        label_smoothing=preference.label_smoothing,
        # qlora_kit's length policy has already cut every pair to fit (data/preference.py)
        max_length=recipe.data.max_seq_len,
        # the recipe's checkpointing policy is applied to the base before peft wraps it (checkpointing.py)
        activation_checkpointing=False,
    )


def prepare(recipe: Recipe, tokenizer) -> data.PreparedData:
    """The pairs as prompt/chosen/rejected ids, prompts cut to ``preference.max_prompt_len`` tokens."""
    return data.prepare_datasets(recipe.data, tokenizer, recipe.train.seed, recipe.preference.max_prompt_len)


def trainer_parts(recipe: Recipe, tokenizer, output_dir: Path, has_eval: bool, precision: str):
    """(Trainer class, its arguments, the guard class, extra Trainer keyword arguments): TRL's
    DataCollatorForPreference pads the pairs."""
    args = dpo_arguments(recipe, output_dir, has_eval, precision)
    return GuardedDPOTrainer, args, TrainingGuard, {"data_collator": None}


# GuardedTrainer on TRL's DPOTrainer, the reference taken over in __init__ (reference_adapter.py)
GuardedDPOTrainer = reference_trainer(DPOTrainer, __name__, tokenized=True)
