"""Model stage: a self-test of the running bitsandbytes' 4-bit dequantization on this device, run before every
4-bit load and by ``qlora-kit doctor``, and the way around the one wrong case known.

Why: bitsandbytes 0.50's CPU ``dequantize_4bit`` kernel has an AVX-512 branch, taken when a matrix's row width
is a multiple of 16, that reads each row's absmax as if every row began a new 64-value block. A 4-bit matrix's
blocks run over the flattened tensor, so where the width is not a multiple of the block (48, 96, 160 values
with blocks of 64; 576 with blocks of 128) every row after the first gets another block's scale: weights off
by as much as the weights themselves, silently, in every ``Linear4bit`` forward and backward and in our grouped
expert path. Measured on an AMD EPYC with AVX-512 (bitsandbytes 0.50.2): 128 x 48 NF4 off by 0.08 at a weight
scale of 0.05; widths 64, 100 (not a multiple of 16: the scalar branch) and 128 exact; the same bytes
dequantized with a flat shape exact. CPUs without AVX-512 run the scalar branch, which indexes blocks over the
flattened tensor. bitsandbytes' AVX2 (PR #2072) and NEON branches guard on ``n % blocksize == 0``; the
AVX-512 branch does not.

``check`` compares bitsandbytes with ``reference_dequantize`` (a few lines of plain torch: the code book per
4-bit index times its flat block's absmax) on a few small matrices, once per process and device. Where it is
wrong on the CPU, ``go_around`` registers a kernel in front of bitsandbytes' own (torch's AutogradCPU key, so
every caller goes through it: ``functional.dequantize_4bit``, ``matmul_4bit``'s forward and backward, our
grouped experts) that asks bitsandbytes for the same bytes in rows of one block each, a shape its kernel gets
right, and reshapes; the check then runs again and must pass. ``guard`` refuses a load in one line, naming a
layer and its width, when the weights would still be wrong.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from importlib.metadata import version
from math import prod

import bitsandbytes.functional as bnbf
import torch

from qlora_kit.errors import TrainingGuardError

log = logging.getLogger(__name__)

BLOCKSIZE = 64  # the 4-bit block qlora_kit quantizes with (moe_experts.BLOCKSIZE, transformers' default)
# (rows, width, quant type, double quant, dtype): widths 48 (a multiple of 16 but not of the block: the wrong
# case), 64 (whole blocks), and 3 x 48 (a partial last block, which goes around through the flat shape)
CASES = (
    (128, 48, "nf4", False, torch.float32),
    (128, 48, "fp4", False, torch.float32),
    (128, 48, "nf4", True, torch.bfloat16),
    (3, 48, "nf4", True, torch.float32),
    (128, 64, "nf4", True, torch.float32),
)


@dataclass(frozen=True)
class Verdict:
    """What the self-test found on one device: ``wrong`` the cases bitsandbytes got wrong by itself (one line
    each), ``around`` whether the way around is in place, ``still_wrong`` the cases wrong with it."""

    device: str
    wrong: tuple[str, ...]
    around: bool = False
    still_wrong: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """The weights this process dequantizes on ``device`` are right (by bitsandbytes or around it)."""
        return not self.still_wrong if self.around else not self.wrong

    def describe(self) -> str:
        if not self.wrong:
            return f"4-bit dequantization matches the reference on {self.device} ({len(CASES)} matrices)"
        found = f"4-bit dequantization wrong on this {self.device.upper()} ({self.wrong[0]}; {len(self.wrong)} of "
        found += f"{len(CASES)} matrices)"
        if self.ok:
            return f"{found}, going around it: dequantized in rows of one {BLOCKSIZE}-value block, then exact"
        return found if not self.around else f"{found}; still wrong around it ({self.still_wrong[0]})"


def reference_dequantize(packed: torch.Tensor, state: bnbf.QuantState) -> torch.Tensor:
    """float64 weights of ``state.shape``: two 4-bit indices a byte (the high nibble first), each its code
    book value times the absmax of its block of ``state.blocksize`` values over the flattened tensor; with
    double quantization each absmax is itself its 8-bit code times its second-level block's absmax plus
    the offset."""
    data = packed.reshape(-1).view(torch.uint8).long()
    index = torch.stack([data >> 4, data & 15], dim=1).reshape(-1)[: prod(state.shape)]
    values = state.code.double()[index]
    block = torch.arange(values.numel(), device=values.device) // state.blocksize
    return (values * _absmax(state)[block]).reshape(state.shape)


def _absmax(state: bnbf.QuantState) -> torch.Tensor:
    if not state.nested:
        return state.absmax.double()
    nested = state.state2
    second = torch.arange(state.absmax.numel(), device=state.absmax.device) // nested.blocksize
    return nested.code.double()[state.absmax.long()] * nested.absmax.double()[second] + float(state.offset)


def tolerance(state: bnbf.QuantState) -> torch.Tensor:
    """Per value, how far bitsandbytes may be from the float64 reference: its product code x absmax in
    float32 (half an ulp of float32), the absmax of double quantization rebuilt in float32 (a product and a
    sum: an ulp of float32 of |absmax| + |offset|), and the cast to the dtype (half an ulp of the dtype when
    rounded, a whole one allowed for a kernel that truncates). With
    |code| <= 1 every term is at most its eps times the block's |absmax| + |offset|: this bound. A wrong
    block's scale is off by a fraction of the weights, 10^4 of these at the least."""
    eps = torch.finfo(state.dtype).eps + 2 * torch.finfo(torch.float32).eps
    scale = _absmax(state).abs() + (abs(float(state.offset)) if state.nested else 0.0)
    block = torch.arange(prod(state.shape), device=scale.device) // state.blocksize
    return (eps * scale[block]).reshape(state.shape)


