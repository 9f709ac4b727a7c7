"""Memory stage: an attention kernel whose memory grows with the square of the sequence, refused at a length
where one layer's scores alone would not fit (the registry's ``quadratic`` trait; eager at 64K tokens).

Read by ``pipeline.build`` once the base model is loaded and its kernel resolved (``auto`` becomes eager for
an architecture without sdpa). The room is ``memory.budget_gb`` where the recipe sets it, else the GPU's
memory, else the host's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import psutil
import torch

from qlora_kit.errors import RecipeError
from qlora_kit.registries import attention

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def room_bytes(recipe: Recipe) -> int:
    if recipe.memory.budget_gb is not None:
        return int(recipe.memory.budget_gb * 1024**3)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return psutil.virtual_memory().total


def check_attention_fits(recipe: Recipe, config) -> None:
    """One line (RecipeError) when the loaded kernel's scores for one micro-batch at ``data.max_seq_len``
    outgrow the room to train in."""
    text = config.get_text_config()
    line = attention.quadratic_refusal(
        config._attn_implementation,
        recipe.train.micro_batch_size,
        text.num_attention_heads,
        recipe.data.max_seq_len,
        room_bytes(recipe),
    )
    if line is not None:
        raise RecipeError(line)
