"""The one data path every objective takes: each source split (its own validation rows, data.val_fraction
or data.val_path), turned into the objective's rows, mixed (a source's ``weight`` or ``rows``),
deduplicated (data.dedup) and reported, source by source.

An objective gives only its row format: a function from a source's rows to its own rows (with a
``digest`` column naming a row's content, for data.dedup) and that source's ``LengthReport``. SFT, DPO
and ORPO tokenize (prepare.py), GRPO keeps prompts and references as text (prompts.py), KTO keeps
TRL's labelled texts (feedback.py); ``qlora-kit data`` and a run count the same mixture.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import datasets
from datasets import Dataset

from qlora_kit.data import images, sources
from qlora_kit.recipe.recipe import DataSection

log = logging.getLogger(__name__)

DIGEST = "digest"  # the column a row format names a row's content in (what data.dedup compares)


@dataclass
class InMixture:
    """What the mixture trains from one source: its rows left after data.dedup, their trained tokens (None:
    sampled in training) and their labels (the objective's phrase, '' where it has none)."""

    rows: int
    trained_tokens: int | None
    labels: str = ""


@dataclass
class LengthReport:
    """What the length policy did to one split of one source, what the source holds, and (data.sources)
    what the mixture trains from it."""

    source: str
    rows: int
    truncated: int = 0
    dropped: int = 0
    untrainable: int = 0  # rows left with no trained token (their response was cut off)
    lengths: list[int] = field(default_factory=list)  # token lengths before truncation
    trained_tokens: int | None = 0  # in the rows kept; None: sampled in training (GRPO's completions)
    taken: int | None = None  # rows in the mixture (data.sources: sampled by weight or rows)
    repeats: int | None = None  # data.dedup: the mixture's rows of this source left out as repeats
    labels: str = ""  # what the rows are, where the objective says (KTO's desirable and undesirable)
    # the objective's phrase for a set of its rows' labels (KTO's), for what the mixture trains
    label_phrase: Callable[[Dataset], str] | None = None
    trains: InMixture | None = None  # data.sources: what the mixture trains from this source

    def summary(self) -> str:
        kept = self.rows - self.dropped - self.untrainable
        text = (
            f"{self.source}: {kept} of {self.rows} rows kept; {self.truncated} truncated, "
            f"{self.dropped} dropped as too long, {self.untrainable} without a trained token"
        )
        if self.trained_tokens is None:  # prompts only: what trains is sampled when the run trains
            text += "; the trained tokens are the completions sampled in training"
        else:
            text += f"; {self.trained_tokens:,} trained tokens{self.labels}"
        if self.taken is not None:
            text += f"; {self.taken} rows in the mixture"
        if self.repeats is not None:
            text += f", {self.repeats} left out as repeats"
        if self.trains is not None:
            trains = self.trains
            tokens = "" if trains.trained_tokens is None else f", {trains.trained_tokens:,} trained tokens"
            text += f": the mixture trains {trains.rows} of its rows{tokens}{trains.labels}"
        return text


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


def text_digest(*values) -> str:
    """A row format's digest of rows kept as text (GRPO's prompts, KTO's answers): its values, in order;
    a conversation's messages count with their roles."""
    text = json.dumps(values, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


# (a source's rows, their format, where they were read) -> the objective's rows and the source's report
RowFormat = Callable[[Dataset, str, str], tuple[Dataset, LengthReport]]


@dataclass
class Mixture:
    """The sources' rows in an objective's format: the training mixture (with its ``digest`` column), the
    validation rows (each source's held-out rows, or data.val_path's), and each one's report."""

    train: Dataset
    val: Dataset | None
    train_reports: list[LengthReport]
    val_reports: list[LengthReport]
    val_rows: Dataset | None  # the validation rows as loaded, for prompts and references
    val_format: str

    def prepared(self, train: Dataset, val: Dataset | None, lengths: list[int], **extra) -> PreparedData:
        """The objective's finished rows with this mixture's reports (``extra``: PreparedData's others)."""
        reports = self.train_reports + self.val_reports
        return PreparedData(
            train,
            val,
            reports,
            lengths,
            self.val_rows,
            self.val_format,
            sources=len(self.train_reports),
            **extra,
        )


def mix_sources(
    data: DataSection,
    seed: int,
    row_format: RowFormat,
    number_as: str | None = None,
    common_columns: bool = False,
) -> Mixture:
    """Every objective's sources, split, in ``row_format``, mixed and deduplicated. ``number_as``: a
    column numbering each source's rows from 1 before its split (sources.split_source); ``common_columns``:
    sources whose rows have different columns keep those they all have (GRPO's, which TRL passes to the
    rewards) instead of failing to concatenate."""
    parts, train_reports, val_parts, val_reports = [], [], [], []
    val_rows, val_format = None, data.format
    for source in data.source_list():
        fmt = data.format_of(source)
        split = sources.split_source(source, data, seed, number_as=number_as)
        part, report = row_format(split.rows, fmt, split.train_from)
        parts.append(part)
        train_reports.append(report)
        if split.held_out is not None:
            val, val_report = row_format(split.held_out, fmt, split.held_from)
            val_parts.append(val)
            val_reports.append(val_report)
            if val_rows is None:
                val_rows, val_format = split.held_out, fmt
    if data.val_path is not None:
        val_rows = sources.load_val_rows(data)
        val, val_report = row_format(val_rows, data.format, data.val_path)
        val_parts, val_format, val_reports = [val], data.format, [val_report]
    train = _mix(parts, data, seed, train_reports, common_columns)
    val = _concatenate(val_parts, common_columns) if val_parts else None
    return Mixture(train, val, train_reports, val_reports, val_rows, val_format)


def _mix(
    parts: list[Dataset], data: DataSection, seed: int, reports: list[LengthReport], common_columns: bool
) -> Dataset:
    """One training set from the sources' rows: a source with ``rows`` gives that many, the weighted
    sources share their total row count by weight, the others give all of theirs; rows are sampled
    seeded (repeated only when a source has fewer than asked). Then data.dedup. ``reports``: the
    sources' training reports, in order; each is told how many rows its source gave and lost as repeats."""
    mixed_sources = data.source_list()
    weighted = [i for i, s in enumerate(mixed_sources) if s.weight is not None]
    pool = sum(len(parts[i]) for i in weighted)
    total_weight = sum(mixed_sources[i].weight for i in weighted)
    chosen = []
    for number, (part, source, report) in enumerate(zip(parts, mixed_sources, reports, strict=True)):
        wanted = len(part)
        if source.rows is not None:
            wanted = source.rows
        elif source.weight is not None:
            wanted = round(pool * source.weight / total_weight)
        chosen.append(_sample(part, wanted, seed + number))
        if data.sources:
            report.taken = wanted
    mixed = _concatenate(chosen, common_columns)
    kept = range(len(mixed))
    if data.dedup:
        kept = _deduplicated(mixed, [len(part) for part in chosen], reports)
        mixed = mixed.select(kept) if len(kept) < len(mixed) else mixed
    if data.sources:
        _tell_what_trains(chosen, kept, reports)
    return mixed


def _deduplicated(mixed: Dataset, sizes: list[int], reports: list[LengthReport]) -> list[int]:
    """The mixture's rows (their indices) whose digest no earlier row has, each left out counted against
    the source it came from (the sources lie in ``mixed`` one after another, ``sizes`` rows each)."""
    owner = [number for number, size in enumerate(sizes) for _ in range(size)]
    seen: set[str] = set()
    keep = []
    for report in reports:
        report.repeats = 0
    for i, digest in enumerate(mixed[DIGEST]):
        if digest in seen:
            reports[owner[i]].repeats += 1
        else:
            seen.add(digest)
            keep.append(i)
    if len(keep) < len(mixed):
        log.info("data.dedup: %d repeated examples left out of %d", len(mixed) - len(keep), len(mixed))
    return keep


def _tell_what_trains(chosen: list[Dataset], kept, reports: list[LengthReport]) -> None:
    """Each source's report told what the mixture trains from it: of the rows drawn from it (``chosen``,
    one after another in the mixture), those data.dedup ``kept``; their trained tokens and labels."""
    start, kept = 0, list(kept)
    for part, report in zip(chosen, reports, strict=True):
        rows = part.select([i - start for i in kept if start <= i < start + len(part)])
        start += len(part)
        tokens = None
        if report.trained_tokens is not None and "trained_tokens" in rows.column_names:
            tokens = sum(rows["trained_tokens"])
        labels = report.label_phrase(rows) if report.label_phrase is not None else ""
        report.trains = InMixture(len(rows), tokens, labels)


def _sample(part: Dataset, wanted: int, seed: int) -> Dataset:
    if wanted == len(part):
        return part
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < wanted:  # without repeats while the source has rows to give
        order += rng.sample(range(len(part)), min(wanted - len(order), len(part)))
    return part.select(order)


def _concatenate(parts: list[Dataset], common_columns: bool) -> Dataset:
    """One dataset of several sources' rows (with ``common_columns``, the columns they all have)."""
    if len(parts) == 1:
        return parts[0]
    if common_columns:
        shared = set.intersection(*(set(p.column_names) for p in parts))
        parts = [p.select_columns(sorted(shared)) for p in parts]
    return datasets.concatenate_datasets(parts)
