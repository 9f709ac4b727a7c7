"""What training will see: ``qlora-kit data RECIPE`` renders examples with the trained part marked,
token-length percentiles, what the length policy does to each source, the padding share of each
batching mode, and the preflight checks' results (preflight.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image

from qlora_kit.data import images, layout, preflight, prepare
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.registries import objectives

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

PERCENTILES = (50, 90, 99)


@dataclass
class DataView:
    examples: list[list[tuple[str, bool]]]  # each example as (text, trained) runs
    reports: list[prepare.LengthReport]
    percentiles: dict[str, int]
    pad_share: dict[str, float]  # batching mode -> share of pad tokens
    checks: list[preflight.Check]
    auto_layout: str  # what data.packing: auto picks on this data


def inspect_data(recipe: Recipe, tokenizer, count: int = 3) -> DataView:
    # Examples one by one: packed rows would show several examples glued together.
    unpacked = recipe.data.model_copy(update={"packing": False})
    pairs = objectives.of(recipe).rows == objectives.PAIRS
    prompt_limit = recipe.preference.max_prompt_len if pairs else None
    runs = None if pairs else images.image_runs(recipe.model)  # a vision-language model's image rows
    prepared = prepare.prepare_datasets(unpacked, tokenizer, recipe.train.seed, prompt_limit, runs=runs)
    train = prepared.train
    shown = [train[i] for i in range(min(count, len(train)))]
    examples = [
        _pair_runs(row, tokenizer) if pairs else _runs(row["input_ids"], row["labels"], tokenizer, runs, row)
        for row in shown
    ]
    lengths = [n for report in prepared.train_reports for n in report.lengths]
    cuts = statistics.quantiles(lengths, n=100, method="inclusive") if len(lengths) > 1 else [lengths[0]] * 99
    percentiles = {f"p{p}": round(cuts[p - 1]) for p in PERCENTILES} | {"max": max(lengths)}
    shares = prepare.pad_shares(prepared, unpacked, recipe.train.micro_batch_size, recipe.train.seed)
    # what data.packing: auto would choose (the view shows it beside the shares)
    auto = layout.choose_layout(shares, ("padding",) if pairs else layout.AUTO)
    collator = None if pairs else prepare.build_collator(tokenizer, packing=False)
    checks = preflight.run_checks(prepared, recipe.data, tokenizer, collator)
    return DataView(examples, prepared.reports, percentiles, shares, checks, auto)


def _pair_runs(row: dict[str, list[int]], tokenizer) -> list[tuple[str, bool]]:
    """A preference pair as the prompt, then the chosen and the rejected answer, both trained."""
    return [
        (tokenizer.decode(row["prompt_ids"]), False),
        (tokenizer.decode(row["chosen_ids"]), True),
        ("\n(rejected:) ", False),
        (tokenizer.decode(row["rejected_ids"]), True),
    ]


def _runs(
    input_ids: list[int], labels: list[int], tokenizer, image_runs=None, row=None
) -> list[tuple[str, bool]]:
    """Consecutive tokens grouped by whether they are trained, each group decoded to text; an image's run
    of tokens shown as one mark with the image's size and its token count."""
    runs: list[tuple[list[int], bool]] = []
    marker = image_runs.marker_id if image_runs is not None else None
    for token, label in zip(input_ids, labels, strict=True):
        trained = label != IGNORE_INDEX
        image = token == marker
        if runs and runs[-1][1] == trained and (runs[-1][0][-1] == marker) == image:
            runs[-1][0].append(token)
        else:
            runs.append(([token], trained))
    files = iter((row or {}).get(images.IMAGES_COLUMN) or [])
    return [
        (_image_mark(ids, next(files, None)) if ids[0] == marker else tokenizer.decode(ids), trained)
        for ids, trained in runs
    ]


def _image_mark(ids: list[int], path: str | None) -> str:
    size = ""
    if path is not None:
        with Image.open(path) as image:
            size = f" {image.width}x{image.height}"
    return f"[image{size}: {len(ids)} tokens]"
