"""``train.objective: kto``: TRL's KTOTrainer with everything ``GuardedTrainer`` adds to a run.

KTO (Ethayarajh et al., 2024) learns from unpaired feedback: a prompt, one answer and a label saying
whether the answer was desirable (a thumbs-up) or not; what production feedback looks like, where a
second answer to compare with is rarely at hand. Rows are format ``feedback`` (prompt, completion, label:
texts) or ``feedback_chat`` (the prompt a conversation, the completion the assistant's reply: TRL's
conversational unpaired rows, which TRL renders with the chat template).
Each answer's implied reward is beta * log(policy / reference) of the answer given its prompt; the loss
pushes the desirable answers' reward above, and the undesirable ones' below, a baseline KL estimated from
mismatched prompt/answer pairs of the same batch (TRL rotates the answers within each micro-batch, so the
Trainer reads the rows in order: they are shuffled here once, with the recipe's seed).

``GuardedKTOTrainer`` is ``GuardedTrainer`` on top of TRL's ``KTOTrainer``, as dpo.py does for DPO, with
the same changes to TRL's behaviour and for the same reasons (reference_adapter.py's
``take_over_reference``): the reference is a frozen second adapter "ref" on the same 4-bit base (the
base itself without ``model.adapter``), the policy gets its fp32 LoRA weights back after TRL's bf16
cast, the recipe's checkpointing is left alone around the reference forward, and TRL's telemetry ping
is not sent. TRL tokenizes the rows (a text answer with the tokenizer's
EOS, a conversation by the chat template; ``token_ids`` does it as TRL does for the data report and
``qlora-kit eval``, data/feedback.py); ``preference.beta`` is KTO's beta.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl import KTOConfig, KTOTrainer

from qlora_kit.data import feedback
from qlora_kit.data.mixture import PreparedData
from qlora_kit.errors import RecipeError
from qlora_kit.recipe.preference import PreferenceSection
from qlora_kit.training.objectives.reference_adapter import reference_trainer
from qlora_kit.training.step.arguments import training_settings
from qlora_kit.training.step.guards import TrainingGuard

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def prepare(recipe: Recipe, tokenizer) -> PreparedData:
    """The labelled answers as TRL's text columns, through the data path every objective takes
    (data/feedback.py)."""
    return feedback.prepare_feedback(recipe.data, tokenizer, recipe.train.seed)


def kto_arguments(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str) -> KTOConfig:
    """TRL's KTOConfig: the Trainer's arguments from the recipe plus preference.beta."""
    if recipe.preference.loss_type != PreferenceSection().loss_type:
        raise RecipeError(
            f"preference.loss_type: {recipe.preference.loss_type} is DPO's; train.objective kto has its own loss"
        )
    if recipe.train.micro_batch_size < 2:
        raise RecipeError(
            "train.micro_batch_size: train.objective kto needs at least 2 rows per micro-batch (its KL "
            f"baseline pairs each answer with another row's prompt; got {recipe.train.micro_batch_size})"
        )
    settings: dict[str, Any] = training_settings(recipe, output_dir, has_eval, precision)
    # the KL baseline rotates the answers within each micro-batch as prepared: rows are read in order
    settings["train_sampling_strategy"] = "sequential"
    return KTOConfig(
        **settings,
        beta=recipe.preference.beta,
        max_length=recipe.data.max_seq_len,
    )


def trainer_parts(recipe: Recipe, tokenizer, output_dir: Path, has_eval: bool, precision: str):
    """(Trainer class, its arguments, the guard class, extra Trainer keyword arguments): TRL's
    DataCollatorForUnpairedPreference pads the rows."""
    return GuardedKTOTrainer, kto_arguments(recipe, output_dir, has_eval, precision), TrainingGuard, {}


# GuardedTrainer on TRL's KTOTrainer, the reference taken over in __init__ (reference_adapter.py)
GuardedKTOTrainer = reference_trainer(KTOTrainer, __name__)
