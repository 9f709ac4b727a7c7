"""The Modelfile's TEMPLATE for chat runs: rendered as Ollama renders it (Go's text/template, the subset
in tests/go_template.py), a conversation comes out exactly as the tokenizer's apply_chat_template makes
it, single- and multi-turn, with and without a system message; its stop tokens hold the end-of-turn token.
The families' templates are tests/chat_templates.py's (on the demo tokenizer) and the real model's ChatML."""

from __future__ import annotations

import pytest

from qlora_kit.after import modelfile
from qlora_kit.model import loading as model

from .chat_templates import FAMILIES, family_tokenizer
from .go_template import render

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is a kettle?"}],
    "single, system": [
        {"role": "system", "content": "Answer in a few words."},
        {"role": "user", "content": "What is a kettle?"},
    ],
    "multi": [
        {"role": "user", "content": "What is a kettle?"},
        {"role": "assistant", "content": "A pot for boiling water."},
        {"role": "user", "content": "And a ladder?"},
    ],
    "multi, system": [
        {"role": "system", "content": "Answer in a few words."},
        {"role": "user", "content": "What is a kettle?"},
        {"role": "assistant", "content": "A pot for boiling water."},
        {"role": "user", "content": "And a ladder?"},
        {"role": "assistant", "content": "Steps between two poles."},
        {"role": "user", "content": "A saddle?"},
    ],
}
# templates that are per-role pieces (Qwen3's too, for replies without reasoning); Mistral's moves the
# system prompt into the last user turn, so it keeps the single-turn {{ .Prompt }} form (checked below)
PIECEWISE = ["llama3", "qwen2.5", "phi3", "gemma", "qwen3", "generation-markers", "tools-chatml"]


def check_template(tokenizer, end_of_turn: str, system: bool = True) -> None:
    pieces = modelfile.chat_pieces(tokenizer)
    assert pieces is not None
    template = modelfile.chat_template(pieces)
    for name, messages in CONVERSATIONS.items():
        if "system" in name and not system:
            continue
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ollama = [{"Role": m["role"], "Content": m["content"]} for m in messages]  # Ollama's api.Message
        assert render(template, {"Messages": ollama}) == expected, name
    assert end_of_turn in modelfile.stop_tokens(tokenizer, None, pieces)


@pytest.mark.parametrize("family", PIECEWISE)
def test_the_template_renders_conversations_as_the_chat_template_does(tokenizer, family):
    _, _, end_of_turn, system = FAMILIES[family]
    check_template(family_tokenizer(tokenizer, family), end_of_turn, system)


def test_a_template_that_is_not_per_role_pieces_is_not_translated(tokenizer):
    assert modelfile.chat_pieces(family_tokenizer(tokenizer, "mistral-v0.3")) is None


@pytest.mark.slow
def test_the_real_models_chatml_with_its_default_system_prompt():
    pytest.importorskip("gguf")
    from qlora_kit.recipe.recipe import ModelSection

    tokenizer = model.load_tokenizer(ModelSection(path="builtin:smollm2-135m-instruct"))
    check_template(tokenizer, "<|im_end|>")
    pieces = modelfile.chat_pieces(tokenizer)
    assert "You are a helpful AI assistant named SmolLM" in pieces["user_start"]
