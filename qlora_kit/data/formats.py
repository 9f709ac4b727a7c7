"""The format registry: one ``FormatSpec`` per ``data.format``, and tokenizing rendered rows with labels.

A spec says which fields a row has, how it renders as trained and untrained text, how a user's text is
wrapped for generation the way training saw prompts, whether a reference answer can be checked
exactly (``qlora-kit eval``), and whether a conversation keeps its history (``qlora-kit chat``). The
recipe's choices, data preparation, generation, evaluation and the CLI all read it, so adding a format
is one entry here (plus its tests). This module imports nothing heavy: the recipe reads it.

A row becomes a list of ``Segment(text, trained)``. Segments are tokenized one by one and concatenated,
so a BPE merge across a boundary can never blur which tokens are trained; labels are -100 on every
untrained token (the QLoRA paper's ``train_on_source=False``).

Chat and ShareGPT rows go through the tokenizer's own chat template, rendered once (with the row's
tools); chat.py finds the trained spans in that text. ``data.system_prompt`` gives rows without a
system prompt one: a system message in chats, text before the prompt in alpaca and completion rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qlora_kit.data.chat import (
    apply_system_prompt_mode,
    apply_template,
    prefix_consistent,
    render_chat,
    sharegpt_messages,
    with_system_prompt,
)
from qlora_kit.data.preference import alpaca_prompt, render_chosen
from qlora_kit.data.segments import RowError, Segment, show

if TYPE_CHECKING:
    from qlora_kit.recipe_data import DataSection

IGNORE_INDEX = -100
ALPACA_FRAMING = ["### Instruction:\n", "\n\n### Input:\n", "\n\n### Response:\n"]

__all__ = ["FORMATS", "IGNORE_INDEX", "FormatSpec", "RowError", "Segment", "render", "tokenize"]


def render(row: dict[str, Any], fmt: str, tokenizer, data: DataSection) -> list[Segment]:
    """The row as text segments; the response (or each assistant turn) is the trained part. ``data``
    (the recipe's data section) gives the system prompt, its mode and ShareGPT's role names."""
    spec = FORMATS[fmt]
    if not spec.pairs:  # a pair's fields are text or conversations: preference.py checks them
        for name in spec.fields:
            _check_field(row, name, optional=name in spec.optional)
    return spec.render(row, tokenizer, data)


def _system_text(data: DataSection) -> str:
    """data.system_prompt as the text before a plain prompt (alpaca, completion)."""
    return f"{data.system_prompt}\n\n" if data.system_prompt else ""


def _render_alpaca(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    prompt = _system_text(data) + alpaca_prompt(row["instruction"], row.get("input"))
    return [Segment(prompt, False), Segment(row["output"] + tokenizer.eos_token, True)]


def _render_completion(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    prompt = _system_text(data) + row["prompt"]
    return [Segment(prompt, False), Segment(row["completion"] + tokenizer.eos_token, True)]


def _render_text(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    return [Segment(row["text"] + tokenizer.eos_token, True)]


def _render_chat(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    messages = _messages(row, data)
    return render_chat(messages, tokenizer, data.system_prompt_mode, tools=row.get("tools"))


def _messages(row: dict[str, Any], data: DataSection) -> list[Any]:
    """A chat or ShareGPT row's conversation as chat messages, with data.system_prompt."""
    if "conversations" in row and "messages" not in row:
        return with_system_prompt(sharegpt_messages(row["conversations"], data.roles), data.system_prompt)
    return with_system_prompt(row["messages"], data.system_prompt)


def prompts_render_as_trained(row: dict[str, Any], fmt: str, tokenizer, data: DataSection) -> bool | None:
    """Whether each assistant turn's prompt, rendered as inference renders it, starts the rendering
    training sees (chat.prefix_consistent); None for formats without a chat template."""
    if not FORMATS[fmt].chat_template:
        return None
    return prefix_consistent(_messages(row, data), tokenizer, data.system_prompt_mode, row.get("tools"))


def _check_field(row: dict[str, Any], name: str, optional: bool) -> None:
    value = row.get(name)
    if name in ("messages", "conversations"):
        if not isinstance(value, list) or not value:
            pair = "{role, content}" if name == "messages" else "{from, value}"
            raise RowError(f"field {name!r} must be a non-empty list of {pair} (got {show(value)})")
        return
    if name == "tools":
        if value is not None and not isinstance(value, (list, str)):
            raise RowError(f"field 'tools' must be a list of tool schemas or their JSON (got {show(value)})")
        return
    if value is None:
        if optional:
            return
        raise RowError(f"missing field {name!r}")
    if not isinstance(value, str):
        raise RowError(f"field {name!r} must be text (got {type(value).__name__} {show(value)})")


def tokenize(
    segments: list[Segment], tokenizer, train_on_inputs: bool, add_bos: bool
) -> dict[str, list[int]]:
    """input_ids and labels (-100 on untrained tokens) for the segments, untruncated."""
    input_ids: list[int] = []
    labels: list[int] = []
    for i, segment in enumerate(segments):
        ids = tokenizer(segment.text, add_special_tokens=add_bos and i == 0)["input_ids"]
        input_ids += ids
        labels += ids if (segment.trained or train_on_inputs) else [IGNORE_INDEX] * len(ids)
    return {"input_ids": input_ids, "labels": labels}


def prompt_text(segments: list[Segment]) -> str:
    """The text before the first trained segment: what a model is asked to continue."""
    text = ""
    for segment in segments:
        if segment.trained:
            break
        text += segment.text
    return text


def _alpaca_prompt(
    text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None
) -> str:
    return _system_text(data) + alpaca_prompt(text)


def _chat_prompt(text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None) -> str:
    """The conversation so far and the user's text, rendered as training rendered it (chat.py)."""
    if tokenizer.chat_template is None:
        return text
    messages = with_system_prompt([*(history or []), {"role": "user", "content": text}], data.system_prompt)
    messages = apply_system_prompt_mode(messages, data.system_prompt_mode)
    return apply_template(tokenizer, messages, generation_prompt=True, mode=data.system_prompt_mode)


def _completion_prompt(
    text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None
) -> str:
    return _system_text(data) + text


def _raw_prompt(text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None) -> str:
    return text


@dataclass(frozen=True)
class FormatSpec:
    """One data format: its fields and how it renders for training and for generation."""

    name: str
    fields: tuple[str, ...]  # what a row has (data.fields may rename them)
    render: Callable[[dict[str, Any], Any, Any], list[Segment]]  # (row, tokenizer, data section) -> segments
    prompt: Callable[..., str]  # (text, tokenizer, data section, history) -> the prompt a model continues
    optional: frozenset[str] = frozenset()  # fields that may be absent or empty
    checkable: bool = True  # has a reference answer to compare exactly (eval's exact match)
    multi_turn: bool = False  # a conversation: `qlora-kit chat` keeps the history
    chat_template: bool = False  # rendered by the tokenizer's chat template, which adds its own BOS
    pairs: bool = (
        False  # preference pairs (train.objective: dpo): render gives the prompt and the chosen answer
    )


def _chat_format(name: str, conversation: str) -> FormatSpec:
    """A conversation (``messages``, or ShareGPT's ``conversations``) with optional ``tools``, rendered by
    the tokenizer's chat template."""
    return FormatSpec(
        name,
        (conversation, "tools"),
        _render_chat,
        _chat_prompt,
        optional=frozenset({"tools"}),
        multi_turn=True,
        chat_template=True,
    )


def _pair_format(name: str, asked: tuple[str, ...], kind: str, prompt: Callable[..., str]) -> FormatSpec:
    """Preference pairs (data/preference.py): what is asked, a chosen and a rejected answer."""
    return FormatSpec(
        name,
        (*asked, "chosen", "rejected"),
        lambda row, tokenizer, data: render_chosen(row, kind, tokenizer, data),
        prompt,
        optional=frozenset({"input"}),
        pairs=True,
        chat_template=kind == "chat",
    )


FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec(
            "alpaca",
            ("instruction", "input", "output"),
            _render_alpaca,
            _alpaca_prompt,
            optional=frozenset({"input"}),
        ),
        _chat_format("chat", "messages"),
        _chat_format("sharegpt", "conversations"),
        FormatSpec("completion", ("prompt", "completion"), _render_completion, _completion_prompt),
        FormatSpec("text", ("text",), _render_text, _raw_prompt, checkable=False),
        _pair_format("preference", ("prompt",), "text", _completion_prompt),
        _pair_format("preference_alpaca", ("instruction", "input"), "alpaca", _alpaca_prompt),
        _pair_format("preference_chat", ("prompt",), "chat", _chat_prompt),
    )
}
