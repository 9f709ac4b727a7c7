"""Memory stage: the tiled MLP — each decoder layer's MLP computed in tiles along the sequence.

A decoder layer's MLP is the widest thing it computes: gate and up projections and their product,
``intermediate`` values a token each (14,336 for Llama-3.1-8B against a hidden size of 4,096), so at long
context one layer's MLP intermediate outweighs every checkpointed layer input together. The MLP treats each
token on its own, so ``memory.mlp_tiles`` splits the sequence into tiles and runs the MLP on one tile at a
time, each tile under torch's non-reentrant ``checkpoint``: the forward pass keeps only the tile's input (a
view of the layer's MLP input), and backward recomputes one tile's intermediate at a time (autograd runs the
most recently built tile first, so one tile's recompute is alive at once). Inside a checkpointed layer's
recompute the same happens again, so the layer's working set holds one tile's intermediate, not the
sequence's. Checkpoint restores the RNG state for the replay, so LoRA dropout draws the same masks.

``auto`` takes ``ceil(tokens / hidden)`` tiles (unsloth's TiledMLP rule: a tile of ``hidden`` tokens has an
intermediate of ``hidden x intermediate`` values, no bigger than the layer's input once the sequence is
longer than ``intermediate``); an integer fixes the count. ``enable_mlp_tiles`` wraps the ``mlp`` module
of each decoder layer; the weights, LoRA and the 4-bit layers are untouched.
"""

from __future__ import annotations

import math
import types

import torch
from torch.utils.checkpoint import checkpoint

from qlora_kit.memory.accounting import decoder_layers


def tile_count(setting: int | str, tokens: int, hidden: int) -> int:
    """How many tiles ``memory.mlp_tiles`` gives a sequence of ``tokens`` (never more than tokens)."""
    tiles = math.ceil(tokens / hidden) if setting == "auto" else int(setting)
    return max(1, min(tiles, tokens))


def enable_mlp_tiles(model: torch.nn.Module, setting: int | str) -> int:
    """Tile the MLP of every decoder layer; returns how many MLPs were tiled (0 when the setting is 1)."""
    if setting == 1:
        return 0
    hidden = model.config.get_text_config().hidden_size
    tiled = 0
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or getattr(mlp, "_untiled_forward", None) is not None:
            continue
        mlp._untiled_forward = mlp.forward
        mlp.forward = types.MethodType(_tiled_forward(setting, hidden), mlp)
        tiled += 1
    return tiled


def _tiled_forward(setting: int | str, hidden: int):
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # hidden_states: (B, T, C); the MLP maps each of the T positions on its own
        tiles = tile_count(setting, hidden_states.shape[-2], hidden)
        if tiles == 1:
            return self._untiled_forward(hidden_states, *args, **kwargs)
        parts = hidden_states.tensor_split(tiles, dim=-2)
        if torch.is_grad_enabled():
            outputs = [
                checkpoint(self._untiled_forward, part, *args, use_reentrant=False, **kwargs)
                for part in parts
            ]
        else:  # a checkpointed layer's first forward pass, or evaluation: nothing is kept anyway
            outputs = [self._untiled_forward(part, *args, **kwargs) for part in parts]
        return torch.cat(outputs, dim=-2)

    return forward


def tiled_mlps(model: torch.nn.Module) -> int:
    """How many decoder layers' MLPs run in tiles."""
    return sum(
        getattr(getattr(layer, "mlp", None), "_untiled_forward", None) is not None
        for layer in decoder_layers(model)
    )
