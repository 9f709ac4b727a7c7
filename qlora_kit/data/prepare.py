"""Data stage: each source's rows (sources.py) tokenized with masked labels in its own format, the
length policy, the split, the mixture of sources, and the collator (padding, or packing without padding).

Tokenization runs through ``Dataset.map``, whose fingerprinted cache lets a second run of the same
recipe skip it; one row's tokens, labels and facts are ``row_tokens.py``'s.
Any problem with the user's data is one ``DataError`` line naming the file, the row (1-based, in file
order) and what is wrong.
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from qlora_kit.data import images, preference, row_tokens, sources
from qlora_kit.data.errors import diagnose_load_failure
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.images import ImageRuns
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

log = logging.getLogger(__name__)

__all__ = ["DataError", "LengthReport", "PreparedData", "build_collator", "prepare_datasets"]


@dataclass
class LengthReport:
    """What the length policy did to one split of one source, and what it trains."""

    source: str
    rows: int
    truncated: int = 0
    dropped: int = 0
    untrainable: int = 0  # rows left with no trained token (their response was cut off)
    lengths: list[int] = field(default_factory=list)  # token lengths before truncation
    trained_tokens: int | None = 0  # in the rows kept; None: sampled in training (GRPO's completions)
    taken: int | None = None  # rows in the mixture (data.sources: sampled by weight or rows)

    def summary(self) -> str:
        kept = self.rows - self.dropped - self.untrainable
        text = (
            f"{self.source}: {kept} of {self.rows} rows kept; {self.truncated} truncated, "
            f"{self.dropped} dropped as too long, {self.untrainable} without a trained token"
        )
        if self.taken is not None:
            text += f"; {self.taken} rows in the mixture"
        if self.trained_tokens is None:  # prompts only: what trains is sampled when the run trains
            return text + "; the trained tokens are the completions sampled in training"
        return text + f"; {self.trained_tokens:,} trained tokens"


@dataclass
class PreparedData:
    train: Dataset  # packed rows when data.packing, else one example per row
    val: Dataset | None
    reports: list[LengthReport]
    example_lengths: list[int]  # token counts of the training examples kept, before any packing
    val_rows: Dataset | None = None  # the validation rows as loaded, for prompts and references
    val_format: str = "alpaca"  # the format of val_rows
    checks: Dataset | None = None  # per-example facts of the training set, for the preflight
    sources: int = 1  # the first `sources` reports are the training sources'
    image_token: int | None = None  # a dynamic-resolution family's image token (its count follows the image)

    @property
    def train_reports(self) -> list[LengthReport]:
        return self.reports[: self.sources]

    def largest_trained_share(self) -> float:
        """The largest share of one training example's tokens that are trained: no micro-batch, packed or
        padded, trains more than this share of its positions (the planner's bound for what the chunked
        loss head keeps). For single examples (a pair's facts count its answers, not its positions)."""
        if self.checks is None or "length" not in self.checks.column_names:
            return 1.0
        facts = self.checks.select_columns(["trained_tokens", "length"])
        shares = [t / n for t, n in zip(facts["trained_tokens"], facts["length"], strict=True) if n]
        return max(shares, default=1.0)

    def most_images_per_row(self) -> int | None:
        """A vision-language model's rows: the most images one training row holds (packed rows: all their
        examples' images); None for text rows. The planner sizes the batch's pixels and the vision tower's
        activations by it."""
        if images.IMAGES_COLUMN not in self.train.column_names:
            return None
        return max((len(files or []) for files in self.train[images.IMAGES_COLUMN]), default=0) or None

    def most_image_tokens_per_row(self) -> int | None:
        """A dynamic-resolution family's rows (Qwen-VL): the most image tokens one training row holds, which
        its images' sizes set; None for other rows. The planner sizes the batch's patches by it."""
        if self.image_token is None:
            return None
        return max((ids.count(self.image_token) for ids in self.train["input_ids"]), default=0) or None


def prepare_datasets(
    data: DataSection, tokenizer, seed: int, max_prompt_len: int | None = None, runs: ImageRuns | None = None
) -> PreparedData:
    """Tokenized (and, with data.packing, packed) train and validation sets for the Trainer: each source
    loaded and tokenized in its own format, then mixed (data.sources) and deduplicated (data.dedup).
    Preference pairs become prompt/chosen/rejected ids, prompts cut to ``max_prompt_len`` tokens. ``runs``:
    a vision-language model's image runs (images.py); chat rows may then hold images."""
    _tokenized = functools.partial(_tokenize_rows, max_prompt_len=max_prompt_len, runs=runs)
    parts, train_reports, val_reports, val_parts = [], [], [], []
    val_rows, val_format = None, data.format
    for source in data.source_list():
        fmt = data.format_of(source)
        split = sources.split_source(source, data, seed, number_as=row_tokens.ROW)
        tokenized, report = _tokenized(split.rows, data, fmt, tokenizer, split.train_from)
        parts.append(tokenized)
        train_reports.append(report)
        if split.held_out is not None:
            val, val_report = _tokenized(split.held_out, data, fmt, tokenizer, split.held_from)
            val_parts.append(val)
            val_reports.append(val_report)
            if val_rows is None:
                val_rows, val_format = split.held_out, fmt
    if data.val_path is not None:
        val_rows = sources.load_val_rows(data)
        val, val_report = _tokenized(val_rows, data, data.format, tokenizer, data.val_path)
        val_parts, val_format, val_reports = [val], data.format, [val_report]
    train = _mix(parts, data, seed, train_reports)
    val = _facts_removed(datasets.concatenate_datasets(val_parts)) if val_parts else None
    lengths = list(train["length"])
    checks = train.select_columns([*row_tokens.FACTS, "length"])
    train = _facts_removed(train)
    if data.packs:  # auto: resolved after tokenizing, by data/layout.py
        train = pack_dataset(train, data.max_seq_len)
        val = pack_dataset(val, data.max_seq_len) if val is not None else None
    reports = train_reports + val_reports
    dynamic = runs is not None and runs.vision.dynamic_resolution
    image_token = runs.marker_id if dynamic else None
    return PreparedData(
        train, val, reports, lengths, val_rows, val_format, checks, len(train_reports), image_token
    )


def _mix(parts: list[Dataset], data: DataSection, seed: int, reports: list[LengthReport]) -> Dataset:
    """One training set from the sources' tokenized examples: a source with ``rows`` gives that many, the
    weighted sources share their total row count by weight, the others give all of theirs; rows are
    sampled seeded (repeated only when a source has fewer than asked). Then data.dedup. ``reports``:
    the sources' training reports, in order; each is told how many rows its source gave."""
    sources = data.source_list()
    weighted = [i for i, s in enumerate(sources) if s.weight is not None]
    pool = sum(len(parts[i]) for i in weighted)
    total_weight = sum(sources[i].weight for i in weighted)
    chosen = []
    for number, (part, source, report) in enumerate(zip(parts, sources, reports, strict=True)):
        wanted = len(part)
        if source.rows is not None:
            wanted = source.rows
        elif source.weight is not None:
            wanted = round(pool * source.weight / total_weight)
        chosen.append(_sample(part, wanted, seed + number))
        if data.sources:
            report.taken = wanted
    mixed = datasets.concatenate_datasets(chosen) if len(chosen) > 1 else chosen[0]
    if data.dedup:
        seen: set[str] = set()
        keep = [i for i, d in enumerate(mixed["digest"]) if not (d in seen or seen.add(d))]
        if len(keep) < len(mixed):
            log.info("data.dedup: %d repeated examples left out of %d", len(mixed) - len(keep), len(mixed))
            mixed = mixed.select(keep)
    return mixed


def _sample(part: Dataset, wanted: int, seed: int) -> Dataset:
    if wanted == len(part):
        return part
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < wanted:  # without repeats while the source has rows to give
        order += rng.sample(range(len(part)), min(wanted - len(order), len(part)))
    return part.select(order)


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
