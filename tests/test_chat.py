"""Chat masking on templates that behave like the popular families' (tests/chat_templates.py): each
assistant turn's reply and its end-of-turn marker are trained, token by token, and nothing else; the
prompt at inference is the prefix training saw; templates that refuse a conversation are one line."""

import copy
import json

import pytest

from qlora_kit import Recipe
from qlora_kit.data import formats, prepare
from qlora_kit.data.chat import apply_system_prompt_mode, apply_template, render_chat
from qlora_kit.data.formats import IGNORE_INDEX, RowError
from qlora_kit.errors import DataError

from .chat_templates import FAMILIES, family_tokenizer

SYSTEM = {"role": "system", "content": "Answer in one word."}
ONE_TURN = [
    {"role": "user", "content": "What sound does a cow make?"},
    {"role": "assistant", "content": "moo"},
]
MULTI_TURN = [
    *ONE_TURN,
    {"role": "user", "content": "And a cat?"},
    {"role": "assistant", "content": "<think>\nCats purr and meow.\n</think>\n\nmeow"},
]
CASES = [
    (family, turns, system)
    for family in FAMILIES
    for turns in ("1-turn", "multi-turn")
    for system in (False, True)
]


def conversation(turns: str, system: bool) -> list[dict[str, str]]:
    return [*([SYSTEM] if system else []), *(ONE_TURN if turns == "1-turn" else MULTI_TURN)]


def trained_runs(labels: list[int]) -> list[list[int]]:
    runs, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(label)
    return runs + ([current] if current else [])


def rendered_reply(family: str, messages: list[dict[str, str]], index: int) -> str:
    """The reply as the family renders it: Qwen3 drops earlier turns' reasoning, trimming templates trim."""
    content = messages[index]["content"]
    is_last = index == max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if family == "qwen3" and not is_last:
        return content.split("</think>")[-1].lstrip("\n")
    return content.strip() if family in ("llama3", "gemma") else content


@pytest.mark.parametrize(
    ("family", "turns", "system"),
    CASES,
    ids=[f"{f}-{t}-{'system' if s else 'no-system'}" for f, t, s in CASES],
)
def test_each_reply_and_its_end_marker_are_trained_and_nothing_else(tokenizer, family, turns, system):
    tokenizer = family_tokenizer(tokenizer, family)
    _, _, marker, takes_system = FAMILIES[family]
    mode = "keep" if takes_system or not system else "merge_into_first_user"
    messages = conversation(turns, system)
    segments = render_chat(messages, tokenizer, mode)
    example = formats.tokenize(segments, tokenizer, train_on_inputs=False, add_bos=False)

    shown = apply_system_prompt_mode(messages, mode)
    replies = [i for i, m in enumerate(shown) if m["role"] == "assistant"]
    decoded = [tokenizer.decode(run).strip() for run in trained_runs(example["labels"])]
    assert decoded == [rendered_reply(family, shown, i) + marker for i in replies]
    # Every token is the rendered conversation's: nothing added, nothing lost.
    assert tokenizer.decode(example["input_ids"]) == apply_template(tokenizer, shown, generation_prompt=False)
    # The prompt at inference (generate, chat, sample prompts, exact match) is exactly what training put
    # before the reply. (Within a longer conversation Mistral v0.3 moves the system prompt to the last
    # user turn, so an earlier turn's prefix is the template's own, not a one-turn prompt's.)
    if turns == "1-turn":
        assert formats.prompt_text(segments) == apply_template(tokenizer, shown[:-1], generation_prompt=True)


def test_a_template_without_a_system_role_is_one_line_with_the_way_out(tokenizer, tmp_path):
    tokenizer = family_tokenizer(tokenizer, "gemma")
    with pytest.raises(
        RowError,
        match=r"^the chat template refuses this conversation: System role not supported; set data\.system_prompt_mode",
    ):
        render_chat([SYSTEM, *ONE_TURN], tokenizer)
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m}) for m in [ONE_TURN, [SYSTEM, *ONE_TURN]]) + "\n")
    data = Recipe.from_dict({"data": {"path": str(path), "format": "chat"}}).data
    with pytest.raises(
        DataError, match=rf"^{path}: row 2: the chat template refuses this conversation: System role"
    ):
        prepare.prepare_datasets(data, tokenizer, seed=0)
    merged = data.model_copy(update={"system_prompt_mode": "merge_into_first_user"})
    assert len(prepare.prepare_datasets(merged, tokenizer, seed=0).train) >= 1
    dropped = render_chat([SYSTEM, *ONE_TURN], tokenizer, "drop")
    assert "Answer in one word." not in "".join(s.text for s in dropped)


