"""Mixed precision: which autocast the Trainer runs the forward pass under, resolved for this machine.

``train.mixed_precision`` becomes the Trainer's ``bf16`` / ``fp16`` flag, so accelerate wraps the
model's forward in ``torch.autocast`` and converts its outputs to fp32 — on a CPU exactly as on a GPU,
which is how the test suite runs the GPU's code path. ``auto`` follows ``quant.compute_dtype`` on a GPU
(bfloat16 -> bf16, float16 -> fp16 with a gradient scaler, float32 -> no) and is ``no`` on a CPU, where
the 4-bit layers already compute in ``quant.compute_dtype`` and autocast's casts only cost time.

Nothing switches silently: a GPU without native bf16 (before Ampere) refuses bfloat16 and says to use
float16; fp16 needs CUDA (its GradScaler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qlora_kit.errors import RecipeError

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

AUTO_BY_COMPUTE_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}


@dataclass(frozen=True)
class Device:
    """What the precision choice depends on: CUDA or not, and native bf16 on that GPU."""

    cuda: bool
    bf16: bool
    name: str = "cpu"

    @classmethod
    def here(cls) -> Device:

        if not torch.cuda.is_available():
            return cls(cuda=False, bf16=True)
        # including_emulation=False: pre-Ampere GPUs emulate bf16 matmuls, far slower than fp16.
        return cls(
            cuda=True,
            bf16=torch.cuda.is_bf16_supported(including_emulation=False),
            name=torch.cuda.get_device_name(),
        )


def resolve_mixed_precision(recipe: Recipe, device: Device | None = None) -> str:
    """``bf16``, ``fp16`` or ``no`` for this recipe on ``device`` (default: this machine).

    Raises RecipeError naming the field when the recipe asks for what the device cannot do."""
    device = device or Device.here()
    wanted = recipe.train.mixed_precision
    compute = recipe.quant.compute_dtype
    if wanted == "auto":
        wanted = AUTO_BY_COMPUTE_DTYPE[compute] if device.cuda else "no"
    if wanted == "fp16" and not device.cuda:
        raise RecipeError(
            "train.mixed_precision: fp16 needs a CUDA GPU (its gradient scaler); on this CPU use bf16 or no"
        )
    uses_bf16 = wanted == "bf16" or compute == "bfloat16"
    if device.cuda and uses_bf16 and not device.bf16:
        raise RecipeError(
            f"quant.compute_dtype: {device.name} has no native bfloat16 (it came with Ampere); "
            "set quant.compute_dtype: float16 (train.mixed_precision auto then uses fp16)"
        )
    if wanted == "fp16" and recipe.lora.bias != "none":
        raise RecipeError(
            f"lora.bias: {recipe.lora.bias} trains the base model's float16 biases, whose gradients fp16's "
            "gradient scaler refuses to unscale; use lora.bias: none, or bf16"
        )
    return wanted
