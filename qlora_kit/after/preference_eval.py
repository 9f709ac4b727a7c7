"""Evaluation on preference pairs (``train.objective: dpo``): how the model ranks chosen over rejected.

For every validation pair, the summed log-probability of each answer given the prompt (as DPO scores
them), under the evaluated model and under the reference policy — the recipe's ``model.adapter`` (the
adapter DPO started from), loaded as a second adapter on the same 4-bit base, or the base alone:

- ``preference_accuracy``: the share of pairs whose DPO reward, beta * log(model / reference), is higher
  for the chosen answer than for the rejected one (TRL's rewards/accuracies, on every pair at once);
- ``reward_margin``: the mean reward of the chosen answer minus the rejected one's;
- ``likelihood_accuracy``: the share of pairs whose chosen answer is more likely than the rejected one
  under the evaluated model alone — comparable between the base, the SFT adapter and the DPO adapter;
- ``loss``: the mean cross-entropy per token of the chosen answers.

Labelled answers (``train.objective: kto``, format feedback) are scored the same way, each answer alone
(``feedback_metrics``): ``reward_margin`` is the desirable answers' mean reward minus the undesirable
ones', and for every prompt that has both kinds of answer, ``desirable_share`` is the desirable answers'
share of the probability the model gives the prompt's labelled answers (its mean over those prompts;
``reference_desirable_share`` the same under the reference policy),
``preference_accuracy`` the share of them where a desirable answer has the higher reward and
``likelihood_accuracy`` where it is the more likely under the model alone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftModel

from qlora_kit.model.modes import in_eval_mode

if TYPE_CHECKING:
    from datasets import Dataset

    from qlora_kit.recipe.recipe import Recipe

REFERENCE = "reference"


def feedback_metrics(lm, tokenizer, recipe: Recipe, max_examples: int | None = None) -> dict[str, Any]:
    """The module docstring's figures of labelled answers for ``lm`` on the recipe's validation rows."""
    import json

    from datasets import Dataset

    from qlora_kit.data import feedback, prepare

    raw = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed).val_rows
    rows = feedback.trl_rows(raw, recipe.data, "the validation rows", tokenizer)  # as the run scored them
    if max_examples:
        rows = rows.select(range(min(max_examples, len(rows))))
    prompts = [json.dumps(p) for p in rows["prompt"]]  # a text, or a conversation
    tokenized = [feedback.token_ids(row, tokenizer) for row in rows]
    # each answer as one side of a pair (the other side empty), scored as answer_logps scores pairs
    ids = Dataset.from_dict(
        {
            "prompt_ids": [p for p, _ in tokenized],
            "chosen_ids": [a for _, a in tokenized],
            "rejected_ids": [[]] * len(tokenized),
        }
    )
    logps = answer_logps(lm, ids)[0]
    reference = reference_logps(lm, recipe, ids)[0]
    rewards = recipe.preference.beta * (logps - reference)
    labels = torch.tensor(list(rows["label"]))
    by_prompt: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_prompt.setdefault(prompt, []).append(index)
    both = [i for i in by_prompt.values() if labels[i].any() and not labels[i].all()]
    share, reference_share, ranked, likelier = [], [], [], []
    for indices in both:
        good, bad = [i for i in indices if labels[i]], [i for i in indices if not labels[i]]
        share.append(desirable_share(logps[good], logps[bad]))
        reference_share.append(desirable_share(reference[good], reference[bad]))
        ranked.append(float(rewards[good].max() > rewards[bad].max()))
        likelier.append(float(logps[good].max() > logps[bad].max()))
    return {
        "reward_margin": float(rewards[labels].mean() - rewards[~labels].mean()),
        "desirable_share": sum(share) / max(len(share), 1),
        # the same under the reference policy (what the reference's own evaluation reports): one
        # evaluation shows what training moved, without loading the reference a second time
        "reference_desirable_share": sum(reference_share) / max(len(reference_share), 1),
        "preference_accuracy": sum(ranked) / max(len(ranked), 1),
        "likelihood_accuracy": sum(likelier) / max(len(likelier), 1),
        "pairs": len(both),
        "reference": recipe.model.adapter or "the base model",
    }


def desirable_share(good: torch.Tensor, bad: torch.Tensor) -> float:
    """The desirable answers' share of the probability of a prompt's labelled answers, from their summed
    log-probabilities: a softmax over the answers, in log space. A 20-token answer's probability is about
    exp(-40) and a 100-token one's underflows float32 to 0, where the share of the probabilities
    themselves is 0/0."""
    return float(
        (torch.logsumexp(good.double(), 0) - torch.logsumexp(torch.cat([good, bad]).double(), 0)).exp()
    )


def preference_metrics(lm, recipe: Recipe, pairs: Dataset) -> dict[str, Any]:
    """The module docstring's figures for ``lm`` (a PeftModel, or the bare base) on tokenized ``pairs``."""
    chosen, rejected, tokens = answer_logps(lm, pairs)
    reference_chosen, reference_rejected = reference_logps(lm, recipe, pairs)
    beta = recipe.preference.beta
    margins = beta * ((chosen - reference_chosen) - (rejected - reference_rejected))
    return {
        "loss": float(-chosen.sum() / max(tokens, 1)),
        "preference_accuracy": float((margins > 0).float().mean()),
        "reward_margin": float(margins.mean()),
        "likelihood_accuracy": float((chosen > rejected).float().mean()),
        "pairs": len(pairs),
        "reference": recipe.model.adapter or "the base model",
    }


