"""``train.objective: dpo``: TRL's DPOTrainer with everything ``GuardedTrainer`` adds to a run.

``GuardedDPOTrainer`` is ``GuardedTrainer`` on top of TRL's ``DPOTrainer`` (one class each, nothing
copied): the guards, the memory and throughput accounting, atomic checkpoints, the adapter-only save and
a resumed paged optimizer all come from GuardedTrainer; the pair loss, the reference log-probabilities
and the reward metrics from TRL.

The reference policy is never a second copy of the 4-bit base. TRL copies the trained adapter
("default") into a frozen second adapter named "ref" on the same base when the trainer is built, and
computes each step's reference log-probabilities with "ref" active: with ``model.adapter`` that is the
SFT adapter, without it the freshly initialised adapter (B = 0), i.e. the base itself.

What this module changes in TRL's behaviour, and why:
- TRL casts a quantized model's trainable parameters to bf16 after making the "ref" copy; the policy
  gets its fp32 values back from "ref" (bit-exact), as QLoRA keeps LoRA weights and the optimizer in
  fp32 (bf16 weights lose small DPO updates to rounding).
- TRL turns checkpointing off and on around each reference forward with transformers' defaults, which
  would replace the recipe's policy (every_n) by "every layer" and add an input-gradient hook each step;
  the reference forward runs without grad, where checkpointing saves nothing, so it is left alone.
- The data arrive tokenized by qlora_kit (data/preference.py); TRL does not tokenize them again.
- TRL's telemetry ping at construction is not sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from trl import DPOConfig, DPOTrainer

from qlora_kit.data import prepare as data
from qlora_kit.training.step import private_hooks
from qlora_kit.training.step.guards import TrainingGuard
from qlora_kit.training.step.trainer import GuardedTrainer, training_settings

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

POLICY, REFERENCE = "default", "ref"  # TRL's adapter names (DPOTrainer.__init__)


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


@private_hooks.checked
class GuardedDPOTrainer(GuardedTrainer, DPOTrainer):
    """DPOTrainer with qlora_kit's guards, accounting and checkpoint layout (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.policy_restored = _policy_back_to_fp32(self.model)
        # TRL's reference forward toggles checkpointing when this says True (see the module docstring)
        self.model.is_gradient_checkpointing = False

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # prompt_ids / chosen_ids / rejected_ids from data/preference.py

    def _send_telemetry(self) -> None:
        pass

    def reference_description(self, adapter: str | None) -> str:
        return describe_reference(adapter)


def describe_reference(adapter: str | None) -> str:
    """What the frozen reference policy is (DPO's and KTO's: a second adapter on the same 4-bit base)."""
    if adapter is None:
        return "the base model (the reference adapter is the new adapter's start, B = 0)"
    return f"the starting adapter {adapter}, frozen as a second adapter named {REFERENCE!r} on the same 4-bit base"


def _policy_back_to_fp32(model) -> int:
    """Give the trained adapter back the fp32 values TRL copied into "ref" before casting it to bf16."""
    restored = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad or f".{POLICY}." not in name:
                continue
            reference = model.get_parameter(name.replace(f".{POLICY}.", f".{REFERENCE}."))
            if parameter.dtype != reference.dtype:
                parameter.data = reference.data.clone()
                restored += 1
    return restored
