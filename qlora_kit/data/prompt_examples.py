"""Validation (or training) rows as the prompt a model continues and the reference answer it should give:
what ``eval``'s exact match, the run's answers before and after, the merge's drift and the export's parity
report ask.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from qlora_kit.data import formats, sources
from qlora_kit.data.prepare import PreparedData
from qlora_kit.recipe.recipe import DataSection


@dataclass
class PromptExample:
    """A validation row as the prompt a model continues and the reference it should produce."""

    prompt: str
    reference: str


def prompt_examples(prepared: PreparedData, data: DataSection, tokenizer, count: int) -> list[PromptExample]:
    """The first ``count`` validation rows as prompt + reference answer."""
    if count == 0 or prepared.val_rows is None:
        return []
    rows = prepared.val_rows.select(range(min(count, len(prepared.val_rows))))
    return [_prompt_example(row, prepared.val_format, tokenizer, data) for row in rows]


def training_prompt_examples(
    data: DataSection, tokenizer, count: int, seed: int
) -> tuple[list[PromptExample], str]:
    """A fixed sample of ``count`` rows of the first training source (seeded: the same rows every time),
    as prompt + reference answer, and a line naming them; for a run without validation rows."""
    source = data.source_list()[0]
    path, _ = sources.split_of(source.path)
    rows = sources.load_rows(path, data, source)
    chosen = sorted(random.Random(seed).sample(range(len(rows)), min(count, len(rows))))
    fmt = data.format_of(source)
    examples = [_prompt_example(rows[i], fmt, tokenizer, data) for i in chosen]
    named = ", ".join(str(i + 1) for i in chosen)
    return examples, f"training rows {named} of {path} (seed {seed}; the run has no validation rows)"


def _prompt_example(row: dict, fmt: str, tokenizer, data: DataSection) -> PromptExample:
    segments = formats.render(row, fmt, tokenizer, data)
    answer = next((s.text for s in segments if s.trained), "")
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    reference = tokenizer.decode(ids, skip_special_tokens=True).strip()
    return PromptExample(formats.prompt_text(segments), reference)
