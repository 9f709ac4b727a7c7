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
    auto_layout: str  # what data.packing: auto picks on this data by padding (a run times the layouts)


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
    of tokens (what the family's processor makes of it: placeholders, markers, framing) shown as one mark
    with the image's size and its token count."""
    out: list[tuple[str, bool]] = []
    start = 0
    for path, (at, end) in _image_spans(input_ids, image_runs, row):
        out += _text_runs(input_ids[start:at], labels[start:at], tokenizer)
        out.append((_image_mark(end - at, path), False))
        start = end
    return out + _text_runs(input_ids[start:], labels[start:], tokenizer)


def _image_spans(input_ids: list[int], image_runs, row) -> list[tuple[str, tuple[int, int]]]:
    """Each image of the row with where its run lies in ``input_ids``, found in order."""
    spans, at = [], 0
    for path in (row or {}).get(images.IMAGES_COLUMN) or []:
        run = image_runs.run(images.open_image(path))
        at = next(i for i in range(at, len(input_ids)) if input_ids[i : i + len(run)] == run)
        spans.append((path, (at, at + len(run))))
        at += len(run)
    return spans


def _text_runs(input_ids: list[int], labels: list[int], tokenizer) -> list[tuple[str, bool]]:
    groups: list[tuple[list[int], bool]] = []
    for token, label in zip(input_ids, labels, strict=True):
        trained = label != IGNORE_INDEX
        if groups and groups[-1][1] == trained:
            groups[-1][0].append(token)
        else:
            groups.append(([token], trained))
    return [(tokenizer.decode(ids), trained) for ids, trained in groups]


def _image_mark(tokens: int, path: str) -> str:
    with Image.open(path) as image:
        return f"[image {image.width}x{image.height}: {tokens} tokens]"
