"""Evaluation of an adapter (or the bare base model) on the recipe's validation set.

- loss and perplexity, weighted per trained token (the Trainer's eval_loss is a mean of batch means,
  which weighs a batch of short answers like a batch of long ones);
- exact-match accuracy: the greedy answer to each validation prompt, compared with the reference
  answer after trimming whitespace. Every format with a reference answer reports it
  (``FormatSpec.checkable``: all but text).

Preference pairs (train.objective dpo) report preference accuracy and reward margin against the
reference policy, and likelihood accuracy, instead of the loss of whole sequences (preference_eval.py).
A GRPO run also reports its rewards on the validation prompts, greedy and sampled (grpo_eval.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qlora_kit.after.generate import complete
from qlora_kit.after.image_eval import image_exact_match
from qlora_kit.after.preference_eval import preference_metrics
from qlora_kit.data import images, prepare, prompt_examples
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.images import ImageCollator
from qlora_kit.errors import RecipeError
from qlora_kit.model import adapters
from qlora_kit.model.modes import in_eval_mode
from qlora_kit.registries import objectives
from qlora_kit.registries.formats import FORMATS

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def _grpo_rewards() -> Callable[..., dict[str, Any]]:
    from qlora_kit.after.grpo_eval import reward_metrics

    return reward_metrics


def _kto_feedback() -> Callable[..., dict[str, Any]]:
    from qlora_kit.after.preference_eval import feedback_metrics

    return feedback_metrics


# train.objective -> its own figures on the validation data, (lm, tokenizer, recipe, max_examples) ->
# figures, imported when an evaluation asks for them (an objective without an entry has none).
OBJECTIVE_METRICS: dict[str, Callable[[], Callable[..., dict[str, Any]]]] = {
    "grpo": _grpo_rewards,
    "kto": _kto_feedback,
}


def evaluate(
    recipe: Recipe | None = None,
    adapter_dir: str | Path | None = None,
    max_examples: int | None = None,
    output: str | Path | None = None,
) -> dict[str, Any]:
    """Loss, perplexity and exact match on the validation set; written to ``output`` as JSON if given.

    With ``adapter_dir`` the adapter is loaded onto its 4-bit base (the recipe defaults to the one saved
    beside the adapter); without it, the recipe's base model is evaluated alone, for comparison.
    """

    recipe, tokenizer, lm = adapters.load_for_inference(adapter_dir, recipe)
    if not recipe.has_validation_data:
        raise RecipeError(
            "data.val_path: evaluation needs validation data (set data.val_path or data.val_fraction)"
        )
    runs = images.image_runs(recipe.model)  # a vision-language model: rows with images (data/images.py)
    data = images.one_example_a_row(recipe.data) if runs is not None else recipe.data
    prepared = prepare.prepare_datasets(
        data, tokenizer, recipe.train.seed, recipe.preference.max_prompt_len, runs=runs
    )
    val = prepared.val.select(range(min(max_examples, len(prepared.val)))) if max_examples else prepared.val
    results: dict[str, Any] = {
        "adapter": str(adapter_dir) if adapter_dir is not None else None,
        "base_model": recipe.model.path,
    }
    if FORMATS[prepared.val_format].pairs:
        results |= preference_metrics(lm, recipe, val)
    else:
        collator = prepare.build_collator(tokenizer, data.packs)
        if runs is not None:
            collator = ImageCollator(collator, runs)
        loss, tokens = token_weighted_loss(lm, val, collator)
        results |= {"loss": loss, "tokens": tokens}
    results["perplexity"] = math.exp(results["loss"]) if results["loss"] < 700 else math.inf
    if runs is not None:  # asked from the prepared rows: their image runs and pixels (image_eval.py)
        results |= image_exact_match(lm, runs, val, max_examples)
    elif FORMATS[prepared.val_format].checkable:
        examples = prompt_examples.prompt_examples(
            prepared, recipe.data, tokenizer, max_examples or len(prepared.val_rows)
        )
        hits = [_matches(lm, tokenizer, ex) for ex in examples]
        results |= {"exact_match": sum(hits) / len(hits), "exact_match_examples": len(hits)}
    extra = OBJECTIVE_METRICS.get(objectives.of(recipe).name)  # grpo: the rewards, greedy and sampled
    if extra is not None:
        results |= extra()(lm, tokenizer, recipe, max_examples)
    if output is not None:
        Path(output).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def token_weighted_loss(lm, dataset, collator, batch_size: int = 8) -> tuple[float, int]:
    """Mean cross-entropy over every trained token of ``dataset`` and how many tokens that was."""
    total, count = 0.0, 0
    with in_eval_mode(lm), torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            batch = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            batch = {k: v.to(lm.device) for k, v in batch.items()}
            labels = batch.pop("labels")
            logits = lm(**batch).logits.float()
            # (B, T-1, V) predictions of the next token at each position
            shifted = labels[:, 1:]
            losses = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1),
                shifted.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            total += float(losses)
            count += int((shifted != IGNORE_INDEX).sum())
    return total / max(count, 1), count


def _matches(lm, tokenizer, example: prompt_examples.PromptExample) -> bool:
    reference_tokens = len(tokenizer(example.reference, add_special_tokens=False)["input_ids"])
    answer = complete(lm, tokenizer, example.prompt, max_new_tokens=reference_tokens + 4)
    return answer.strip() == example.reference.strip()
