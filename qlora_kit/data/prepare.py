"""Data stage: load rows through ``datasets``, tokenize them with masked labels, apply the length
policy, split, and build the collator (padding, or packing without padding).

Sources: .jsonl/.json/.csv/.parquet files, a ``Dataset.save_to_disk`` folder, a hub dataset name, or
``builtin:demo-facts``. Tokenization runs through ``Dataset.map``, whose fingerprinted cache lets a
second run of the same recipe skip it. Any problem with the user's data is one ``DataError`` line
naming the file, the row (1-based, in file order) and what is wrong.
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset
from datasets.utils import logging as datasets_logging
from transformers import DataCollatorForSeq2Seq

from qlora_kit import attention, builtin, hub
from qlora_kit.data import formats
from qlora_kit.data.errors import DataError, diagnose_load_failure
from qlora_kit.data.formats import FORMATS, IGNORE_INDEX
from qlora_kit.data.packing import FlattenedRowsCollator, PackedRowCollator, best_fit_decreasing, pack_dataset
from qlora_kit.recipe import DataSection, RecipeError

LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

__all__ = ["DataError", "LengthReport", "PreparedData", "build_collator", "prepare_datasets"]


@dataclass
class LengthReport:
    """What the length policy did to one split."""

    source: str
    rows: int
    truncated: int = 0
    dropped: int = 0
    untrainable: int = 0  # rows left with no trained token (their response was cut off)
    lengths: list[int] = field(default_factory=list)  # token lengths before truncation

    def summary(self) -> str:
        kept = self.rows - self.dropped - self.untrainable
        return (
            f"{self.source}: {kept} of {self.rows} rows kept; {self.truncated} truncated, "
            f"{self.dropped} dropped as too long, {self.untrainable} without a trained token"
        )


@dataclass
class PreparedData:
    train: Dataset  # packed rows when data.packing, else one example per row
    val: Dataset | None
    reports: list[LengthReport]
    example_lengths: list[int]  # token counts of the training examples kept, before any packing
    val_rows: Dataset | None = None  # the validation rows as loaded, for prompts and references


ROW = "__qlora_kit_row__"  # a row's 1-based number in its file, kept through a train/validation split


def prepare_datasets(data: DataSection, tokenizer, seed: int) -> PreparedData:
    """Tokenized (and, with data.packing, packed) train and validation sets for the Trainer."""
    train_source, val_source = _sources(data)
    train_rows = _load_source(train_source, data)
    val_rows = _load_source(val_source, data) if val_source is not None else None
    if val_rows is None and data.val_fraction > 0 and len(train_rows) > 1:
        numbered = train_rows.add_column(ROW, list(range(1, len(train_rows) + 1)))
        parts = numbered.train_test_split(test_size=data.val_fraction, seed=seed)
        train_rows, val_rows = parts["train"], parts["test"]
    train, train_report = _tokenized(train_rows, data, tokenizer, train_source)
    reports = [train_report]
    val = None
    if val_rows is not None:
        val, val_report = _tokenized(val_rows, data, tokenizer, val_source or train_source)
        reports.append(val_report)
    lengths = [len(ids) for ids in train["input_ids"]]
    if data.packing:
        train = pack_dataset(train, data.max_seq_len)
        val = pack_dataset(val, data.max_seq_len) if val is not None else None
    return PreparedData(train, val, reports, lengths, val_rows)


def pad_shares(prepared: PreparedData, data: DataSection, batch_size: int, seed: int) -> dict[str, float]:
    """Share of pad tokens per batch for each batching mode, on this data."""
    lengths = prepared.example_lengths
    rows = [len(ids) for ids in prepared.train["input_ids"]] if data.packing else None
    if rows is None:
        packed = best_fit_decreasing(lengths, data.max_seq_len)
        rows = [sum(lengths[i] for i in members) for members in packed]
    return {
        "padding": pad_share(lengths, batch_size, group_by_length=False, seed=seed),
        "group_by_length": pad_share(lengths, batch_size, group_by_length=True),
        "packing": pad_share(rows, batch_size, group_by_length=False, seed=seed),
    }


def _sources(data: DataSection) -> tuple[str, str | None]:
    if builtin.is_builtin(data.path):
        train_file, val_file = builtin.demo_data_files(builtin.builtin_name(data.path))
        return str(train_file), str(val_file)
    return data.path, data.val_path


def _load_source(source: str, data: DataSection) -> Dataset:
    path = Path(source).expanduser()
    try:
        with _quiet_datasets(progress=False):
            if path.is_dir():
                rows = datasets.load_from_disk(str(path))
            elif path.suffix in LOADERS:
                if not path.exists():
                    raise DataError(f"{path}: no such file")
                rows = datasets.load_dataset(LOADERS[path.suffix], data_files=str(path), split="train")
            else:
                named_by = "data.path" if source == data.path else "data.val_path"
                with hub.hub_errors(named_by, source, None, kind="dataset"):
                    rows = datasets.load_dataset(source, data.config_name, split="train")
    except (DataError, RecipeError):
        raise
    except Exception as exc:  # datasets raises many types; the user needs the file, the row and the reason
        raise diagnose_load_failure(path, source, exc) from None
    if isinstance(rows, datasets.DatasetDict):
        raise DataError(f"{source}: holds several splits ({', '.join(rows)}); point at one split's folder")
    return _rename_fields(rows, data, source)


def _rename_fields(rows: Dataset, data: DataSection, source: str) -> Dataset:
    renames = {theirs: ours for ours, theirs in data.fields.items() if theirs != ours}
    for ours, theirs in data.fields.items():
        if theirs not in rows.column_names:
            raise DataError(
                f"{source}: row 1: missing field {theirs!r} (data.fields.{ours}; has {', '.join(rows.column_names)})"
            )
    return rows.rename_columns(renames) if renames else rows


@contextlib.contextmanager
def _quiet_datasets(progress: bool = True):
    # datasets logs its own multi-line error before raising; ours is the one line the user sees.
    logger = logging.getLogger("datasets")
    level, bars = logger.level, datasets_logging.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL)
    if not progress:
        datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()


def _tokenized(rows: Dataset, data: DataSection, tokenizer, source: str) -> tuple[Dataset, LengthReport]:
    if len(rows) == 0:
        raise DataError(f"{source}: no rows")
    spec = FORMATS[data.format]
    required = [n for n in spec.fields if n not in spec.optional]
    missing = [n for n in required if n not in rows.column_names]
    if missing:
        raise DataError(
            f"{source}: row 1: missing field {missing[0]!r} for format {data.format!r} "
            f"(has {', '.join(rows.column_names)}; map names with data.fields)"
        )
    fmt, max_len, drop = data.format, data.max_seq_len, data.overlong == "drop"
    system_mode = data.system_prompt_mode
    train_on_inputs, add_bos = data.train_on_inputs, not spec.chat_template

    def tokenize(row: dict[str, Any], index: int) -> dict[str, Any]:
        try:
            segments = formats.render(row, fmt, tokenizer, system_mode)
        except formats.RowError as exc:
            raise DataError(f"{source}: row {row.get(ROW, index + 1)}: {exc}") from None
        example = formats.tokenize(segments, tokenizer, train_on_inputs, add_bos)
        length = len(example["input_ids"])
        if length > max_len:
            keep = 0 if drop else max_len
            example = {key: ids[:keep] for key, ids in example.items()}
        return {**example, "full_length": length}

    try:
        with _quiet_datasets():
            tokenized = rows.map(
                tokenize, with_indices=True, remove_columns=rows.column_names, desc="tokenizing"
            )
    except UnicodeDecodeError as exc:  # arrow defers decoding a JSON file's strings until a row is read
        raise diagnose_load_failure(Path(source), source, exc) from None
    lengths = tokenized["full_length"]
    report = LengthReport(source=source, rows=len(rows), lengths=lengths)
    report.truncated = 0 if drop else sum(n > max_len for n in lengths)
    report.dropped = sum(n > max_len for n in lengths) if drop else 0
    trainable = [any(x != IGNORE_INDEX for x in labels) for labels in tokenized["labels"]]
    report.untrainable = sum(
        1 for n, ok in zip(lengths, trainable, strict=True) if not ok and not (drop and n > max_len)
    )
    if not any(trainable):
        raise DataError(
            f"{source}: every row is over data.max_seq_len={max_len} tokens or has no trained token left "
            f"(longest {max(lengths)}, shortest {min(lengths)})"
        )
    keep = [i for i, ok in enumerate(trainable) if ok]
    if len(keep) < len(tokenized):
        tokenized = tokenized.select(keep)
    return tokenized.remove_columns("full_length"), report


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


def pad_share(lengths: list[int], batch_size: int, group_by_length: bool, seed: int = 0) -> float:
    """Share of padding tokens when batches of ``batch_size`` are padded to their longest example,
    in a shuffled order (or sorted into similar lengths, as group_by_length does)."""
    order = sorted(lengths) if group_by_length else random.Random(seed).sample(lengths, len(lengths))
    padded = real = 0
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        padded += max(batch) * len(batch)
        real += sum(batch)
    return 1 - real / padded if padded else 0.0


@dataclass
class PromptExample:
    """A validation row as the prompt a model continues and the reference it should produce."""

    prompt: str
    reference: str


def prompt_examples(prepared: PreparedData, data: DataSection, tokenizer, count: int) -> list[PromptExample]:
    """The first ``count`` validation rows as prompt + reference answer."""
    if count == 0 or prepared.val_rows is None:
        return []
    examples = []
    for row in prepared.val_rows.select(range(min(count, len(prepared.val_rows)))):
        segments = formats.render(row, data.format, tokenizer, data.system_prompt_mode)
        answer = next((s.text for s in segments if s.trained), "")
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        reference = tokenizer.decode(ids, skip_special_tokens=True).strip()
        examples.append(PromptExample(formats.prompt_text(segments), reference))
    return examples


def read_prompts(path: str) -> list[str]:
    """The ``prompt`` of every row of a prompts file (``qlora-kit generate --file``), read like any data."""
    rows = _load_source(path, DataSection(path=path))
    if "prompt" not in rows.column_names:
        raise DataError(f"{path}: row 1: missing field 'prompt' (has {', '.join(rows.column_names)})")
    prompts = list(rows["prompt"])
    for number, prompt in enumerate(prompts, start=1):
        if not isinstance(prompt, str):
            raise DataError(
                f"{path}: row {number}: field 'prompt' must be text (got {type(prompt).__name__})"
            )
    return prompts
