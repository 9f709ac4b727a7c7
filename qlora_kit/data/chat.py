"""Chat rows: the conversation rendered once by the tokenizer's own chat template, and the trained spans
found in that text.

Each assistant message's content is located in the rendered text, left to right, and trained together
with the end-of-turn marker the template puts right after it (the first special token there, such as
``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>`` or ``</s>``); everything else — headers,
system prompts (the template's default one too), user turns, separators and whatever the template
appends after the whole conversation — is not trained. This needs no property of the template beyond
rendering each reply's text: it works where rendering a conversation's start is not a prefix of
rendering the whole (Mistral v0.3 puts the system prompt in the *last* user turn, Phi-3 appends EOS
after the conversation, Qwen3 drops the reasoning of earlier turns). A reply is found verbatim, or
trimmed (templates that ``| trim`` content), with the spaces just before it (Mistral's
``[/INST] reply``: the model generates that space), or, for an earlier turn whose ``<think>`` block the
template dropped, as the answer after it — the dropped reasoning is then not trained in that turn,
since the model never sees it there.

Templates with ``{% generation %}`` markers are checked against transformers' own assistant mask
(``return_assistant_tokens_mask``): both must train the same text, or the row is refused.

Tool use (OpenAI's shape): a row's ``tools`` go to the template, which renders the schemas; an
assistant turn with ``tool_calls`` is trained as the template writes it (JSON in tags, special
tokens: its own business), located as what rendering the conversation through that turn adds to
rendering the conversation before it with the generation prompt; ``tool`` results are not trained.
ShareGPT rows (``{from, value}`` turns) become messages first (``sharegpt_messages``).

``data.system_prompt_mode`` makes system prompts usable with templates that have no system role:
``keep`` (as given), ``merge_into_first_user`` (prepended to the first user message) or ``drop``.
A template that refuses a conversation (no system role, strict alternation) is one line naming the row
and the template's own message.
"""

from __future__ import annotations

import json
import re
from typing import Any

from qlora_kit.data.segments import RowError, Segment, show

# developer: harmony's (gpt-oss's) instructions turn, a prompt turn like system
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
# ShareGPT's speaker names (``from``) and the chat role of each; data.roles adds more
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
SYSTEM_PROMPT_MODES = ("keep", "merge_into_first_user", "drop")
REASONING_END = "</think>"
# harmony (gpt-oss) ends a conversation's last answer with <|return|>, its other turns with <|end|>
_END_NAME = re.compile(r"end|eot|eos|</s>|return", re.IGNORECASE)


