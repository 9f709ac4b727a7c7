"""What a linear layer is, in one place: the layers 4-bit loading quantizes, LoRA may target, the planner
sizes and the MFU counts.

``torch.nn.Linear`` (bitsandbytes' ``Linear4bit`` is one), and GPT-2's ``Conv1D``, a linear layer whose
weight is stored transposed as (in, out); transformers quantizes it like the others.
"""

from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D


def is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.Linear, Conv1D))


def features(module: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer."""
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.nf  # Conv1D keeps its weight as (in, out)
    return module.in_features, module.out_features
