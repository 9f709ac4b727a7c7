"""Labelled answers (formats feedback and feedback_chat, ``train.objective: kto``) as TRL's KTOTrainer reads
and tokenizes them: ``prepare_feedback`` gives the training stage these rows through the data path every
objective takes (mixture.py), and the data report and ``qlora-kit eval`` count and score the ids
``token_ids`` gives, which are TRL's own rule.
"""

from __future__ import annotations

from typing import Any

import datasets
from trl.data_utils import apply_chat_template, common_prefix_length

from qlora_kit.data import format_hints, preference
from qlora_kit.data.mixture import DIGEST, LengthReport, PreparedData, mix_sources, text_digest
from qlora_kit.data.row_tokens import check_columns
from qlora_kit.data.segments import RowError
from qlora_kit.errors import DataError
from qlora_kit.registries.formats import FORMATS

COLUMNS = ("prompt", "completion", "label")  # what TRL's KTOTrainer reads


def prepare_feedback(data, tokenizer, seed: int) -> PreparedData:
    """The labelled answers as TRL's text columns (each source's own rows, or its builtin split), mixed
    and deduplicated as every objective's, then shuffled once with the seed (TRL reads them in order:
    its KL baseline); validation rows from data.val_path, data.val_fraction or the builtin set."""

    # A mixture of text and conversational sources: one column cannot hold both, so the conversations are
    # rendered to text by TRL's own apply_chat_template (what TRL's KTO collator does with them)
    mixed = len({FORMATS[fmt].chat_template for _, fmt in data.formats_by_field()}) > 1

    def answers(rows: datasets.Dataset, fmt: str, source: str) -> tuple[datasets.Dataset, LengthReport]:
        trl = trl_rows(rows, data, source, tokenizer, fmt)
        if mixed and FORMATS[fmt].chat_template:
            trl = trl.map(apply_chat_template, fn_kwargs={"processing_class": tokenizer})
        return _answers(trl, source, tokenizer)

    mixture = mix_sources(data, seed, answers)
    train = mixture.train.shuffle(seed=seed)
    lengths = list(train["length"])
    val = mixture.val.select_columns(list(COLUMNS)) if mixture.val is not None else None
    return mixture.prepared(train.select_columns(list(COLUMNS)), val, lengths)


def _answers(rows: datasets.Dataset, source: str, tokenizer) -> tuple[datasets.Dataset, LengthReport]:
    """A source's TRL rows with each row's tokens and digest, and the source's report: TRL keeps every
    row (it truncates to preference.max_length itself), each answer's tokens trained."""
    ids = [token_ids(row, tokenizer) for row in rows]
    lengths = [len(p) + len(a) for p, a in ids]
    trained = [len(a) for _, a in ids]  # each answer's tokens (what the mixture's report counts)
    digests = [text_digest(r["prompt"], r["completion"], r["label"]) for r in rows]
    report = LengthReport(
        source,
        len(rows),
        lengths=lengths,
        trained_tokens=sum(trained),
        labels=label_phrase(rows),
        label_phrase=label_phrase,
    )
    rows = rows.add_column("length", lengths).add_column("trained_tokens", trained)
    return rows.add_column(DIGEST, digests), report


def label_phrase(rows: datasets.Dataset) -> str:
    """`` (163 desirable, 163 undesirable answers)`` for these labelled answers."""
    labelled = sum(rows["label"])
    return f" ({labelled} desirable, {len(rows) - labelled} undesirable answers)"


def trl_rows(
    rows: datasets.Dataset, section, source: str, tokenizer, fmt: str | None = None
) -> datasets.Dataset:
    """TRL's prompt/completion/label columns: texts (format feedback, data.system_prompt before the
    prompt) or conversations (feedback_chat: the prompt's messages with data.system_prompt, the
    assistant's reply as a message list), which TRL renders with the chat template itself; one line
    naming the row for a missing or wrong field. ``fmt``: the source's format (default data.format)."""
    fmt = fmt or section.format
    check_columns(rows, fmt, source, COLUMNS)
    chat = FORMATS[fmt].chat_template
    columns = {name: [] for name in COLUMNS}
    for index, row in enumerate(rows.select_columns(list(COLUMNS))):
        try:
            prompt, _ = preference.render_feedback(row, chat, tokenizer, section)
        except RowError as exc:
            hint = format_hints.row_hint(row, fmt)
            raise DataError(f"{source}: row {index + 1}: {exc}{hint}") from None
        if chat:
            columns["prompt"].append(preference.chat_prompt_messages(row["prompt"], section))
            columns["completion"].append(preference.assistant_messages(row["completion"], "completion"))
        else:
            columns["prompt"].append(prompt)
            columns["completion"].append(row["completion"])
        columns["label"].append(row["label"])
    return datasets.Dataset.from_dict(columns)


def token_ids(row: dict[str, Any], tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one TRL row as TRL's KTOTrainer tokenizes it: a text answer gets the
    EOS, a conversation is rendered by the chat template, and the answer starts where the prompt's ids
    and the whole's part (trl's common_prefix_length)."""
    if isinstance(row["prompt"], list):
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True)
        prompt, whole = _ids(prompt), _ids(whole)
    else:
        completion = row["completion"]
        if not completion.endswith(tokenizer.eos_token):
            completion += tokenizer.eos_token
        prompt = tokenizer(row["prompt"])["input_ids"]
        whole = tokenizer(row["prompt"] + completion)["input_ids"]
    start = common_prefix_length(prompt, whole)
    return prompt[:start], whole[start:]


def _ids(rendered) -> list[int]:
    # apply_chat_template(tokenize=True) returns the ids, or a BatchEncoding of them (transformers 5)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