def render_chat(
    messages: list[Any],
    tokenizer,
    system_prompt_mode: str = "keep",
    tools: list | str | None = None,
    train_reasoning: bool = False,
) -> list[Segment]:
    """Segments of a conversation: each assistant reply (or tool call) and its end-of-turn marker
    trained, nothing else. ``tools``: the tool schemas the template renders (a list, or its JSON).
    ``train_reasoning``: an assistant message's ``thinking`` (harmony's analysis channel), where the
    template renders it, trains too, with its end marker; off, it is context only."""
    _check_messages(messages)
    if tokenizer.chat_template is None:
        raise RowError("format 'chat' needs a tokenizer with a chat template; this one has none")
    tools = _tool_schemas(tools)
    messages = apply_system_prompt_mode(messages, system_prompt_mode)
    text = apply_template(tokenizer, messages, generation_prompt=False, mode=system_prompt_mode, tools=tools)
    special = special_tokens(tokenizer)
    searchable = _mask(text, special)  # a reply is never found inside a special token
    segments: list[Segment] = []
    cursor = kept = 0  # where the search goes on; the end of the text already in segments
    for i, message in enumerate(messages):
        if message["role"] in ("user", "tool"):
            # Past each prompt turn, so a reply that repeats the question is found in its own turn. (System
            # prompts are not passed over: templates move them, e.g. into the last user turn.)
            found = searchable.find(message["content"], cursor) if message["content"] else -1
            cursor = found + len(message["content"]) if found >= 0 else cursor
            continue
        if message["role"] != "assistant":
            continue
        if not message["content"].strip() and not message.get("tool_calls"):
            raise RowError(f"messages[{i}]: the assistant message is empty; there is nothing to train")
        header = _assistant_header(tokenizer, messages[:i], system_prompt_mode, tools)
        at = text.find(header, cursor) if header else -1
        cursor = at + len(header) if at >= 0 else cursor
        if message.get("thinking"):  # passed over either way: the answer is searched for after it
            found = _locate_reasoning(
                text, searchable, message["thinking"], cursor, tokenizer, special, header
            )
            if found is not None:  # a template that drops earlier turns' reasoning: nothing there
                start, end = found
                cursor = end
                if train_reasoning:
                    segments += [Segment(text[kept:start], False), Segment(text[start:end], True)]
                    kept = end
        if message.get("tool_calls"):
            start, reply = _locate_tool_call(tokenizer, text, messages, i, cursor, system_prompt_mode, tools)
        else:
            start, reply = _locate(searchable, message["content"], cursor)
        if start < 0:
            raise RowError(
                f"messages[{i}]: the chat template changes this assistant message's text, so the tokens "
                "to train cannot be found in the rendered conversation"
            )
        end = start + len(reply)
        if not message.get("tool_calls"):  # a located tool call ends with its marker already
            end += len(_marker_at(text, end, end_of_turn_markers(tokenizer, special, header)))
        while start > kept and text[start - 1] == " ":
            # "[/INST] reply": the model generates that space (SentencePiece's "▁reply"), so it is trained
            start -= 1
        segments += [Segment(text[kept:start], False), Segment(text[start:end], True)]
        cursor = kept = end
    segments.append(Segment(text[kept:], False))  # turns after the last reply, a trailing EOS
    segments = [s for s in segments if s.text]
    if _has_generation_markers(tokenizer):
        _check_against_generation_mask(tokenizer, messages, segments, tools)
    return segments


def prefix_consistent(
    messages: list[Any], tokenizer, system_prompt_mode: str = "keep", tools: list | str | None = None
) -> bool:
    """Whether the prompt of every assistant turn, as inference renders it (the conversation so far with
    the generation prompt), is the start of the whole conversation as training renders it. Mistral
    v0.3, for one, moves the system prompt into the last user turn, so an earlier turn's prompt differs."""
    tools = _tool_schemas(tools)
    messages = apply_system_prompt_mode(messages, system_prompt_mode)
    whole = apply_template(tokenizer, messages, generation_prompt=False, mode=system_prompt_mode, tools=tools)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = apply_template(
                tokenizer, messages[:i], generation_prompt=True, mode=system_prompt_mode, tools=tools
            )
            if not whole.startswith(prompt):
                return False
    return True


# How a conversation's turn prompts render against the whole conversation (row_tokens.FACTS' prefix_ok)
PROMPTS_SAME, PROMPTS_DIFFER, SYSTEM_PLACED = 1, 0, 2


def prompt_rendering(
    messages: list[Any], tokenizer, system_prompt_mode: str = "keep", tools: list | str | None = None
) -> int:
    """PROMPTS_SAME when every turn's prompt starts the whole rendering (prefix_consistent);
    SYSTEM_PLACED when they differ only by where the template puts the system prompt (Mistral v0.3's
    puts it into the last user turn alone, so earlier turns are trained without it and asked with it:
    the family's own rendering); PROMPTS_DIFFER otherwise."""
    if prefix_consistent(messages, tokenizer, system_prompt_mode, tools):
        return PROMPTS_SAME
    without = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "system")]
    if len(without) < len(messages) and prefix_consistent(without, tokenizer, system_prompt_mode, tools):
        return SYSTEM_PLACED
    return PROMPTS_DIFFER


