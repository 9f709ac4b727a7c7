"""The format registry: one ``FormatSpec`` per ``data.format``, and tokenizing rendered rows with labels.

A spec says which fields a row has, how it renders as trained and untrained text, how a user's text is
wrapped for generation the way training saw prompts, whether a reference answer can be checked
exactly (``qlora-kit eval``), and whether a conversation keeps its history (``qlora-kit chat``). The
recipe's choices, data preparation, generation, evaluation and the CLI all read it, so adding a format
is one entry here (plus its tests). This module imports nothing heavy: the recipe reads it.

A row becomes a list of ``Segment(text, trained)``. Segments are tokenized one by one and concatenated,
so a BPE merge across a boundary can never blur which tokens are trained; labels are -100 on every
untrained token (the QLoRA paper's ``train_on_source=False``).

Chat rows go through the tokenizer's own chat template. The trained part of each assistant turn is
what rendering ``messages[:i+1]`` adds to rendering ``messages[:i]`` with the generation prompt: it
works with any template that renders a conversation's prefix as a prefix of the whole, and needs no
``{% generation %}`` markers (Llama 3's and Qwen 2.5's templates have none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IGNORE_INDEX = -100
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_FRAMING = ["### Instruction:\n", "\n\n### Input:\n", "\n\n### Response:\n"]

CHAT_ROLES = {"system", "user", "assistant", "tool"}


class RowError(ValueError):
    """What is wrong with one row; the caller adds the file and the row number."""


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool


def render(row: dict[str, Any], fmt: str, tokenizer) -> list[Segment]:
    """The row as text segments; the response (or each assistant turn) is the trained part."""
    spec = FORMATS[fmt]
    for name in spec.fields:
        _check_field(row, name, optional=name in spec.optional)
    return spec.render(row, tokenizer)


def _render_alpaca(row: dict[str, Any], tokenizer) -> list[Segment]:
    template = ALPACA_PROMPT_WITH_INPUT if row.get("input") else ALPACA_PROMPT
    prompt = template.format(instruction=row["instruction"], input=row.get("input"))
    return [Segment(prompt, False), Segment(row["output"] + tokenizer.eos_token, True)]


def _render_completion(row: dict[str, Any], tokenizer) -> list[Segment]:
    return [Segment(row["prompt"], False), Segment(row["completion"] + tokenizer.eos_token, True)]


def _render_text(row: dict[str, Any], tokenizer) -> list[Segment]:
    return [Segment(row["text"] + tokenizer.eos_token, True)]


def _render_chat(row: dict[str, Any], tokenizer) -> list[Segment]:
    return render_chat(row["messages"], tokenizer)


def _check_field(row: dict[str, Any], name: str, optional: bool) -> None:
    value = row.get(name)
    if name == "messages":
        if not isinstance(value, list) or not value:
            raise RowError(
                f"field 'messages' must be a non-empty list of {{role, content}} (got {_show(value)})"
            )
        return
    if value is None:
        if optional:
            return
        raise RowError(f"missing field {name!r}")
    if not isinstance(value, str):
        raise RowError(f"field {name!r} must be text (got {type(value).__name__} {_show(value)})")


def render_chat(messages: list[dict[str, Any]], tokenizer) -> list[Segment]:
    """Segments of a conversation: assistant turns trained, everything else not."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise RowError(f"messages[{i}]: role must be one of {sorted(CHAT_ROLES)} (got {_show(message)})")
        if not isinstance(message.get("content"), str):
            raise RowError(f"messages[{i}]: content must be text (got {_show(message.get('content'))})")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("conversation has no assistant turn to train on")
    if tokenizer.chat_template is None:
        raise RowError("format 'chat' needs a tokenizer with a chat template; this one has none")
    segments: list[Segment] = []
    done = ""  # text rendered so far
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _apply_template(tokenizer, messages[:i], generation_prompt=True)
        whole = _apply_template(tokenizer, messages[: i + 1], generation_prompt=False)
        if not prefix.startswith(done) or not whole.startswith(prefix):
            raise RowError(
                "the chat template does not render a conversation's start as a prefix of the whole"
            )
        reply = whole[len(prefix) :].rstrip()  # the separator after a turn's end token is not the reply
        segments += [Segment(prefix[len(done) :], False), Segment(reply, True)]
        done = prefix + reply
    rest = _apply_template(tokenizer, messages, generation_prompt=False)[len(done) :]
    if rest:
        segments.append(Segment(rest, False))  # turns after the last assistant reply
    return [s for s in segments if s.text]


def _apply_template(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )


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


def _show(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _alpaca_prompt(text: str, tokenizer, history: list[dict[str, str]] | None = None) -> str:
    return ALPACA_PROMPT.format(instruction=text)


def _chat_prompt(text: str, tokenizer, history: list[dict[str, str]] | None = None) -> str:
    if tokenizer.chat_template is None:
        return text
    messages = [*(history or []), {"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _raw_prompt(text: str, tokenizer, history: list[dict[str, str]] | None = None) -> str:
    return text


@dataclass(frozen=True)
class FormatSpec:
    """One data format: its fields and how it renders for training and for generation."""

    name: str
    fields: tuple[str, ...]  # what a row has (data.fields may rename them)
    render: Callable[[dict[str, Any], Any], list[Segment]]  # (row, tokenizer) -> segments
    prompt: Callable[..., str]  # (text, tokenizer, history) -> the prompt a model continues
    optional: frozenset[str] = frozenset()  # fields that may be absent or empty
    checkable: bool = True  # has a reference answer to compare exactly (eval's exact match)
    multi_turn: bool = False  # a conversation: `qlora-kit chat` keeps the history
    chat_template: bool = False  # rendered by the tokenizer's chat template, which adds its own BOS


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
        FormatSpec("chat", ("messages",), _render_chat, _chat_prompt, multi_turn=True, chat_template=True),
        FormatSpec("completion", ("prompt", "completion"), _render_completion, _raw_prompt),
        FormatSpec("text", ("text",), _render_text, _raw_prompt, checkable=False),
    )
}
