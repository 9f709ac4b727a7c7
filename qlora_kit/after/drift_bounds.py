"""The bounds merge's drift check judges a merged folder by, derived from what it measures rather than
calibrated on one model: the dtype its weights (a mixture's experts included) were rounded to, how many
roundings the error passes through on its way to the logits, and how spread the trained model's own
next-token distributions are at each position.

The model of the error: rounding a weight to a dtype of unit roundoff u moves it by at most u of itself,
uniformly, so by u/sqrt(3) in RMS; a linear layer's output then moves by about as much of itself, and
the errors of the ``passes`` matrix products the signal goes through one after another (four in each
layer: attention's projections and its output, the MLP's and its down projection; one for the head)
add up in variance. A relative error of RMS e on the logits moves KL(p || q) by about e^2/2 times the
variance of the log-probabilities under p (the second-order term; the first vanishes), so a flat
distribution drifts less than a decided one for the same rounding. float32's own roundoff counts too:
the trained model (4-bit base and adapter) and the merged one are both computed in float32, in
different orders. Measured against this, the tiny builtins' correct float16 merges after 2 steps of
the demo recipe drifted about 0.07 of it (the Qwen3.5 mixture: 1.0e-7 at the answers against 1.5e-6;
the hybrid: 1.3e-7 against 2.0e-6); ``SAFETY`` covers the constants the model leaves out, and a wrong
merge lies far past it (the mixture's layer-0 experts 0 and 1 swapped: 0.0089, its update halved:
0.056, against a bound of 4.6e-5; tests/test_merge_bounds.py).

Export's parity report judges a file against its floor (the same weights rounded in memory) by the same
model with the reader's arithmetic in place of the weights' rounding (after/parity_judgement.py):
transformers reads the file's weights into float32 as the floor holds them, so float32's roundoff alone;
llama.cpp's dot products also round each product's input into the weights' own vec_dot type (8 bits of
each block of 32 values' absmax for q8_0: ``block_rounding_variance``, its peaks measured on the floor's
activations by ``BlockPeaks``; float16 or bfloat16 for those types) and cache K and V in float16.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# The matrix products a decoder layer's output passes through one after another (attention's projection
# and output, the MLP's up/gate and down), and the head's one
PASSES_PER_LAYER = 4
# How far past the model's expectation a correct merge may drift: the model counts each product's error
# as its weights' (an input that cancels in a sum amplifies it) and the errors as independent
SAFETY = 30.0
# llama.cpp's q8_0 dot products round their input in blocks of 32 values to 8 bits of the block's absmax
Q8_BLOCK = 32
Q8_LEVELS = 127
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def weight_roundoff(folder: Path) -> float:
    """The unit roundoff of the coarsest floating dtype among the merged folder's saved tensors (read from
    each safetensors file's header: a mixture's experts are saved beside the rest, in their own dtype)."""
    dtypes = set()
    for file in sorted(Path(folder).glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        dtypes |= {entry["dtype"] for key, entry in header.items() if key != "__metadata__"}
    floating = [SAFETENSORS_DTYPES[name] for name in dtypes if name in SAFETENSORS_DTYPES]
    return max((torch.finfo(dtype).eps / 2 for dtype in floating), default=torch.finfo(torch.float32).eps / 2)


def rounding_passes(config) -> int:
    """The matrix products the rounding error passes through from the first layer to the logits."""
    text = getattr(config, "text_config", None) or config
    return PASSES_PER_LAYER * int(text.num_hidden_layers) + 1


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def rounding_variance(roundoff: float) -> float:
    """The relative variance rounding to unit roundoff ``roundoff`` gives a value: an error uniform over
    +-u of it, u^2 / 3."""
    return roundoff**2 / 3


def block_rounding_variance(peak_ratio: float) -> float:
    """The relative variance a product's input gains rounded as q8_0's blocks are (llama.cpp's
    quantize_row_q8_0): each block of Q8_BLOCK values in steps of its absmax / Q8_LEVELS, each value's error
    uniform over +-step/2 (variance step^2 / 12), over the input's mean square; ``peak_ratio`` is
    Q8_BLOCK x sum of the blocks' absmax^2 / sum of x^2 (BlockPeaks), at most Q8_BLOCK (one value a block)."""
    return peak_ratio / (12 * Q8_LEVELS**2)


