"""The validation prompts a run answers before and after training (``train.sample_prompts``), so that its
summary shows what training changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qlora_kit.data import prepare, prompt_examples
from qlora_kit.model.generation import complete

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe
    from qlora_kit.training.distributed import Ranks


def examples(
    data: prepare.PreparedData, recipe: Recipe, tokenizer, ranks: Ranks
) -> list[prompt_examples.PromptExample]:
    """The prompts to answer. Under FSDP the trained model is sharded: every rank generates the same
    greedy answers in step (each forward all-gathers the layers); otherwise the main process answers
    alone."""
    if not (ranks.is_main or recipe.train.fsdp):
        return []
    return prompt_examples.prompt_examples(data, recipe.data, tokenizer, recipe.train.sample_prompts)


def answers(peft_model, tokenizer, prompts: list[prompt_examples.PromptExample]) -> list[str]:
    return [complete(peft_model, tokenizer, example.prompt, max_new_tokens=8) for example in prompts]


def records(
    prompts: list[prompt_examples.PromptExample], before: list[str], after: list[str]
) -> list[dict[str, str]]:
    return [
        {"prompt": ex.prompt, "reference": ex.reference, "before": b, "after": a}
        for ex, b, a in zip(prompts, before, after, strict=True)
    ]
