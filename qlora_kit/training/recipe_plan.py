"""What ``qlora-kit plan`` and ``qlora-kit recipes --plan`` plan: a recipe's memory for the batch its run
will have, with the loss head ``memory.chunked_loss`` resolves to, from the config alone or from its data.

It sits in training/ because it reads both the data (data/: its trained share, images, rows' lengths) and
the planner (memory/), as ``pipeline.build`` does before the weights load; the CLI only shows the result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from qlora_kit.memory.loss_choice import HeadChoice, choose_head, with_head
from qlora_kit.memory.planner import Plan, plan
from qlora_kit.recipe.paths import is_local_path
from qlora_kit.registries import objectives

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


@dataclass(frozen=True)
class RecipePlan:
    """The plan, the recipe as planned (its loss head and layout resolved), the head chosen (None: TRL's
    heads) and one line saying which batch layout and attention mask were planned, and from what."""

    plan: Plan
    recipe: Recipe
    head: HeadChoice | None
    batch: str = ""


@dataclass(frozen=True)
class DataFigures:
    """What the data tells the plan: the largest trained share of an example, its most images a row and
    image tokens a row (None: not read, the planner's bounds), and the batch the run will have: packed,
    padded (rows of several lengths: the attention mask kept), its longest row."""

    trained_share: float = 1.0
    images_per_row: int | None = None
    image_tokens: int | None = None
    packed: bool | None = None  # None: the data was not read
    padded: bool = True
    longest: int | None = None
    why: str = ""


def data_is_readable(recipe: Recipe) -> bool:
    """Every path the recipe reads (model and data) is a builtin: name or a local file here: planning from
    them downloads nothing."""
    return all(
        value.startswith("builtin:") or (is_local_path(field, value) and Path(value).expanduser().exists())
        for field, value in recipe.input_paths()
    )


def read_data_figures(recipe: Recipe) -> DataFigures:
    """The recipe's data tokenized as the run tokenizes it (cached for the run) and read for the plan:
    the layout data.packing chooses (auto: the least padding, as a run that does not time them) and the
    rows' lengths."""
    from qlora_kit.data import images, layout
    from qlora_kit.data.prepare import pad_shares, prepare_datasets
    from qlora_kit.model.loading import load_tokenizer

    runs = images.image_runs(recipe.model)
    tokenizer = runs.processor.tokenizer if runs else load_tokenizer(recipe.model)
    prepared = prepare_datasets(recipe.data, tokenizer, recipe.train.seed, runs=runs)
    read = DataFigures(
        prepared.largest_trained_share(), prepared.most_images_per_row(), prepared.most_image_tokens_per_row()
    )
    if objectives.of(recipe).rows != objectives.SEQUENCES:  # pairs and prompts: TRL pads them itself
        return read
    data, batch = recipe.data, recipe.train.micro_batch_size
    chosen = "packing" if data.packing is True else "group_by_length" if data.group_by_length else "padding"
    if data.packing == "auto" and not data.group_by_length:
        shares = pad_shares(prepared, data, batch, recipe.train.seed)
        chosen = layout.choose_layout(shares, layout.allowed_layouts(recipe, prepared))
    if chosen == "packing":
        why = "packed rows (data.packing): their examples' block-diagonal mask"
        return replace(read, packed=True, why=why)
    lengths = prepared.example_lengths
    longest, one_length = max(lengths), min(lengths) == max(lengths)
    mask = "rows of one length: no attention mask" if one_length else "rows padded: their attention mask"
    why = f"{chosen} ({'data.packing' if data.packing != 'auto' else 'data.packing auto, the least padding'})"
    return replace(read, packed=False, padded=not one_length, longest=longest, why=f"{why}, {mask}")


def plan_recipe(
    recipe: Recipe,
    device: str = "cuda",
    budget_gb: float | None = None,
    batch: int | None = None,
    seq: int | None = None,
    processes: int = 1,
    with_data: bool | None = False,
    padded: bool | None = None,
) -> RecipePlan:
    """``recipe`` planned on ``device`` over ``processes`` GPUs at its (or the given) batch x seq; with
    ``with_data`` (None: where it is readable here, ``data_is_readable``) from its data: the chunked
    head's trained share, images, and the batch the run will have (its layout, its longest row, a
    mask only where rows differ in length); else every position trained and rows ``padded`` (None:
    padded, the larger plan). ``memory.chunked_loss: auto`` resolved against ``budget_gb`` (else
    memory.budget_gb)."""
    if with_data is None:
        with_data = batch is None and seq is None and padded is None and data_is_readable(recipe)
    figures = read_data_figures(recipe) if with_data else DataFigures()
    if figures.packed is not None:  # the batch as the data lays it out
        recipe = recipe.model_copy(
            update={"data": recipe.data.model_copy(update={"packing": figures.packed})}
        )
        padded, seq = figures.padded, seq or figures.longest
        line = f"planned the batch from the data: {figures.why}"
    elif padded is None:
        padded = True
        line = (
            "planned rows padded to the batch's longest, with their attention mask (the larger plan): "
            "--no-padded plans rows of one length"
            + ("" if with_data or batch or seq else ", --with-data reads the rows")
        )
    else:
        line = f"planned {'rows padded, with their attention mask' if padded else 'rows of one length, no mask'} (--{'' if padded else 'no-'}padded)"
    chunked = objectives.of(recipe).chunked_head
    share = figures.trained_share if chunked else 1.0  # TRL's heads (DPO, GRPO) keep no selection
    options = {"batch": batch, "seq": seq, "processes": processes, "trained_share": share, "padded": padded}
    options |= {"images_per_row": figures.images_per_row, "image_tokens": figures.image_tokens}
    head = None
    if chunked:  # memory.chunked_loss auto: the head the run would choose
        head = choose_head(recipe, device, budget_gb, **options)
        recipe = with_head(recipe, head.chunked, head.chunk_tokens)
    return RecipePlan(plan(recipe, device=device, **options), recipe, head, line)
