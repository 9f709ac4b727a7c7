"""What ``qlora-kit plan`` and ``qlora-kit recipes --plan`` plan: a recipe's memory for the batch its run
will have, with the loss head ``memory.chunked_loss`` resolves to, from the config alone or from its data.

It sits in training/ because it reads both the data (data/: its trained share, images, rows' lengths) and
the planner (memory/), as ``pipeline.build`` does before the weights load; the CLI only shows the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qlora_kit.memory.loss_choice import HeadChoice, choose_head, with_head
from qlora_kit.memory.planner import Plan, plan
from qlora_kit.registries import objectives

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


@dataclass(frozen=True)
class RecipePlan:
    """The plan, the recipe as planned (its loss head resolved) and the head chosen (None: TRL's heads)."""

    plan: Plan
    recipe: Recipe
    head: HeadChoice | None


@dataclass(frozen=True)
class DataFigures:
    """What the data tells the plan: the largest trained share of an example, its most images a row and
    image tokens a row (None: not read, the planner's bounds)."""

    trained_share: float = 1.0
    images_per_row: int | None = None
    image_tokens: int | None = None


def read_data_figures(recipe: Recipe) -> DataFigures:
    """The recipe's data tokenized as the run tokenizes it (cached for the run) and read for the plan."""
    from qlora_kit.data import images
    from qlora_kit.data.prepare import prepare_datasets
    from qlora_kit.model.loading import load_tokenizer

    runs = images.image_runs(recipe.model)
    tokenizer = runs.processor.tokenizer if runs else load_tokenizer(recipe.model)
    prepared = prepare_datasets(recipe.data, tokenizer, recipe.train.seed, runs=runs)
    return DataFigures(
        prepared.largest_trained_share(), prepared.most_images_per_row(), prepared.most_image_tokens_per_row()
    )


def plan_recipe(
    recipe: Recipe,
    device: str = "cuda",
    budget_gb: float | None = None,
    batch: int | None = None,
    seq: int | None = None,
    processes: int = 1,
    with_data: bool = False,
) -> RecipePlan:
    """``recipe`` planned on ``device`` over ``processes`` GPUs at its (or the given) batch x seq; with
    ``with_data`` from its data (the chunked head's trained share, images), else every position trained;
    ``memory.chunked_loss: auto`` resolved against ``budget_gb`` (else memory.budget_gb)."""
    spec = objectives.of(recipe)
    figures = DataFigures()
    if with_data and spec.chunked_head:  # TRL's heads (DPO, GRPO) keep no selection
        figures = read_data_figures(recipe)
    options = {"batch": batch, "seq": seq, "processes": processes, "trained_share": figures.trained_share}
    options |= {"images_per_row": figures.images_per_row, "image_tokens": figures.image_tokens}
    head = None
    if spec.chunked_head:  # memory.chunked_loss auto: the head the run would choose
        head = choose_head(recipe, device, budget_gb, **options)
        recipe = with_head(recipe, head.chunked, head.chunk_tokens)
    return RecipePlan(plan(recipe, device=device, **options), recipe, head)
