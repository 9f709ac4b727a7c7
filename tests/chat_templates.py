"""Chat templates written for the tests, each behaving like a popular model family's (on the demo
tokenizer, with that family's special tokens added): what the masking must handle.

Each entry: the template, the special tokens it needs, its end-of-turn marker, and whether it accepts a
system message as it is.
"""

LLAMA3 = (  # BOS inside the template, header tokens, <|eot_id|> after every turn
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

QWEN25 = (  # ChatML with a default system prompt when the conversation has none
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MISTRAL_V03 = (  # the system prompt goes into the *last* user turn; </s> after each reply
    "{{ bos_token }}{% set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | list %}"
    "{% set loop_messages = messages | rejectattr('role', 'equalto', 'system') | list %}"
    "{% set last_user = (loop_messages | selectattr('role', 'equalto', 'user') | list | length) %}"
    "{% set ns = namespace(users=0) %}"
    "{% for m in loop_messages %}{% if m['role'] == 'user' %}{% set ns.users = ns.users + 1 %}"
    "[INST] {% if ns.users == last_user and system %}{{ system[0] }}\n\n{% endif %}{{ m['content'] }}[/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

PHI3 = (  # <|end|> after each turn, and EOS appended after the whole conversation
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)

GEMMA = (  # no system role, strict alternation, 'model' for the assistant
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

QWEN3 = (  # ChatML; the reasoning of every assistant turn but the last is dropped
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 != ns.last and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip('\n') }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

GENERATION_MARKERS = (  # ChatML with {% generation %} around each reply and its <|im_end|>
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS_CHATML = (  # Qwen2.5's way with tools: schemas in the system turn, calls as JSON in <tool_call> tags,
    # tool results as a user turn in <tool_response> tags
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% elif m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% if m['content'] %}"
    '{{ m[\'content\'] }}\n{% endif %}{% for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
FAMILIES = {
    # name: (template, special tokens to add, end-of-turn marker, takes a system message as it is)
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        True,
    ),
    "qwen2.5": (QWEN25, CHATML_TOKENS, "<|im_end|>", True),
    "mistral-v0.3": (MISTRAL_V03, ["[INST]", "[/INST]"], "</s>", True),
    "phi3": (PHI3, ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], "<|end|>", True),
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", False),
    "qwen3": (QWEN3, CHATML_TOKENS, "<|im_end|>", True),
    "generation-markers": (GENERATION_MARKERS, CHATML_TOKENS, "<|im_end|>", True),
    "tools-chatml": (TOOLS_CHATML, CHATML_TOKENS, "<|im_end|>", True),
}


def family_tokenizer(demo_tokenizer, family: str):
    """The demo tokenizer (conftest's ``tokenizer``) with a family's chat template and special tokens."""
    import copy

    template, tokens, _, _ = FAMILIES[family]
    tokenizer = copy.deepcopy(demo_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = template
    return tokenizer


# gpt-oss's harmony format, as its template renders a conversation: its own system turn first, the recipe's
# system prompt as the developer's instructions, each assistant turn as a final-channel message, the
# reasoning (a message's `thinking`) as an analysis-channel message kept for the last turn only, and the
# conversation's last answer ended by <|return|> where every other turn ends with <|end|>
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: medium"
    "\n\n# Valid channels: analysis, commentary, final.<|end|>"
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] in ('system', 'developer') %}"
    "<|start|>developer<|message|># Instructions\n\n{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}"
    "{% if m.thinking and loop.index0 == ns.last %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}"
    "{% if loop.index0 == ns.last and not add_generation_prompt %}<|return|>{% else %}<|end|>{% endif %}"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
