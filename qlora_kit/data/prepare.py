"""Data stage for SFT, DPO and ORPO: each source's rows (sources.py) tokenized with masked labels in its own
format under the length policy, through the data path every objective takes (mixture.py: the split, the
mixture of sources, data.dedup), and the collator (padding, or packing without padding).

Tokenization runs through ``Dataset.map``, whose fingerprinted cache lets a second run of the same
recipe skip it; one row's tokens, labels and facts are ``row_tokens.py``'s.
Any problem with the user's data is one ``DataError`` line naming the file, the row (1-based, in file
order) and what is wrong.
"""

from __future__ import annotations

import random
from pathlib import Path

from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from qlora_kit.data import images, preference, row_tokens, sources
from qlora_kit.data import mixture as mixture_of
from qlora_kit.data.errors import diagnose_load_failure
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.images import ImageRuns
from qlora_kit.data.mixture import LengthReport, PreparedData
from qlora_kit.data.packing import (
    FlattenedRowsCollator,
    PackedRowCollator,
    best_fit_decreasing,
    examples_per_batch,
    pack_dataset,
)
from qlora_kit.errors import DataError
from qlora_kit.recipe.recipe import DataSection
from qlora_kit.registries import attention
from qlora_kit.registries.formats import FORMATS

__all__ = ["DataError", "LengthReport", "PreparedData", "build_collator", "prepare_datasets"]


def prepare_datasets(
    data: DataSection, tokenizer, seed: int, max_prompt_len: int | None = None, runs: ImageRuns | None = None
) -> PreparedData:
    """Tokenized (and, with data.packing, packed) train and validation sets for the Trainer: each source
    loaded and tokenized in its own format, then mixed (data.sources) and deduplicated (data.dedup).
    Preference pairs become prompt/chosen/rejected ids, prompts cut to ``max_prompt_len`` tokens. ``runs``:
    a vision-language model's image runs (images.py); chat rows may then hold images."""

    def tokenized(rows: Dataset, fmt: str, source: str) -> tuple[Dataset, LengthReport]:
        return _tokenize_rows(rows, data, fmt, tokenizer, source, max_prompt_len, runs)

    mixture = mixture_of.mix_sources(data, seed, tokenized, number_as=row_tokens.ROW)
    train, val = mixture.train, mixture.val
    val = _facts_removed(val) if val is not None else None
    lengths = list(train["length"])
    checks = train.select_columns([*row_tokens.FACTS, "length"])
    train = _facts_removed(train)
    if data.packs:  # auto: resolved after tokenizing, by data/layout.py
        train = pack_dataset(train, data.max_seq_len)
        val = pack_dataset(val, data.max_seq_len) if val is not None else None
    dynamic = runs is not None and runs.vision.dynamic_resolution
    image_token = runs.marker_id if dynamic else None
    return mixture.prepared(train, val, lengths, checks=checks, image_token=image_token)


def _facts_removed(dataset: Dataset) -> Dataset:
    model_columns = ("input_ids", "labels", images.IMAGES_COLUMN, *preference.PAIR_COLUMNS)
    return dataset.remove_columns([c for c in dataset.column_names if c not in model_columns])


def pad_shares(prepared: PreparedData, data: DataSection, batch_size: int, seed: int) -> dict[str, float]:
    """Share of pad tokens per batch for each batching mode, on this data."""
    lengths = prepared.example_lengths
    rows = [len(ids) for ids in prepared.train["input_ids"]] if data.packs else None
    if rows is None:
        packed = best_fit_decreasing(lengths, data.max_seq_len)
        rows = [sum(lengths[i] for i in members) for members in packed]
    return {
        "padding": pad_share(lengths, batch_size, group_by_length=False, seed=seed),
        "group_by_length": pad_share(lengths, batch_size, group_by_length=True, seed=seed),
        "packing": pad_share(rows, batch_size, group_by_length=False, seed=seed),
    }