def expected_kl(log_probs: torch.Tensor, roundoff: float, passes: int) -> torch.Tensor:
    """(T,) the KL(trained || merged) a correct merge is expected to show at each position, from the
    trained model's log-probabilities (T, V): weights rounded to ``roundoff`` and float32's own, through
    ``passes`` products."""
    variance = rounding_variance(roundoff) + rounding_variance(unit_roundoff(torch.float32))
    return expected_kl_of_variance(log_probs, variance, passes)


def expected_kl_of_variance(log_probs: torch.Tensor, variance: float, passes: int) -> torch.Tensor:
    """(T,) the KL(p || q) expected at each position where each of ``passes`` products adds a relative
    error of ``variance`` to q's computation, from p's log-probabilities (T, V); plus what the KL's own
    float32 log-probabilities can give (their roundoff times the entropy)."""
    computed = unit_roundoff(torch.float32)
    log_probs = log_probs.double()
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return kl_of_relative_error(log_probs, variance * passes) + computed * entropy


def kl_of_relative_error(log_probs: torch.Tensor, variance: float) -> torch.Tensor:
    """(T,) KL(p || q) to second order where q's centred log-probabilities are p's times (1 + g), g of
    ``variance`` and independent per token: variance / 2 x Var_p(log p)."""
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1, keepdim=True)
    return variance / 2 * (probs * (log_probs + entropy) ** 2).sum(-1)


def bound(expected: torch.Tensor) -> float:
    """The mean KL a correct merge stays within, over these positions' expectations."""
    return SAFETY * float(expected.mean())


class BlockPeaks:
    """The peaks of a model's activations as q8_0's blocks see them: registered on every linear layer
    whose input tiles Q8_BLOCK values, it sums each input's blocks' absmax^2 and its squares per layer
    while the model runs; ``ratio`` is Q8_BLOCK x the first over the second, averaged over the layers
    (each product's relative error is its own input's: 1 for constant blocks, 3 for values uniform over
    +-a, about 4-5 for Gaussian ones; outlier features raise it)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        self.sums: dict[torch.nn.Module, list[float]] = {}
        self.handles = [
            module.register_forward_pre_hook(self._record)
            for module in lm.modules()
            if isinstance(module, torch.nn.Linear) and module.in_features % Q8_BLOCK == 0
        ]

    def _record(self, module, args) -> None:
        blocks = args[0].detach().double().reshape(-1, Q8_BLOCK)
        sums = self.sums.setdefault(module, [0.0, 0.0])
        sums[0] += float(blocks.abs().amax(-1).square().sum())
        sums[1] += float(blocks.square().sum())

    def ratio(self) -> float:
        """The measured ratio; Q8_BLOCK (the most a block can have) where nothing was measured."""
        ratios = [Q8_BLOCK * peaks / squares for peaks, squares in self.sums.values() if squares > 0]
        return sum(ratios) / len(ratios) if ratios else float(Q8_BLOCK)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class RoundedInputs:
    """llama.cpp's q8_0 products read in memory: registered on every linear layer whose input tiles
    Q8_BLOCK values, each input is rounded as quantize_row_q8_0 rounds it (a block's scale its absmax /
    Q8_LEVELS, stored in float16; each value to the nearest step) before the layer reads it. What this
    rounding moves a model's distributions by is measured on the floor itself, where the propagation the
    per-product model counts (every product's relative error reaching the logits whole) overstates it:
    each layer's output joins a residual stream larger than itself. A mixture's packed experts are no
    linear layers: their inputs stay unrounded here, so a mixture's q8_0 bound counts the rest's rounding
    only (not yet checked against llama.cpp reading a mixture's q8_0 file)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        self.handles = [
            module.register_forward_pre_hook(_round_input)
            for module in lm.modules()
            if isinstance(module, torch.nn.Linear) and module.in_features % Q8_BLOCK == 0
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _round_input(_module, args):
    inputs = args[0]
    blocks = inputs.reshape(-1, Q8_BLOCK).float()
    scale = blocks.abs().amax(-1, keepdim=True) / Q8_LEVELS  # the steps are counted at float32's scale...
    steps = torch.where(scale > 0, blocks / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    stored = scale.half().float()  # ...and read back at the float16 one the block stores
    return (steps.round().mul(stored).reshape(inputs.shape).to(inputs.dtype), *args[1:])
