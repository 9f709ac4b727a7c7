"""``train.objective: sft``: supervised fine-tuning on the trained tokens of each row, on ``GuardedTrainer``.

The objective table's module for sft (registries/objectives.py): its data (tokenized rows, packed or
padded), its arguments (the Trainer's, from the recipe) and its Trainer with qlora_kit's collator.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qlora_kit.data import images
from qlora_kit.data import prepare as data
from qlora_kit.errors import RecipeError
from qlora_kit.model import loading, recurrent
from qlora_kit.training.step.arguments import training_arguments
from qlora_kit.training.step.guards import TrainingGuard
from qlora_kit.training.step.trainer import GuardedTrainer

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def prepare(recipe: Recipe, tokenizer) -> data.PreparedData:
    """Tokenized (and with data.packing, packed) rows, each with its trained tokens labelled; for a
    vision-language model, chat rows with their images (data/images.py)."""
    runs = images.image_runs(recipe.model)
    refusal = None
    if recipe.data.packs:  # a model whose layers carry a state along the row, or image rows it cannot pack
        refusal = recurrent.packing_refusal(loading.load_config(recipe.model))
        if runs is not None:
            refusal = refusal or images.packing_refusal(runs.vision, recipe.model.attn_implementation)
    if refusal:
        raise RecipeError(f"data.packing: {refusal}; set data.packing to false or auto")
    return data.prepare_datasets(recipe.data, tokenizer, recipe.train.seed, runs=runs)


def trainer_parts(recipe: Recipe, tokenizer, output_dir: Path, has_eval: bool, precision: str):
    """(Trainer class, its arguments, the guard class, extra Trainer keyword arguments)."""
    args = training_arguments(recipe, output_dir, has_eval, precision)
    collator = data.build_collator(tokenizer, recipe.data.packs, recipe.model.attn_implementation)
    runs = images.image_runs(recipe.model)
    if runs is not None:  # the images' pixels join each padded batch; the Trainer keeps their column
        collator = images.ImageCollator(collator, runs)
        args.remove_unused_columns = False
    return GuardedTrainer, args, TrainingGuard, {"data_collator": collator}
