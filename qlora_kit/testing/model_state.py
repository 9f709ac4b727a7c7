"""What a run applied to a model, read back for tests (the run itself never asks), and bitsandbytes' own
4-bit kernel given back after model/bnb_selftest.py went around it."""

from __future__ import annotations

import torch

from qlora_kit.memory.checkpointing import decoder_layers
from qlora_kit.model import bnb_selftest


def tiled_mlps(model: torch.nn.Module) -> int:
    """How many decoder layers' MLPs run in tiles (memory/tiled_mlp.py keeps the untiled forward)."""
    return sum(
        getattr(getattr(layer, "mlp", None), "_untiled_forward", None) is not None
        for layer in decoder_layers(model)
    )


def stop_going_around() -> None:
    """Give bitsandbytes' own kernel back (tests show the numbers wrong without the way around)."""
    if bnb_selftest._around is not None:
        bnb_selftest._around._destroy()
        bnb_selftest._around = None
    bnb_selftest.check.cache_clear()