def sharegpt_messages(conversations: list[Any], roles: dict[str, str]) -> list[dict[str, Any]]:
    """ShareGPT turns (``{from, value}``) as chat messages; ``roles`` (data.roles) adds speaker names."""
    names = SHAREGPT_ROLES | roles
    messages = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict) or not {"from", "value"} <= turn.keys():
            raise RowError(f"conversations[{i}]: must be {{from, value}} (got {show(turn)})")
        if turn["from"] not in names:
            raise RowError(
                f"conversations[{i}]: unknown speaker {turn['from']!r}; map it to a role with data.roles "
                f"(known: {', '.join(sorted(names))})"
            )
        messages.append({"role": names[turn["from"]], "content": turn["value"]})
    return messages


def with_system_prompt(messages: list[Any], system_prompt: str | None) -> list[Any]:
    """``messages`` with data.system_prompt as a first system message, unless they have one."""
    has_system = any(isinstance(m, dict) and m.get("role") == "system" for m in messages)
    if system_prompt is None or has_system:
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def apply_system_prompt_mode(messages: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    messages = [_message(m) for m in messages]
    if mode == "keep" or not any(m["role"] == "system" for m in messages):
        return messages
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [m for m in messages if m["role"] != "system"]
    if mode == "merge_into_first_user":
        first = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
        if first is None:
            raise RowError("data.system_prompt_mode merge_into_first_user: the conversation has no user turn")
        rest[first] = {"role": "user", "content": f"{system}\n\n{rest[first]['content']}"}
    return rest


def apply_template(
    tokenizer,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    mode: str = "keep",
    tools: list | None = None,
) -> str:
    """The template's text for ``messages``; a template that refuses them is a RowError with its message."""
    from jinja2.exceptions import TemplateError  # jinja2 loads with the template, not with the recipe

    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
    except TemplateError as exc:
        hint = ""
        if mode == "keep" and any(m["role"] == "system" for m in messages):
            hint = "; set data.system_prompt_mode: merge_into_first_user (or drop) for a template without a system role"
        raise RowError(f"the chat template refuses this conversation: {exc}{hint}") from None


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special tokens (its named ones and every added special token), longest first."""
    special = set(tokenizer.all_special_tokens)
    special |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted((t for t in special if t), key=len, reverse=True)


def end_of_turn_markers(tokenizer, special: list[str], header: str = "") -> list[str]:
    """Of ``special``, the tokens that end a turn, longest first: EOS, and those named for an end
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``, ``<|EOT|>``) that are not part of
    the assistant header (Llama 3's ``<|end_header_id|>``). BOS, UNK and turn headers never end a turn."""
    excluded = {tokenizer.bos_token, tokenizer.unk_token}
    ends = {t for t in special if t not in excluded and t not in header and _END_NAME.search(t)}
    if tokenizer.eos_token:
        ends.add(tokenizer.eos_token)
    return sorted(ends, key=len, reverse=True)


def _assistant_header(tokenizer, before: list[dict[str, Any]], mode: str, tools: list | None = None) -> str:
    """What the template puts before a reply (``<|im_start|>assistant\n``): the generation prompt it
    adds to the conversation so far; empty where it adds none or renders the two differently."""
    if not before:
        return ""
    plain = apply_template(tokenizer, before, generation_prompt=False, mode=mode, tools=tools)
    prompted = apply_template(tokenizer, before, generation_prompt=True, mode=mode, tools=tools)
    return prompted[len(plain) :] if prompted.startswith(plain) else ""


def _locate_tool_call(
    tokenizer, text: str, messages: list[dict[str, Any]], i: int, cursor: int, mode: str, tools: list | None
) -> tuple[int, str]:
    """(offset, text) of an assistant turn with tool calls, up to its end-of-turn marker. How a call is
    written (JSON in tags, special tokens) is the template's own, so the turn is what rendering the
    conversation through it adds to rendering the conversation before it with the generation prompt."""
    before = apply_template(tokenizer, messages[:i], generation_prompt=True, mode=mode, tools=tools)
    through = apply_template(tokenizer, messages[: i + 1], generation_prompt=False, mode=mode, tools=tools)
    turn = through[len(before) :] if through.startswith(before) else ""
    ends = [
        turn.find(m) + len(m) for m in end_of_turn_markers(tokenizer, special_tokens(tokenizer)) if m in turn
    ]
    turn = turn[: min(ends)] if ends else turn.rstrip()
    start = text.find(turn, cursor) if turn.strip() else -1
    if start < 0:
        raise RowError(
            f"messages[{i}]: the chat template renders the conversation before this tool call differently "
            "on its own, so the call's tokens cannot be found in the rendered conversation"
        )
    return start, turn


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the template gets it: datasets fills fields other rows have with None (a user turn
    gets ``tool_calls: None``); those are left out, so templates that test ``is defined`` see them absent."""
    kept = {key: _without_nones(value) for key, value in message.items() if value is not None}
    kept.setdefault("content", "")
    return kept


def _without_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value


def _tool_schemas(tools: list | str | None) -> list | None:
    """The row's tools as a list of schemas: given as a list, or as JSON text (as many datasets store them)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise RowError(f"field 'tools' is not valid JSON ({exc})") from None
        if not isinstance(tools, list):
            raise RowError(f"field 'tools' must be a list of tool schemas (got {show(tools)})")
    return _without_nones(tools) if tools else None


def _mask(text: str, special: list[str]) -> str:
    """``text`` with every special token blanked out (same length), for searching replies in."""
    for token in special:  # longest first, so no token is cut by a shorter one inside it
        text = text.replace(token, "\0" * len(token))
    return text


def _check_messages(messages: list[Any]) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise RowError(f"messages[{i}]: role must be one of {sorted(CHAT_ROLES)} (got {show(message)})")
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise RowError(
                f"messages[{i}]: tool_calls must be a list, in an assistant message (got {show(calls)})"
            )
        if not isinstance(message.get("content"), str) and not (calls and message.get("content") is None):
            raise RowError(f"messages[{i}]: content must be text (got {show(message.get('content'))})")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("conversation has no assistant turn to train on")


def _locate(text: str, content: str, cursor: int) -> tuple[int, str]:
    """(offset, the reply as rendered): verbatim, trimmed, or the answer after dropped reasoning."""
    candidates = [content, content.strip()]
    if REASONING_END in content:
        candidates.append(content.split(REASONING_END)[-1].strip())
    for candidate in candidates:
        if candidate:
            start = text.find(candidate, cursor)
            if start >= 0:
                return start, candidate
    return -1, content


def _locate_reasoning(
    text: str, searchable: str, thinking: str, cursor: int, tokenizer, special: list[str], header: str
) -> tuple[int, int] | None:
    """(start, end) of a reply's reasoning in the rendered text, its end-of-turn marker included (harmony's
    analysis message ends with <|end|>), or None where the template does not render it."""
    start, found = _locate(searchable, thinking, cursor)
    if start < 0:
        return None
    end = start + len(found)
    return start, end + len(_marker_at(text, end, end_of_turn_markers(tokenizer, special, header)))


def _marker_at(text: str, end: int, markers: list[str]) -> str:
    """The end-of-turn marker after a reply, with the whitespace before it (Llama 2's `` </s>``,
    DeepSeek's ``\n<|EOT|>``); empty when the turn has none."""
    gap = len(text[end:]) - len(text[end:].lstrip(" \n"))
    return next((text[end : end + gap + len(m)] for m in markers if text.startswith(m, end + gap)), "")


def _has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "generation %}" in template


def _check_against_generation_mask(
    tokenizer, messages: list[dict[str, Any]], segments: list[Segment], tools: list | None = None
) -> None:
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = [t for t, m in zip(rendered["input_ids"], rendered["assistant_masks"], strict=True) if m]
    theirs = tokenizer.decode(ids)
    ours = "".join(s.text for s in segments if s.trained)
    if theirs.split() != ours.split():  # decoding may normalise spaces; the words must match
        raise RowError(
            f"the chat template's {{% generation %}} markers train {show(theirs)} but its rendered text "
            f"puts the replies at {show(ours)}"
        )
