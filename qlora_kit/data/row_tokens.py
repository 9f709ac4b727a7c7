"""One row -> its token ids and masked labels (or a pair's three id lists), cut by the length policy, with
the small per-example facts the reports and the preflight read (``FACTS``).

``prepare.py`` maps ``RowTokenizer`` over each source's rows (``Dataset.map``); a row's mistake is one
``DataError`` line naming the file and the row (1-based, in file order: ``ROW`` keeps it through a split).
"""

from __future__ import annotations

import hashlib
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qlora_kit.data import format_hints, formats, images, preference
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.errors import DataError
from qlora_kit.registries.formats import FORMATS

if TYPE_CHECKING:
    from datasets import Dataset

    from qlora_kit.recipe.recipe import DataSection

ROW = "__qlora_kit_row__"  # a row's 1-based number in its file, kept through a train/validation split
# Columns the tokenizer writes besides input_ids and labels: facts the reports and the preflight read
# without loading any example's tokens into memory (data bigger than RAM stays memory-mapped).
FACTS = ("full_length", "trained_tokens", "trains_end", "double_bos", "digest", "prefix_ok")


def check_columns(rows: Dataset, fmt: str, source: str, required: tuple[str, ...] | None = None) -> None:
    """The format's required fields (or ``required``: KTO's columns, data/feedback.py) are all columns of
    ``rows``; else one line naming the first missing, the one every format's check writes."""
    spec = FORMATS[fmt]
    if required is None:
        required = tuple(n for n in spec.fields if n not in spec.optional)
    missing = [n for n in required if n not in rows.column_names]
    if missing:
        raise DataError(
            f"{source}: row 1: missing field {missing[0]!r} for format {fmt!r} "
            f"(has {', '.join(rows.column_names)}; map names with data.fields)"
            f"{format_hints.columns_hint(rows, fmt)}"
        )


class RowTokenizer:
    """One row -> its token ids and labels (or a pair's three id lists), cut by the length policy, with
    the facts the preflight reads (full length, trained tokens, a trained end token, a doubled BOS, a
    digest for duplicates, and for sampled chat rows whether prompts render as trained)."""

    def __init__(
        self, data: DataSection, fmt: str, tokenizer, source: str, max_prompt_len: int | None, runs=None
    ):
        spec = FORMATS[fmt]
        self.runs = runs  # a vision-language model's image runs: chat rows may hold images
        self.folder = Path(source).expanduser().parent  # image paths are relative to the data file
        self.data, self.fmt, self.tokenizer, self.source = data, fmt, tokenizer, source
        self.max_prompt_len, self.pair_kind = max_prompt_len, spec.pair_kind
        self.max_len, self.drop = data.max_seq_len, data.overlong == "drop"
        self.add_bos = not spec.chat_template
        self.ends = end_token_ids(tokenizer)
        self.bos = tokenizer.bos_token_id
        self.sampled = data.preflight.sample_rows if spec.chat_template else 0

    def _row_error(self, row: dict[str, Any], index: int, exc: Exception) -> DataError:
        hint = format_hints.row_hint(row, self.fmt)  # the row in another format's shape: that format named
        return DataError(f"{self.source}: row {row.get(ROW, index + 1)}: {exc}{hint}")

    def example(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        data, tokenizer = self.data, self.tokenizer
        files: list[Path] = []
        try:
            if FORMATS[self.fmt].chat_template:  # a conversation may hold images (images.py)
                marker = self.runs.marker if self.runs else None
                row, files = images.with_images_as_markers(row, data, self.folder, marker)
            segments = formats.render(row, self.fmt, tokenizer, data)
            checked = index < self.sampled
            prefix_ok = formats.prompts_render_as_trained(row, self.fmt, tokenizer, data) if checked else None
            example = formats.tokenize(segments, tokenizer, data.train_on_inputs, self.add_bos)
            if self.runs is not None:
                example = images.expand(example, files, self.runs)
        except formats.RowError as exc:
            raise self._row_error(row, index, exc) from None
        ids = example["input_ids"]
        full = len(ids)
        facts = {
            "full_length": full,
            "double_bos": self.bos is not None and ids[:2] == [self.bos, self.bos],
            "digest": digest(ids),
            "prefix_ok": -1 if prefix_ok is None else int(prefix_ok),  # -1: not checked
        }
        if full > self.max_len:
            keep = 0 if self.drop else self.max_len
            if self.runs is not None:  # cut on the text side only, never inside an image's tokens
                example = images.cut(example, keep)
            else:
                example = {key: values[:keep] for key, values in example.items()}
        example.pop("spans", None)
        trained = [t for t in example["labels"] if t != IGNORE_INDEX]
        facts |= {"trained_tokens": len(trained), "trains_end": any(t in self.ends for t in trained)}
        return {**example, **facts, "length": len(example["input_ids"])}

    def pair(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        try:
            texts = preference.render_pair(row, self.pair_kind, self.tokenizer, self.data)
        except formats.RowError as exc:
            raise self._row_error(row, index, exc) from None
        pair, full = preference.tokenize_pair(
            texts, self.tokenizer, self.add_bos, self.max_len, self.max_prompt_len, self.drop
        )
        prompt, answers = pair["prompt_ids"], (pair["chosen_ids"], pair["rejected_ids"])
        return {
            **pair,
            "full_length": full,
            "double_bos": self.bos is not None and prompt[:2] == [self.bos, self.bos],
            "digest": digest(prompt + [-1] + answers[0] + [-1] + answers[1]),
            "prefix_ok": -1,  # a chat pair whose prompt renders differently is a row error
            "trained_tokens": min(len(ids) for ids in answers),  # a pair trains only with both answers
            "trains_end": all(ends_with_end_token(ids, self.ends, self.tokenizer) for ids in answers),
            "length": len(prompt) + max(len(ids) for ids in answers),
        }


def ends_with_end_token(ids: list[int], ends: set[int], tokenizer) -> bool:
    """The answer's last token other than whitespace is an end token: ChatML's templates render a reply
    as ``...<|im_end|>\n``, so the end-of-turn marker comes before the template's line break."""
    for token in reversed(ids):
        if token in ends:
            return True
        if tokenizer.decode([token]).strip():
            return False
    return False


def digest(ids: list[int]) -> str:
    return hashlib.blake2b(array("l", ids).tobytes(), digest_size=8).hexdigest()


def end_token_ids(tokenizer) -> set[int]:
    """Token ids that end a response: EOS and the chat template's end-of-turn markers (chat.py)."""
    from qlora_kit.data.chat import end_of_turn_markers, special_tokens

    markers = end_of_turn_markers(tokenizer, special_tokens(tokenizer))
    ids = {tokenizer.convert_tokens_to_ids(m) for m in markers}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}
