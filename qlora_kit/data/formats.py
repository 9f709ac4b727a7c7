"""Each format's rendering (a row as trained and untrained text) and prompt wrapping (a user's text as
training saw prompts), and tokenizing rendered rows with labels.

Which formats exist, their fields and which of the functions here each one uses is the registry's
(``registries/formats.py``); ``RENDERINGS``, at the end, gives each format its two functions by
reference (the registry, standard library only, sits below data/), and ``render`` and ``prompt`` read it.

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

from qlora_kit.data import preference
from qlora_kit.data.chat import (
    apply_system_prompt_mode,
    apply_template,
    prompt_rendering,
    render_chat,
    sharegpt_messages,
    with_system_prompt,
)
from qlora_kit.data.preference import render_chosen
from qlora_kit.data.segments import RowError, Segment, show
from qlora_kit.registries.formats import FORMATS, IGNORE_INDEX, alpaca_prompt, system_text

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection


def render(row: dict[str, Any], fmt: str, tokenizer, data: DataSection) -> list[Segment]:
    """The row as text segments; the response (or each assistant turn) is the trained part. ``data``
    (the recipe's data section) gives the system prompt, its mode and ShareGPT's role names."""
    spec = FORMATS[fmt]
    if spec.pairs:  # a pair's fields are text or conversations: preference.py checks them
        return render_chosen(row, spec.pair_kind, tokenizer, data)
    if not spec.labelled:  # a labelled answer's too (render_feedback)
        for name in spec.fields:
            _check_field(row, name, optional=name in spec.optional)
    return RENDERINGS[fmt].render(row, tokenizer, data)


def prompt(
    text: str, fmt: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None
) -> str:
    """The user's text as the model saw prompts in training (the format's own prompt function below,
    with the recipe's system prompt)."""
    return RENDERINGS[fmt].prompt(text, tokenizer, data, history)


def render_alpaca(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    prompt = system_text(data.system_prompt) + alpaca_prompt(row["instruction"], row.get("input"))
    return [Segment(prompt, False), Segment(row["output"] + tokenizer.eos_token, True)]


def render_completion(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    prompt = system_text(data.system_prompt) + row["prompt"]
    return [Segment(prompt, False), Segment(row["completion"] + tokenizer.eos_token, True)]


def render_feedback(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    prompt_text, answer = preference.render_feedback(row, False, tokenizer, data)
    return [Segment(prompt_text, False), Segment(answer, True)]


def render_feedback_chat(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    prompt_text, answer = preference.render_feedback(row, True, tokenizer, data)
    return [Segment(prompt_text, False), Segment(answer, True)]


def render_text(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    return [Segment(row["text"] + tokenizer.eos_token, True)]


def render_conversation(row: dict[str, Any], tokenizer, data: DataSection) -> list[Segment]:
    messages = _messages(row, data)
    return render_chat(
        messages,
        tokenizer,
        data.system_prompt_mode,
        tools=row.get("tools"),
        train_reasoning=data.train_reasoning,
    )


def _messages(row: dict[str, Any], data: DataSection) -> list[Any]:
    """A chat or ShareGPT row's conversation as chat messages, with data.system_prompt."""
    if "conversations" in row and "messages" not in row:
        return with_system_prompt(sharegpt_messages(row["conversations"], data.roles), data.system_prompt)
    return with_system_prompt(row["messages"], data.system_prompt)


def prompts_render_as_trained(row: dict[str, Any], fmt: str, tokenizer, data: DataSection) -> int | None:
    """Whether each assistant turn's prompt, rendered as inference renders it, starts the rendering
    training sees (chat.prompt_rendering's codes); None for formats that are not conversations."""
    if not FORMATS[fmt].multi_turn:
        return None
    return prompt_rendering(_messages(row, data), tokenizer, data.system_prompt_mode, row.get("tools"))


def _check_field(row: dict[str, Any], name: str, optional: bool) -> None:
    value = row.get(name)
    if name in ("messages", "conversations"):
        if not isinstance(value, list) or not value:
            pair = "{role, content}" if name == "messages" else "{from, value}"
            raise RowError(f"field {name!r} must be a non-empty list of {pair} (got {show(value)})")
        return
    if name == "images":  # a ShareGPT row's image paths (images.py)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise RowError(f"field 'images' must be a list of image paths (got {show(value)})")
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


def alpaca_prompt_for(
    text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None
) -> str:
    return system_text(data.system_prompt) + alpaca_prompt(text)


def chat_prompt(text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None) -> str:
    """The conversation so far and the user's text, rendered as training rendered it (chat.py)."""
    if tokenizer.chat_template is None:
        return text
    messages = with_system_prompt([*(history or []), {"role": "user", "content": text}], data.system_prompt)
    messages = apply_system_prompt_mode(messages, data.system_prompt_mode)
    return apply_template(tokenizer, messages, generation_prompt=True, mode=data.system_prompt_mode)


def completion_prompt(
    text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None
) -> str:
    return system_text(data.system_prompt) + text


def raw_prompt(text: str, tokenizer, data: DataSection, history: list[dict[str, str]] | None = None) -> str:
    return text


@dataclass(frozen=True)
class Rendering:
    """A format's two functions: ``render`` (row, tokenizer, data section) -> segments, the trained part
    marked (None for a preference pair: ``render`` gives its prompt and chosen answer through
    ``render_chosen``, by the spec's ``pair_kind``); ``prompt`` (text, tokenizer, data section,
    history) -> the prompt a model continues."""

    render: Callable[..., list[Segment]] | None
    prompt: Callable[..., str]


# One line per registries/formats.py entry (tests/test_data.py checks the names match)
RENDERINGS: dict[str, Rendering] = {
    "alpaca": Rendering(render_alpaca, alpaca_prompt_for),
    "chat": Rendering(render_conversation, chat_prompt),
    "sharegpt": Rendering(render_conversation, chat_prompt),
    "completion": Rendering(render_completion, completion_prompt),
    "text": Rendering(render_text, raw_prompt),
    "preference": Rendering(None, completion_prompt),
    "preference_alpaca": Rendering(None, alpaca_prompt_for),
    "preference_chat": Rendering(None, chat_prompt),
    "feedback": Rendering(render_feedback, completion_prompt),
    "feedback_chat": Rendering(render_feedback_chat, chat_prompt),
}