def reference_logps(lm, recipe: Recipe, pairs: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The answers' log-probabilities under the reference policy, on the same 4-bit base as ``lm``."""
    adapter = recipe.model.adapter
    if adapter is None:  # the base: lm's adapter switched off, or lm itself
        with lm.disable_adapter() if isinstance(lm, PeftModel) else contextlib.nullcontext():
            return answer_logps(lm, pairs)[:2]
    if isinstance(lm, PeftModel):
        active = lm.active_adapter
        lm.load_adapter(str(Path(adapter).expanduser()), adapter_name=REFERENCE)
        try:
            lm.set_adapter(REFERENCE)
            return answer_logps(lm, pairs)[:2]
        finally:
            lm.set_adapter(active)
            lm.delete_adapter(REFERENCE)
    # the bare base: the reference adapter is injected into it for these log-probabilities, then taken out
    # (exact match is measured on the same model afterwards)
    with_reference = PeftModel.from_pretrained(lm, str(Path(adapter).expanduser()), adapter_name=REFERENCE)
    try:
        return answer_logps(with_reference, pairs)[:2]
    finally:
        with_reference.unload()


def answer_logps(lm, pairs: Dataset, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per pair, the summed log-probability of the chosen and of the rejected answer given the prompt,
    and how many chosen-answer tokens there were."""
    sides: dict[str, list[torch.Tensor]] = {"chosen": [], "rejected": []}
    tokens = 0
    with in_eval_mode(lm), torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            rows = pairs.select(range(start, min(start + batch_size, len(pairs))))
            for side in sides:
                sums, count = _completion_logps(lm, rows["prompt_ids"], rows[f"{side}_ids"])
                sides[side].append(sums)
                tokens += count if side == "chosen" else 0
    return torch.cat(sides["chosen"]), torch.cat(sides["rejected"]), tokens


def _completion_logps(lm, prompts: list[list[int]], answers: list[list[int]]) -> tuple[torch.Tensor, int]:
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    answer = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
        answer[row, len(prompt) : len(sequence)] = True
    ids, mask, answer = ids.to(lm.device), mask.to(lm.device), answer.to(lm.device)
    logits = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
    scored = answer[:, 1:]  # position t predicts token t + 1
    sums = []
    for row in range(len(sequences)):  # one row in fp32 at a time: a 128k vocabulary's batch would not fit
        row_logits = logits[row, :-1].float()
        logps = row_logits.gather(-1, ids[row, 1:, None]).squeeze(-1) - row_logits.logsumexp(-1)
        sums.append((logps * scored[row]).sum())
    return torch.stack(sums).cpu(), int(scored.sum())
