"""Preference pairs (``train.objective: dpo``): a prompt, a chosen and a rejected answer, as token ids.

Three formats: TRL's two shapes, and alpaca's for DPO after an alpaca SFT run:

- ``preference``: ``prompt``, ``chosen`` and ``rejected`` texts; each answer ends with the tokenizer's EOS;
- ``preference_alpaca``: ``instruction`` (and an optional ``input``), ``chosen``, ``rejected``: the prompt
  framed exactly as format alpaca frames it for SFT, so an alpaca SFT adapter is asked as it learned;
- ``preference_chat``: ``prompt`` is a conversation (a list of ``{role, content}``, or one user text) and
  ``chosen`` / ``rejected`` are the assistant's reply (a text, or a list of assistant messages), rendered
  with the tokenizer's chat template: the prompt with the generation prompt, each answer as the rest of
  the whole conversation's rendering (its end-of-turn marker included).

qlora_kit tokenizes the pairs itself (the same sources, field mapping, length policy and one-line errors
as supervised data), so TRL's DPOTrainer receives ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` and
its collator builds the batches. The length policy: the prompt keeps its last ``preference.max_prompt_len``
tokens (the end, next to the answer), then each answer is cut to fit ``data.max_seq_len`` (or, with
``data.overlong: drop``, the pair is left out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qlora_kit.data.chat import apply_system_prompt_mode, apply_template, with_system_prompt
from qlora_kit.data.segments import RowError, Segment, show
from qlora_kit.registries.formats import alpaca_prompt, system_text

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection

SIDES = ("chosen", "rejected")
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def render_pair(row: dict[str, Any], kind: str, tokenizer, data: DataSection) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) as the texts the model reads and writes; a RowError for a bad row.
    ``kind``: text (the prompt as it is), alpaca (an instruction and an optional input, framed as format
    alpaca frames them for SFT) or chat (see the module docstring)."""
    asked = ("instruction",) if kind == "alpaca" else ("prompt",)
    for name in (*asked, *SIDES):
        if row.get(name) is None:
            raise RowError(f"missing field {name!r}")
    if kind == "chat":
        prompt, chosen, rejected = _render_chat_pair(row, tokenizer, data)
    else:
        given = ("input",) if kind == "alpaca" and row.get("input") is not None else ()
        for name in (*asked, *given, *SIDES):
            if not isinstance(row[name], str):
                raise RowError(
                    f"field {name!r} must be text (got {type(row[name]).__name__} {show(row[name])})"
                )
        system = system_text(data.system_prompt)
        asking = alpaca_prompt(row["instruction"], row.get("input")) if kind == "alpaca" else row["prompt"]
        prompt = system + asking
        chosen, rejected = (row[side] + tokenizer.eos_token for side in SIDES)
    for side in SIDES:
        if not _answer_text(row[side]).strip():
            raise RowError(f"field {side!r} is empty; a pair needs two answers to compare")
    if chosen == rejected:
        raise RowError("chosen and rejected are the same answer; the pair teaches nothing")
    return prompt, chosen, rejected


def render_chosen(row: dict[str, Any], kind: str, tokenizer, data: DataSection) -> list[Segment]:
    """The pair as supervised segments: the prompt, then the chosen answer trained (for the data preview,
    the sample prompts and exact-match evaluation, which compare against the chosen answer)."""
    prompt, chosen, _ = render_pair(row, kind, tokenizer, data)
    return [Segment(prompt, False), Segment(chosen, True)]


def tokenize_pair(
    texts: tuple[str, str, str],
    tokenizer,
    add_bos: bool,
    max_len: int,
    max_prompt_len: int | None,
    drop: bool,
) -> tuple[dict[str, list[int]], int]:
    """The pair's token ids after the length policy, and its longer side's length before the answers are
    cut (the prompt, already cut to ``max_prompt_len``, plus the answer): above ``max_len`` the pair is
    truncated or dropped, as data.overlong counts it. A dropped pair has empty answers."""
    prompt, chosen, rejected = texts
    prompt_ids = tokenizer(prompt, add_special_tokens=add_bos)["input_ids"]
    answers = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (chosen, rejected)]
    if max_prompt_len is not None and len(prompt_ids) > max_prompt_len:
        prompt_ids = prompt_ids[-max_prompt_len:]
    full = len(prompt_ids) + max(len(ids) for ids in answers)
    room = max(max_len - len(prompt_ids), 0)
    if any(len(ids) > room for ids in answers):
        answers = [[] if drop else ids[:room] for ids in answers]
    return dict(zip(PAIR_COLUMNS, [prompt_ids, *answers], strict=True)), full


