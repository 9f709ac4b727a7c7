"""Exact match on a vision-language model's validation rows: each row's first answer, generated greedily
from its prompt tokens (the image runs included) and its images' pixels, against the reference.

The prompt and the reference come from the prepared row itself (data/images.py): the tokens before the
first trained label, and the trained tokens of that first answer (its end-of-turn marker, a special token,
dropped when decoded). So the model is asked exactly what training showed it, whatever the family's
template and image markers.
"""

from __future__ import annotations

from typing import Any

import torch

from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.images import IMAGES_COLUMN, ImageRuns, open_image
from qlora_kit.model.modes import in_eval_mode


def prompt_and_answer(labels: list[int]) -> tuple[int, list[int]]:
    """Where the first answer starts, and its trained tokens."""
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    answer = []
    for label in labels[first:]:
        if label == IGNORE_INDEX:
            break
        answer.append(label)
    return first, answer


def image_exact_match(lm, runs: ImageRuns, val, count: int | None = None) -> dict[str, Any]:
    """``exact_match`` over the first ``count`` validation rows (all of them by default)."""
    from qlora_kit.model.generation import Sampling

    tokenizer = runs.processor.tokenizer
    rows = val.select(range(min(count, len(val)))) if count else val
    hits = []
    with in_eval_mode(lm):
        for row in rows:
            first, answer = prompt_and_answer(row["labels"])
            ids = torch.tensor([row["input_ids"][:first]], device=lm.device)
            pictures = [open_image(path) for path in row[IMAGES_COLUMN] or []]
            beside = {k: v.to(lm.device) for k, v in runs.model_inputs(ids, pictures).items()}
            with torch.no_grad():
                out = lm.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    **Sampling(max_new_tokens=len(answer) + 4).generate_kwargs(),
                    pad_token_id=tokenizer.pad_token_id,
                    **beside,
                )
            said = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
            hits.append(said == tokenizer.decode(answer, skip_special_tokens=True).strip())
    return {"exact_match": sum(hits) / max(len(hits), 1), "exact_match_examples": len(hits)}