def compare(dequantize=bnbf.dequantize_4bit, device: str = "cpu") -> tuple[str, ...]:
    """One line for each of ``CASES`` where ``dequantize(packed, state)`` (bitsandbytes' by default; a test
    passes a wrong one) differs from the reference past ``tolerance``; () when all agree."""
    wrong = []
    generator = torch.Generator().manual_seed(0)
    for rows, width, quant_type, nested, dtype in CASES:
        weight = (torch.randn(rows, width, generator=generator) * 0.05).to(device, dtype)
        packed, state = bnbf.quantize_4bit(
            weight, blocksize=BLOCKSIZE, compress_statistics=nested, quant_type=quant_type
        )
        reference = reference_dequantize(packed, state)
        off = (dequantize(packed, state).double() - reference).abs()
        if not bool((off <= tolerance(state)).all()):
            quant = f"{quant_type}{' double quant' if nested else ''} {str(dtype).removeprefix('torch.')}"
            wrong.append(f"{rows}x{width} {quant} off by {off.max().item():.3g}")
    return tuple(wrong)


@functools.cache
def check(device: str = "cpu") -> Verdict:
    """The self-test of this process's bitsandbytes on ``device`` (a device type), once per process: on the
    CPU, where it is wrong, the way around it is put in place and tested too, and one line says so."""
    wrong = compare(device=device)
    if not wrong:
        return Verdict(device, ())
    if device != "cpu":
        log.error("bitsandbytes: 4-bit dequantization is wrong on %s (%s)", device, wrong[0])
        return Verdict(device, wrong)
    go_around()
    verdict = Verdict(device, wrong, around=True, still_wrong=compare(device=device))
    (log.warning if verdict.ok else log.error)(
        "bitsandbytes %s: %s", version("bitsandbytes"), verdict.describe()
    )
    return verdict


_around: torch.library.Library | None = None


def go_around() -> None:
    """Every CPU 4-bit dequantization of a matrix whose width is not a multiple of its block goes through
    ``_dequantize_in_blocks`` (idempotent)."""
    global _around
    if _around is None:
        library = torch.library.Library("bitsandbytes", "FRAGMENT")
        library.impl("dequantize_4bit", _dequantize_in_blocks, "AutogradCPU")
        # matmul_4bit's forward is the op gemm_4bit, whose kernel (bitsandbytes' default: it has no CPU one)
        # dequantizes inside: below autograd when a dispatch mode runs it (selective checkpointing's), where
        # the kernel above is not asked, so gemm_4bit gets a CPU kernel of its own
        library.impl("gemm_4bit", _gemm_in_blocks, "CPU")
        _around = library


def _dequantize_in_blocks(A, absmax, blocksize, quant_type, shape, dtype):
    # in front of bitsandbytes' CPU kernel (AutogradCPU runs first; its inputs never need gradients): the
    # same bytes as rows of one block each, which its AVX-512 branch indexes right and still runs in
    # parallel over rows, or as one flat row when the last block is partial
    op = torch.ops.bitsandbytes.dequantize_4bit.default
    with torch._C._AutoDispatchBelowAutograd():
        if len(shape) < 2 or shape[-1] % blocksize == 0 or shape[-1] % 2:  # right as it is (odd: torch's)
            return op(A, absmax, blocksize, quant_type, shape, dtype)
        values = prod(shape)
        blocks = [values // blocksize, blocksize] if values % blocksize == 0 else [values]
        return op(A, absmax, blocksize, quant_type, blocks, dtype).view(*shape)


def _gemm_in_blocks(
    A,
    B,
    shapeB,
    absmax,
    blocksize,
    quant_type,
    bias=None,
    absmax_8bit=None,
    absmax_code=None,
    absmax_offset=None,
):
    # bitsandbytes' default gemm_4bit (backends/default/ops.py), the weights dequantized in blocks
    if absmax_8bit is not None:  # double quantization: absmax holds the second-level absmax, 256 a block
        absmax = (
            torch.ops.bitsandbytes.dequantize_blockwise.default(
                absmax_8bit, absmax, absmax_code, 256, torch.float32
            )
            + absmax_offset
        )
    weight = _dequantize_in_blocks(B, absmax, blocksize, quant_type, shapeB, A.dtype)
    return torch.nn.functional.linear(A, weight, bias)


def guard(model: torch.nn.Module, verdict: Verdict | None = None) -> Verdict:
    """The self-test for the device of ``model``'s 4-bit weights, before they are used: a TrainingGuardError
    in one line, naming a layer and its width, when they would be wrong there. ``verdict``: this process's
    ``check`` unless given (a test gives a wrong one)."""
    layers = four_bit_widths(model)
    if not layers:
        return Verdict("none", ())
    verdict = verdict or check(next(iter(layers.values()))[0])
    if verdict.ok:
        return verdict
    odd = [(name, width) for name, (_, width) in layers.items() if width % BLOCKSIZE]
    name, width = (odd or [(name, width) for name, (_, width) in layers.items()])[0]
    raise TrainingGuardError(
        f"bitsandbytes {version('bitsandbytes')}: {verdict.describe()}: {name} ({width} values a row) would train on wrong 4-bit "
        "weights; install another bitsandbytes release, or load the model with quant.bits 16"
    )


def four_bit_widths(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """{layer: (device type, row width)} of every 4-bit weight of ``model``: bitsandbytes' Linear4bit layers
    and our packed experts (moe_experts.ExpertStats)."""
    found = {}
    for name, module in model.named_modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            found[name] = (module.weight.device.type, int(state.shape[-1]))
        elif hasattr(module, "absmax") and hasattr(module, "blocksize") and hasattr(module, "nested"):
            found[name] = (module.absmax.device.type, int(module.shape[-1]))  # experts: (E, out, in)
    return found