def _render_chat_pair(row: dict[str, Any], tokenizer, data: DataSection) -> tuple[str, str, str]:
    prompt_text, chosen, rejected = render_chat_answers(
        row["prompt"], {s: row[s] for s in SIDES}, tokenizer, data
    )
    return prompt_text, chosen, rejected


def chat_prompt_messages(value: Any, data: DataSection) -> list[dict[str, Any]]:
    """A row's ``prompt`` (a conversation, or one user text) as the messages the template renders, with
    data.system_prompt and its mode applied."""
    prompt = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
        raise RowError(f"field 'prompt' must be text or a list of {{role, content}} (got {show(value)})")
    return apply_system_prompt_mode(with_system_prompt(prompt, data.system_prompt), data.system_prompt_mode)


def render_chat_answers(
    prompt: Any, answers: dict[str, Any], tokenizer, data: DataSection
) -> tuple[str, ...]:
    """(the prompt with the generation prompt, then each answer as the rest of the whole conversation's
    rendering, its end-of-turn marker included), by the tokenizer's chat template. ``answers``: field
    name -> the assistant's reply (a text, or a list of assistant messages)."""
    if tokenizer.chat_template is None:
        raise RowError("this format needs a tokenizer with a chat template; this one has none")
    mode = data.system_prompt_mode
    messages = chat_prompt_messages(prompt, data)
    prompt_text = apply_template(tokenizer, messages, generation_prompt=True, mode=mode)
    rendered = []
    for field, value in answers.items():
        reply = assistant_messages(value, field)
        whole = apply_template(tokenizer, messages + reply, generation_prompt=False, mode=mode)
        if not whole.startswith(prompt_text):
            raise RowError(
                f"the chat template renders the prompt differently once the {field} answer follows, so the "
                "answer's tokens cannot be told from the prompt's"
            )
        rendered.append(whole[len(prompt_text) :])
    return (prompt_text, *rendered)


def render_feedback(row: dict[str, Any], chat: bool, tokenizer, data: DataSection) -> tuple[str, str]:
    """A labelled answer (formats feedback and feedback_chat) as (prompt, answer) texts the model reads
    and writes; a RowError for a bad row. ``chat``: the prompt a conversation and the answer the
    assistant's reply, by the chat template (its end-of-turn marker trained, as format chat trains it);
    else both texts, the answer ending with the tokenizer's EOS (as TRL's KTOTrainer appends it)."""
    for name in ("prompt", "completion"):
        if row.get(name) is None:
            raise RowError(f"missing field {name!r}")
    label = row.get("label")
    if not isinstance(label, bool):
        raise RowError(f"field 'label' must be true or false (got {show(label)})")
    if chat:
        return render_chat_answers(row["prompt"], {"completion": row["completion"]}, tokenizer, data)
    for name in ("prompt", "completion"):
        if not isinstance(row[name], str):
            raise RowError(f"field {name!r} must be text (got {type(row[name]).__name__} {show(row[name])})")
    return system_text(data.system_prompt) + row["prompt"], row["completion"] + tokenizer.eos_token


def assistant_messages(value: Any, side: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and m.get("role") == "assistant" for m in value)
        and all(isinstance(m.get("content"), str) for m in value)
    ):
        return [{"role": "assistant", "content": m["content"]} for m in value]
    raise RowError(f"field {side!r} must be text or a list of assistant messages (got {show(value)})")


def _answer_text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(m.get("content") or "" for m in value if isinstance(m, dict))
    return value if isinstance(value, str) else ""
