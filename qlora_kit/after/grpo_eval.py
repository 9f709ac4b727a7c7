"""Evaluation of a GRPO run (``train.objective: grpo``): its rewards on held-out prompts.

Each validation prompt (data/prompts.py: asked as training asked it) is answered greedily once and
sampled ``grpo.num_generations`` times at ``grpo.temperature`` (seeded by ``train.seed``), each answer at
most ``grpo.max_completion_length`` tokens, and scored by the recipe's reward functions exactly as
training scored its rollouts (data/rewards.py, TRL's call signature):

- ``reward_greedy`` / ``reward_sampled``: the weighted sum of the rewards, mean over the answers;
- ``rewards_greedy/<name>`` / ``rewards_sampled/<name>``: each reward function's mean;
- ``reward_prompts``: how many prompts were asked.

Greedy is what ``generate`` answers by default; sampled is what training saw, and how often the model
finds a rewarded answer at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from trl.trainer.utils import get_callable_name

from qlora_kit.data.prompts import PROMPT, prepare_prompts
from qlora_kit.data.rewards import reward_functions
from qlora_kit.model.modes import in_eval_mode

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

BATCH = 16  # prompts per generate call


def reward_metrics(lm, tokenizer, recipe: Recipe, max_examples: int | None = None) -> dict[str, Any]:
    """The module docstring's figures for ``lm`` on the recipe's validation prompts."""
    grpo = recipe.grpo
    prepared = prepare_prompts(recipe.data, tokenizer, recipe.train.seed, grpo.max_completion_length)
    rows = prepared.val
    if max_examples:
        rows = rows.select(range(min(max_examples, len(rows))))
    functions = reward_functions(grpo.rewards)
    weights = [reward.weight for reward in grpo.rewards]
    results: dict[str, Any] = {"reward_prompts": len(rows)}
    torch.manual_seed(recipe.train.seed)
    for mode, samples in (("greedy", 1), ("sampled", grpo.num_generations)):
        scores = _scores(lm, tokenizer, rows, functions, samples, recipe)  # (answers, functions)
        for function, column in zip(functions, scores.T, strict=True):
            results[f"rewards_{mode}/{get_callable_name(function)}"] = float(column.mean())
        results[f"reward_{mode}"] = float((scores * torch.tensor(weights)).sum(1).mean())
    return results


def _scores(lm, tokenizer, rows, functions, samples: int, recipe: Recipe) -> torch.Tensor:
    """Every reward of every answer: (prompts x samples, functions)."""
    grpo = recipe.grpo
    sampling = (
        {"do_sample": True, "temperature": grpo.temperature, "top_k": 0, "num_return_sequences": samples}
        if samples > 1
        else {"do_sample": False}
    )
    scores = []
    for start in range(0, len(rows), BATCH):
        batch = rows.select(range(start, min(start + BATCH, len(rows)))).to_dict()  # columns as lists
        completions = _answers(lm, tokenizer, batch[PROMPT], grpo.max_completion_length, sampling)
        columns = {
            k: [v for v in values for _ in range(samples)] for k, values in batch.items() if k != PROMPT
        }
        prompts = [p for p in batch[PROMPT] for _ in range(samples)]
        values = [f(prompts=prompts, completions=completions, **columns) for f in functions]
        scores.append(torch.tensor(values, dtype=torch.float32).T)
    return torch.cat(scores)


def _answers(lm, tokenizer, prompts: list, max_new_tokens: int, sampling: dict) -> list:
    """The completions as TRL gives them to rewards: text, or for a conversation one assistant message."""
    chat = not isinstance(prompts[0], str)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues the prompt's end
    try:
        if chat:
            inputs = tokenizer.apply_chat_template(
                prompts,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                padding=True,
                return_tensors="pt",
            )
        else:
            inputs = tokenizer(prompts, padding=True, return_tensors="pt")  # with BOS, as TRL tokenizes them
    finally:
        tokenizer.padding_side = side
    inputs = {k: v.to(lm.device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    with in_eval_mode(lm), torch.no_grad():
        output = lm.generate(
            **inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
        )
    texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