def _tokenize_rows(
    rows: Dataset,
    data: DataSection,
    fmt: str,
    tokenizer,
    source: str,
    max_prompt_len: int | None,
    runs: ImageRuns | None = None,
) -> tuple[Dataset, LengthReport]:
    """A source's rows tokenized (pairs or single examples) under the length policy, with the facts the
    preflight and the report read; rows left with no trained token are dropped."""
    if len(rows) == 0:
        raise DataError(f"{source}: no rows")
    row_tokens.check_columns(rows, fmt, source)
    row_tokenizer = row_tokens.RowTokenizer(data, fmt, tokenizer, source, max_prompt_len, runs)
    try:
        with sources.quiet_datasets():
            tokenized = rows.map(
                row_tokenizer.pair if FORMATS[fmt].pairs else row_tokenizer.example,
                with_indices=True,
                remove_columns=rows.column_names,
                writer_batch_size=examples_per_batch(data.max_seq_len),
                desc="tokenizing",
            )
    except UnicodeDecodeError as exc:  # arrow defers decoding a JSON file's strings until a row is read
        raise diagnose_load_failure(Path(source), source, exc) from None
    report = _length_report(tokenized, source, data)
    keep = [i for i, count in enumerate(tokenized["trained_tokens"]) if count]
    if len(keep) < len(tokenized):
        tokenized = tokenized.select(keep)
    return tokenized, report


def _length_report(tokenized: Dataset, source: str, data: DataSection) -> LengthReport:
    """What the length policy did to a source; a source with no trained token left is refused."""
    max_len, drop = data.max_seq_len, data.overlong == "drop"
    lengths, trained_counts = tokenized["full_length"], tokenized["trained_tokens"]
    report = LengthReport(source=source, rows=len(lengths), lengths=lengths)
    report.truncated = 0 if drop else sum(n > max_len for n in lengths)
    report.dropped = sum(n > max_len for n in lengths) if drop else 0
    report.untrainable = sum(
        1
        for n, count in zip(lengths, trained_counts, strict=True)
        if not count and not (drop and n > max_len)
    )
    report.trained_tokens = sum(trained_counts)
    if not report.trained_tokens:
        raise DataError(
            f"{source}: every row is over data.max_seq_len={max_len} tokens or has no trained token left "
            f"(longest {max(lengths)}, shortest {min(lengths)})"
        )
    return report


def build_collator(tokenizer, packing: bool, attn_implementation: str = "sdpa"):
    """Packed rows, or packed rows flattened into one sequence for a flash kernel (see packing.py), or
    examples padded to the longest in the batch with -100 labels."""
    if packing and attention.kernel(attn_implementation).packing == "flattened":
        return FlattenedRowsCollator()
    if packing:
        return PackedRowCollator(tokenizer.pad_token_id)
    return DataCollatorForSeq2Seq(
        tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt"
    )


def epoch_batches(
    lengths: list[int], batch_size: int, group_by_length: bool, seed: int = 0, group_size: int | None = None
) -> list[list[int]]:
    """An epoch's batches of example indices in the Trainer's order: shuffled from the seed, or for
    group_by_length transformers' own (sorted within megabatches of up to 50 groups of ``group_size``,
    the global batch, default ``batch_size``; drawn from the seed, as ``training/step/trainer.py`` draws it)."""
    if group_by_length:
        import torch
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator().manual_seed(seed)
        order = get_length_grouped_indices(lengths, group_size or batch_size, generator=generator)
    else:
        order = random.Random(seed).sample(range(len(lengths)), len(lengths))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def pad_share(lengths: list[int], batch_size: int, group_by_length: bool, seed: int = 0) -> float:
    """Share of padding tokens when batches of ``batch_size`` are padded to their longest example, in the
    Trainer's order (``epoch_batches``; a whole-set sort would claim far less padding than a run gets)."""
    padded = real = 0
    for batch in epoch_batches(lengths, batch_size, group_by_length, seed):
        padded += max(lengths[i] for i in batch) * len(batch)
        real += sum(lengths[i] for i in batch)
    return 1 - real / padded if padded else 0.0
