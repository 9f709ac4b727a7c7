"""Packed rows for an M-RoPE family (Qwen-VL): each example's 3-D positions as it computes them alone.

Qwen-VL's text positions are 3-D (time, height, width): text tokens step all three together, an image's
tokens take its grid's rows and columns, and the text after an image resumes past the image's largest
side. transformers computes them per row with the model's ``get_rope_index``, which would read a packed
row as one long example (every later example's positions shifted past the earlier ones). A packed row
therefore carries them itself: each example's positions from ``get_rope_index`` on that example alone,
with the 1-D positions that restart per example in front, the (4, batch, length) form transformers'
Qwen-VL models take for packed rows (their text row builds the mask that keeps examples apart).
"""

from __future__ import annotations

import itertools

import torch


def rope_index_of(config):
    """The ``get_rope_index`` of ``config``'s model, bound to a module holding only the config: it reads
    the config (the merge size, the tokens per second of video) and no weight, so no model is built."""
    import transformers

    model_class = transformers.AutoModel._model_mapping[type(config)]
    shell = model_class.__new__(model_class)
    torch.nn.Module.__init__(shell)
    shell.config = config
    return shell.get_rope_index


def packed_positions(
    rope_index,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    image_token: int,
    grids: torch.Tensor | None,
) -> torch.Tensor:
    """(4, B, L) positions of packed rows: the restarting 1-D positions (B, L), then each example's 3-D
    positions from ``rope_index`` on the example alone with its own images' ``grids`` (n, 3), in order."""
    batch, length = input_ids.shape
    out = torch.empty(4, batch, length, dtype=torch.long)
    out[0] = position_ids
    used = 0  # images of the rows before
    for row in range(batch):
        starts = [*(position_ids[row] == 0).nonzero().flatten().tolist(), length]
        for start, stop in itertools.pairwise(starts):
            ids = input_ids[row : row + 1, start:stop]
            types = (ids == image_token).int()
            count = sum(key for key, _ in itertools.groupby(types[0].tolist()))  # runs of image tokens
            own = grids[used : used + count] if count else None
            out[1:, row, start:stop] = rope_index(ids, mm_token_type_ids=types, image_grid_thw=own)[0][:, 0]
            used += count
    return out