def test_strict_alternation_is_the_templates_own_message(tokenizer):
    tokenizer = family_tokenizer(tokenizer, "gemma")
    twice = [ONE_TURN[0], ONE_TURN[0], ONE_TURN[1]]
    with pytest.raises(RowError, match=r"refuses this conversation: Conversation roles must alternate"):
        render_chat(twice, tokenizer)


def test_a_template_that_rewrites_a_reply_names_the_message(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    )
    with pytest.raises(
        RowError, match=r"^messages\[1\]: the chat template changes this assistant message's text"
    ):
        render_chat(ONE_TURN, tokenizer)


def test_generation_markers_and_the_rendered_text_must_agree(tokenizer):
    """The marker template agrees (checked inside render_chat); a template whose markers cover only the
    reply while the turn ends with <|im_end|> is refused."""
    tokenizer = family_tokenizer(tokenizer, "generation-markers")
    render_chat(MULTI_TURN, tokenizer)  # agrees: no error
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{ m['content'] }}<|im_end|>{% endgeneration %}", "{{ m['content'] }}{% endgeneration %}<|im_end|>"
    )
    with pytest.raises(RowError, match=r"generation %\} markers train"):
        render_chat(MULTI_TURN, tokenizer)


def test_system_prompt_mode_only_applies_to_chat():
    from qlora_kit.errors import RecipeError

    with pytest.raises(
        RecipeError, match=r"^data\.system_prompt_mode: only applies to formats chat and sharegpt"
    ):
        Recipe.from_dict({"data": {"system_prompt_mode": "drop"}})


@pytest.mark.parametrize(
    ("question", "reply"),
    [
        ("Pick: A or B?", "A"),
        ("Is it yes?", "yes"),
        ("Say the letter a.", "a"),
        ("Who are you?", "assistant"),
    ],
)
def test_a_reply_is_found_in_its_own_turn_not_earlier(tokenizer, question, reply):
    """A short reply that also occurs in the question, the system prompt or a header (``<|im_start|>``
    holds an 'a'; ``assistant`` is the header's word) is trained where the reply is."""
    tokenizer = family_tokenizer(tokenizer, "qwen2.5")
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    segments = render_chat(messages, tokenizer)
    trained = [s.text for s in segments if s.trained]
    assert trained == [f"{reply}<|im_end|>"]
    untrained = "".join(s.text for s in segments if not s.trained)
    assert untrained.endswith("<|im_start|>assistant\n") or untrained.endswith("<|im_start|>assistant\n\n")


def test_an_end_marker_after_a_newline_is_trained_and_headers_are_not_markers(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|EOT|>", "<|user|>"]})
    # DeepSeek-Coder-style: "\n<|EOT|>" after each reply
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n"
        "{% else %}### Response:\n{{ m['content'] }}\n<|EOT|>\n{% endif %}{% endfor %}"
    )
    assert [s.text for s in render_chat(ONE_TURN, tokenizer) if s.trained] == ["moo\n<|EOT|>"]
    # No end marker at all: the next turn's header is not trained as one.
    tokenizer.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
    assert [s.text for s in render_chat(MULTI_TURN[:3], tokenizer) if s.trained] == ["moo"]


def test_an_empty_reply_says_so(tokenizer):
    tokenizer = family_tokenizer(tokenizer, "qwen2.5")
    with pytest.raises(RowError, match=r"^messages\[1\]: the assistant message is empty"):
        render_chat([ONE_TURN[0], {"role": "assistant", "content": ""}], tokenizer)


def labelled(data_fields: dict, rows: list[dict], tokenizer, tmp_path, name: str = "rows.jsonl"):
    """Rows written to a file and prepared through the real loading and tokenizing path."""
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    data = Recipe.from_dict({"data": {"path": str(path), "packing": False, **data_fields}}).data
    return prepare.prepare_datasets(data, tokenizer, seed=0).train


