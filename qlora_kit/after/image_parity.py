"""The parity report's prompts for a vision-language run: its image rows, asked through the vision path.

A vision-language run's rows hold images (data/images.py), so their prompts cannot be re-read as text:
the prompt is the prepared row's tokens before its first trained label (the image runs included, as the
family's processor made them), the answer is that first answer's trained tokens, and the row's image files
go beside them, as ``qlora-kit eval`` asks them (after/image_eval.py). Each reader makes the images'
pixels with its own processor (``ImageInputs``): the trained model's from the run's base, a merged
folder's from the folder, so a processor saved wrong is part of what the report measures.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from qlora_kit.after.image_eval import prompt_and_answer
from qlora_kit.data import images, prepare
from qlora_kit.errors import RecipeError


@dataclass
class ImagePrompts:
    prompts: list[list[int]]  # the prompt's ids, image runs included
    answers: list[list[int]]  # the first answer's trained ids
    images: list[tuple[str, ...]]  # each prompt's image files, in order
    texts: list[str]  # the prompt decoded, for the report
    source: str


def image_prompts(recipe, runs: images.ImageRuns, tokenizer, count: int) -> ImagePrompts:
    """The first ``count`` validation rows (one example a row, as eval asks them), or a fixed seeded sample
    of the training rows for a run without validation rows."""
    prepared = prepare.prepare_datasets(
        images.one_example_a_row(recipe.data), tokenizer, recipe.train.seed, runs=runs
    )
    if prepared.val is not None and len(prepared.val):
        rows, source = prepared.val.select(range(min(count, len(prepared.val)))), "validation rows"
    else:
        chosen = sorted(random.Random(recipe.train.seed).sample(range(len(prepared.train)), count))
        rows = prepared.train.select(chosen)
        named = ", ".join(str(i + 1) for i in chosen)
        source = f"training rows {named} (seed {recipe.train.seed}; the run has no validation rows)"
    if not len(rows):
        raise RecipeError("export: the run's recipe names no rows to take parity prompts from")
    made = ImagePrompts([], [], [], [], source)
    for row in rows:
        first, answer = prompt_and_answer(row["labels"])
        made.prompts.append(list(row["input_ids"][:first]))
        made.answers.append(answer)
        made.images.append(tuple(row[images.IMAGES_COLUMN] or ()))
        made.texts.append(tokenizer.decode(row["input_ids"][:first]))
    return made


class ImageInputs:
    """A model's inputs for a prompt's ids and image files, made by ``runs``' processor: the pixels, and
    the token types and grids its family's model takes (data/images.py ``ImageRuns.model_inputs``)."""

    def __init__(self, runs: images.ImageRuns) -> None:
        self.runs = runs

    def __call__(self, ids: torch.Tensor, files: tuple[str, ...]) -> dict:
        pictures = [images.open_image(Path(file)) for file in files]
        made = self.runs.model_inputs(ids, pictures)
        return {"input_ids": ids, **{k: v.to(ids.device) for k, v in made.items()}}


def folder_inputs(folder: Path, config) -> ImageInputs | None:
    """A merged folder's own processor as ``ImageInputs`` (None for a text-only model)."""
    from qlora_kit.model import vision

    facet = vision.vision_of(config)
    if facet is None:
        return None
    processor = vision.load_processor(str(folder), vision=facet)
    return ImageInputs(images.ImageRuns(processor, facet, config if facet.mrope else None))
