"""Data stage: load rows through ``datasets``, render them as prompt + response, tokenize, mask, collate.

Labels are -100 on every prompt token unless ``data.train_on_inputs`` is set (the QLoRA paper's
``train_on_source=False``): the loss is on the response only. Prompt and response are tokenized
separately and concatenated, so a BPE merge across the boundary can never blur which tokens are
trained. Tokenized datasets go through ``Dataset.map``, whose fingerprinted cache lets a second run of
the same recipe skip tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qlora_kit import tiny

if TYPE_CHECKING:
    from datasets import Dataset

    from qlora_kit.recipe import DataSection

IGNORE_INDEX = -100
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_FRAMING = ["### Instruction:\n", "\n\n### Input:\n", "\n\n### Response:\n"]
REQUIRED_FIELDS = {
    "alpaca": ("instruction", "output"),
    "completion": ("prompt", "completion"),
    "text": ("text",),
}
LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """A problem with the user's data: one line naming the file, the row and the problem."""


@dataclass
class Example:
    """One row rendered as text: the prompt (not trained unless train_on_inputs) and the response."""

    prompt: str
    response: str


def render(row: dict[str, Any], fmt: str) -> Example:
    """Turn a row of the given format into prompt + response text."""
    if fmt == "alpaca":
        template = ALPACA_PROMPT_WITH_INPUT if row.get("input") else ALPACA_PROMPT
        return Example(template.format(instruction=row["instruction"], input=row.get("input")), row["output"])
    if fmt == "completion":
        return Example(row["prompt"], row["completion"])
    return Example("", row["text"])


def load_splits(data: DataSection, seed: int) -> tuple[Dataset, Dataset | None]:
    """Raw train and validation rows: from files, a saved dataset, the hub, or the builtin demo."""
    if tiny.is_builtin(data.path):
        train_file, val_file = tiny.demo_data_files(tiny.builtin_name(data.path))
        return _load_source(str(train_file)), _load_source(str(val_file))
    train = _load_source(data.path)
    if data.val_path is not None:
        return train, _load_source(data.val_path)
    if data.val_fraction > 0:
        parts = train.train_test_split(test_size=data.val_fraction, seed=seed)
        return parts["train"], parts["test"]
    return train, None


def _load_source(source: str) -> Dataset:
    import datasets

    path = Path(source).expanduser()
    try:
        if path.is_dir():
            return datasets.load_from_disk(str(path))
        if path.suffix in LOADERS:
            if not path.exists():
                raise DataError(f"{path}: no such file")
            return datasets.load_dataset(LOADERS[path.suffix], data_files=str(path), split="train")
        return datasets.load_dataset(source, split="train")
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the file and the reason
        raise DataError(f"{source}: cannot load ({exc.__class__.__name__}: {_first_line(exc)})") from None


def check_fields(rows: Dataset, fmt: str, source: str) -> None:
    missing = [name for name in REQUIRED_FIELDS[fmt] if name not in rows.column_names]
    if missing:
        raise DataError(
            f"{source}: row 1: missing field {missing[0]!r} for format {fmt!r} (has {', '.join(rows.column_names)})"
        )
    if len(rows) == 0:
        raise DataError(f"{source}: no rows")


def tokenize_example(
    example: Example, tokenizer, max_seq_len: int, train_on_inputs: bool
) -> dict[str, list[int]]:
    """input_ids and labels for one example; labels are -100 on prompt tokens unless train_on_inputs."""
    prompt_ids = tokenizer(example.prompt, add_special_tokens=True)["input_ids"] if example.prompt else []
    response_ids = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    input_ids = (prompt_ids + response_ids)[:max_seq_len]
    prompt_labels = prompt_ids if train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)
    labels = (prompt_labels + response_ids)[:max_seq_len]
    return {"input_ids": input_ids, "labels": labels}


def tokenize_rows(rows: Dataset, data: DataSection, tokenizer, source: str) -> Dataset:
    """Render and tokenize every row; the result is cached by datasets' fingerprint."""
    check_fields(rows, data.format, source)

    def tokenize(row: dict[str, Any]) -> dict[str, list[int]]:
        return tokenize_example(render(row, data.format), tokenizer, data.max_seq_len, data.train_on_inputs)

    return rows.map(tokenize, remove_columns=rows.column_names, desc="tokenizing")


def prepare_datasets(data: DataSection, tokenizer, seed: int) -> tuple[Dataset, Dataset | None]:
    """Tokenized train and validation sets for the Trainer."""
    train_rows, val_rows = load_splits(data, seed)
    train = tokenize_rows(train_rows, data, tokenizer, data.path)
    val = (
        tokenize_rows(val_rows, data, tokenizer, data.val_path or data.path) if val_rows is not None else None
    )
    return train, val


def prompts_and_answers(data: DataSection, seed: int, count: int) -> list[Example]:
    """The first ``count`` validation rows as prompt + reference answer (for before/after samples)."""
    _, val_rows = load_splits(data, seed)
    if val_rows is None or count == 0:
        return []
    return [render(row, data.format) for row in val_rows.select(range(min(count, len(val_rows))))]


def build_collator(tokenizer):
    """Pad each batch to its longest example; padded label positions are -100."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(
        tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt"
    )


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__
