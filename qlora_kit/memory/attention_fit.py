"""Memory stage: an attention kernel whose memory grows with the square of the sequence, refused at a length
where one layer's scores alone would not fit (the registry's ``quadratic`` trait; eager at 64K tokens).

Read by ``pipeline.build`` once the base model is loaded and its kernel resolved (``auto`` becomes eager for
an architecture without sdpa). The room is ``memory.budget_gb`` where the recipe sets it, else the GPU's
memory, else the host's.
"""

from __future__ import annotations

import psutil
import torch

from qlora_kit.errors import RecipeError
from qlora_kit.registries import attention


def room_bytes(budget_gb: float | None) -> int:
    """``memory.budget_gb``'s bytes, else the GPU's memory, else the host's."""
    if budget_gb is not None:
        return int(budget_gb * 1024**3)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return psutil.virtual_memory().total


def check_attention_fits(config, micro_batch_size: int, max_seq_len: int, budget_gb: float | None) -> None:
    """One line (RecipeError) when the loaded kernel's scores for one micro-batch of ``micro_batch_size``
    rows of ``max_seq_len`` tokens (train.micro_batch_size, data.max_seq_len) outgrow the room to train in
    (``budget_gb``: memory.budget_gb)."""
    text = config.get_text_config()
    line = attention.quadratic_refusal(
        config._attn_implementation,
        micro_batch_size,
        text.num_attention_heads,
        max_seq_len,
        room_bytes(budget_gb),
    )
    if line is not None:
        raise RecipeError(line)