@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "mistral-v0.3"])
def test_sharegpt_trains_token_for_token_what_the_same_chat_as_messages_trains(tokenizer, family, tmp_path):
    tokenizer = family_tokenizer(tokenizer, family)
    messages = [SYSTEM, *MULTI_TURN[:3], {"role": "assistant", "content": "meow"}]
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]
    as_chat = labelled({"format": "chat"}, [{"messages": messages}], tokenizer, tmp_path, "chat.jsonl")
    as_sharegpt = labelled({"format": "sharegpt"}, [{"conversations": sharegpt}], tokenizer, tmp_path)
    assert as_sharegpt[0]["input_ids"] == as_chat[0]["input_ids"]
    assert as_sharegpt[0]["labels"] == as_chat[0]["labels"]
    assert any(label != IGNORE_INDEX for label in as_chat[0]["labels"])


def test_sharegpt_role_names_are_configurable_and_an_unknown_one_names_the_row(tokenizer, tmp_path):
    tokenizer = family_tokenizer(tokenizer, "qwen2.5")
    rows = [{"conversations": [{"from": "customer", "value": "Hi?"}, {"from": "agent", "value": "hello"}]}]
    mapped = labelled(
        {"format": "sharegpt", "roles": {"customer": "user", "agent": "assistant"}}, rows, tokenizer, tmp_path
    )
    trained = [t for t in mapped[0]["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "hello<|im_end|>"
    with pytest.raises(
        DataError,
        match=r"row 1: conversations\[0\]: unknown speaker 'customer'; map it to a role with data\.roles",
    ):
        labelled({"format": "sharegpt"}, rows, tokenizer, tmp_path)


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Lima?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}
        ],
    },
    {"role": "tool", "content": '{"sky": "cloudy", "celsius": 19}'},
    {"role": "assistant", "content": "Cloudy, 19 degrees."},
]


@pytest.mark.parametrize("tools_as", ["list", "json"])
def test_tool_calls_and_replies_are_trained_and_tool_results_and_schemas_are_not(
    tokenizer, tools_as, tmp_path
):
    tokenizer = family_tokenizer(tokenizer, "tools-chatml")
    tools = [TOOL] if tools_as == "list" else json.dumps([TOOL])
    example = labelled({"format": "chat"}, [{"messages": TOOL_CHAT, "tools": tools}], tokenizer, tmp_path)[0]
    runs = [tokenizer.decode(run) for run in trained_runs(example["labels"])]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call><|im_end|>'
    assert runs == [call, "Cloudy, 19 degrees.<|im_end|>"]
    rendered = tokenizer.decode(example["input_ids"])
    assert '"name": "get_weather", "description"' in rendered and "<tool_response>" in rendered
    assert rendered == apply_template(tokenizer, TOOL_CHAT, generation_prompt=False, tools=[TOOL])


def test_a_system_prompt_is_added_where_a_row_has_none_and_prompts_at_inference_match(tokenizer, tmp_path):
    from qlora_kit.after.generate import wrap_prompt

    tokenizer = family_tokenizer(tokenizer, "qwen2.5")
    system = "You answer in one word."
    fields = {"format": "chat", "system_prompt": system}
    chats = labelled(fields, [{"messages": ONE_TURN}, {"messages": [SYSTEM, *ONE_TURN]}], tokenizer, tmp_path)
    assert system in tokenizer.decode(chats[0]["input_ids"])  # added
    assert system not in tokenizer.decode(chats[1]["input_ids"])  # the row's own is kept
    data = Recipe.from_dict({"data": fields}).data
    segments = formats.render({"messages": ONE_TURN}, "chat", tokenizer, data)
    assert wrap_prompt(ONE_TURN[0]["content"], data, tokenizer) == formats.prompt_text(segments)

    alpaca = Recipe.from_dict({"data": {"system_prompt": system}}).data
    row = {"instruction": "Capital of Peru?", "input": "", "output": "Lima"}
    segments = formats.render(row, "alpaca", tokenizer, alpaca)
    assert segments[0].text.startswith(system + "\n\n") and not segments[0].trained
    assert wrap_prompt("Capital of Peru?", alpaca, tokenizer) == formats.prompt_text(segments)
