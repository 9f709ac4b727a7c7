"""Evaluation of an adapter (or the bare base model) on the recipe's validation set.

- loss and perplexity, weighted per trained token (the Trainer's eval_loss is a mean of batch means,
  which weighs a batch of short answers like a batch of long ones);
- exact-match accuracy: the greedy answer to each validation prompt, compared with the reference
  answer after trimming whitespace. Only formats with a response to compare (alpaca, completion,
  chat) report it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qlora_kit import data
from qlora_kit.formats import IGNORE_INDEX
from qlora_kit.generate import complete

if TYPE_CHECKING:
    from qlora_kit.recipe import Recipe

EXACT_MATCH_FORMATS = {"alpaca", "completion", "chat"}


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
    from qlora_kit import adapters, model
    from qlora_kit.recipe import RecipeError

    if adapter_dir is not None:
        recipe, tokenizer, lm = adapters.load_trained(adapter_dir, recipe)
    elif recipe is not None:
        tokenizer = model.load_tokenizer(recipe.model)
        lm = model.load_base_model(recipe.model, recipe.quant)
    else:
        raise RecipeError("evaluate: give a recipe, an adapter directory, or both")
    if not recipe.has_validation_data:
        raise RecipeError(
            "data.val_path: evaluation needs validation data (set data.val_path or data.val_fraction)"
        )
    prepared = data.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    val = prepared.val.select(range(min(max_examples, len(prepared.val)))) if max_examples else prepared.val
    loss, tokens = token_weighted_loss(lm, val, data.build_collator(tokenizer, recipe.data.packing))
    results: dict[str, Any] = {
        "adapter": str(adapter_dir) if adapter_dir is not None else None,
        "base_model": recipe.model.path,
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "tokens": tokens,
    }
    if recipe.data.format in EXACT_MATCH_FORMATS:
        examples = data.prompt_examples(
            prepared, recipe.data, tokenizer, max_examples or len(prepared.val_rows)
        )
        hits = [_matches(lm, tokenizer, ex) for ex in examples]
        results |= {"exact_match": sum(hits) / len(hits), "exact_match_examples": len(hits)}
    if output is not None:
        Path(output).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def token_weighted_loss(lm, dataset, collator, batch_size: int = 8) -> tuple[float, int]:
    """Mean cross-entropy over every trained token of ``dataset`` and how many tokens that was."""
    import torch

    was_training = lm.training
    lm.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
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
    finally:
        lm.train(was_training)
    return total / max(count, 1), count


def _matches(lm, tokenizer, example: data.PromptExample) -> bool:
    reference_tokens = len(tokenizer(example.reference, add_special_tokens=False)["input_ids"])
    answer = complete(lm, tokenizer, example.prompt, max_new_tokens=reference_tokens + 4)
    return answer.strip() == example.reference.strip()
