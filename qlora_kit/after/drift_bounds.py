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


def expected_kl(log_probs: torch.Tensor, roundoff: float, passes: int) -> torch.Tensor:
    """(T,) the KL(trained || merged) a correct merge is expected to show at each position, from the
    trained model's log-probabilities (T, V): weights rounded to ``roundoff`` and float32's own, through
    ``passes`` products (relative variance (u_w^2 + u_f32^2) / 3 each); plus what the KL's own float32
    log-probabilities can give (their roundoff times the entropy)."""
    computed = torch.finfo(torch.float32).eps / 2
    log_probs = log_probs.double()
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return kl_of_relative_error(log_probs, (roundoff**2 + computed**2) / 3 * passes) + computed * entropy


def kl_of_relative_error(log_probs: torch.Tensor, variance: float) -> torch.Tensor:
    """(T,) KL(p || q) to second order where q's centred log-probabilities are p's times (1 + g), g of
    ``variance`` and independent per token: variance / 2 x Var_p(log p)."""
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1, keepdim=True)
    return variance / 2 * (probs * (log_probs + entropy) ** 2).sum(-1)


def bound(expected: torch.Tensor) -> float:
    """The mean KL a correct merge stays within, over these positions' expectations."""
    return SAFETY * float(expected.mean())
