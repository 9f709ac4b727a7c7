"""A micro-batch by its rows: how many, how wide, its tokens, cut into parts of consecutive rows (each cut to
its own longest row, as a batch of those rows alone is padded) and put back together."""

from __future__ import annotations

from typing import Any

import torch


def rows_of(inputs: dict[str, Any]) -> int:
    """The rows of a micro-batch: its sequences, or a GRPO rollout's completions."""
    return int(inputs["input_ids" if "input_ids" in inputs else "prompt_ids"].shape[0])


def width_of(inputs: dict[str, Any]) -> int:
    """The positions of a micro-batch's rows, padding included (a rollout's: prompt and completion)."""
    if "input_ids" in inputs:
        return int(inputs["input_ids"].shape[-1])
    return int(inputs["prompt_ids"].shape[-1] + inputs["completion_ids"].shape[-1])


def split_rows(inputs: dict[str, Any], parts: int, trim: bool) -> list[dict[str, Any]]:
    """The micro-batch as ``parts`` chunks of consecutive rows (as equal as can be). ``trim``: cut each
    chunk's right padding (columns no row of it attends to), as a batch of those rows alone is padded."""
    if parts == 1:
        return [inputs]
    rows = rows_of(inputs)
    chunks: list[dict[str, Any]] = [{} for _ in range(min(parts, rows))]
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            for chunk, piece in zip(chunks, torch.tensor_split(value, len(chunks)), strict=True):
                chunk[name] = piece
        else:
            for chunk in chunks:
                chunk[name] = value
    return [_trimmed(c) for c in chunks] if trim else chunks


def _trimmed(chunk: dict[str, Any]) -> dict[str, Any]:
    mask = chunk.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return chunk
    length = mask.shape[1]
    attended = mask.any(dim=0).nonzero()
    if len(attended) == 0:
        return chunk
    end = int(attended.max()) + 1  # right padding ends where no row attends any more
    if end == length:
        return chunk
    return {
        k: v[:, :end] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == length else v
        for k, v in chunk.items()
    }


def tokens_of(inputs: dict[str, Any]) -> int:
    """The positions of a batch that are not padding."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    if "prompt_mask" in inputs:  # a GRPO rollout (TRL's GRPOTrainer._generate_and_score_completions)
        return int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    return int(inputs["input_ids"].numel())


def concat(values: list[Any]) -> Any:
    if values[0] is None:
        return None
    if isinstance(values[0], (tuple, list)):
        return type(values[0])(concat(list(group)) for group in zip(*values, strict=True))
    return torch.cat(values, dim=0)
