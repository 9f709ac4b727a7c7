"""``qlora-kit generate``: answers from a trained adapter, each prompt wrapped the way the recipe's data
format trained it (``model/generation.py`` does the decoding: greedy by default, sampling on request)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qlora_kit.data import formats
from qlora_kit.model import adapters
from qlora_kit.model.generation import Sampling, complete

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection


def wrap_prompt(text: str, data: DataSection, tokenizer, history: list[dict[str, str]] | None = None) -> str:
    """The user's text as the model saw prompts in training (the format's own prompt, data/formats.py,
    with the recipe's system prompt)."""
    return formats.prompt(text, data.format, tokenizer, data, history)


def generate(
    adapter_dir: str | None,
    prompts: list[str],
    sampling: Sampling | None = None,
    raw: bool = False,
    recipe=None,
    stream: bool = False,
) -> list[str]:
    """Answers to ``prompts`` from the trained adapter (or from the recipe's base model when adapter_dir
    is None), each prompt wrapped as in training unless ``raw``."""
    recipe, tokenizer, lm = adapters.load_for_inference(adapter_dir, recipe)
    texts = [p if raw else wrap_prompt(p, recipe.data, tokenizer) for p in prompts]
    return [complete(lm, tokenizer, text, sampling, stream=stream) for text in texts]
