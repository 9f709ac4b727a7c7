"""The self-test of bitsandbytes' 4-bit dequantization (model/bnb_selftest.py): it catches a wrong one, its
verdict on this CPU is what a plain comparison shows, and with it a Linear4bit's forward and backward give
the independent reference's numbers; where the weights would stay wrong a load is refused in one line."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import pytest
import torch

from qlora_kit.errors import TrainingGuardError
from qlora_kit.model import bnb_selftest
from qlora_kit.testing import model_state


def blocks_per_row(packed, state):
    """The AVX-512 kernel's mistake, in plain torch: each row's values scaled as if the row began a block."""
    rows, width = state.shape
    flat = bnb_selftest.reference_dequantize(packed, state).reshape(-1)
    code = flat / bnb_selftest._absmax(state)[torch.arange(flat.numel()) // state.blocksize]
    per_row = -(-width // state.blocksize)
    block = torch.arange(rows)[:, None] * per_row + torch.arange(width)[None, :] // state.blocksize
    return code.reshape(rows, width) * bnb_selftest._absmax(state)[block.clamp(max=state.absmax.numel() - 1)]


def test_the_self_test_catches_a_wrong_dequantization():
    wrong = bnb_selftest.compare(dequantize=blocks_per_row)
    assert [line.split(" off by")[0] for line in wrong] == [
        "128x48 nf4 float32",
        "128x48 fp4 float32",
        "128x48 nf4 double quant bfloat16",
        "3x48 nf4 double quant float32",
    ]  # the 64-wide matrix, whole blocks a row, is right that way
    assert bnb_selftest.compare(dequantize=lambda p, s: bnb_selftest.reference_dequantize(p, s)) == ()


def test_the_tolerance_is_a_few_ulps_not_more():
    """The bound is one eps of the dtype + two of float32 times the block's |absmax| (+ |offset| with double
    quantization, the mean absmax: at most the largest): the exact weights 8 eps of float32 high fail every
    float32 matrix at its largest weights, and pass the bfloat16 one."""
    high = bnb_selftest.compare(
        dequantize=lambda p, s: (
            bnb_selftest.reference_dequantize(p, s) * (1 + 8 * torch.finfo(torch.float32).eps)
        )
    )
    assert [line.split(" off by")[0] for line in high] == [
        "128x48 nf4 float32",
        "128x48 fp4 float32",
        "3x48 nf4 double quant float32",
        "128x64 nf4 double quant float32",
    ]


def test_the_verdict_on_this_cpu_is_what_a_plain_comparison_shows():
    """On an AVX-512 CPU bitsandbytes 0.50 is wrong at width 48 and the run goes around it; elsewhere it is
    right: either way the verdict says what comparing with the reference shows, and ends right."""
    model_state.stop_going_around()
    try:
        generator = torch.Generator().manual_seed(5)
        packed, state = bnbf.quantize_4bit(torch.randn(64, 48, generator=generator), quant_type="nf4")
        off = (
            bnbf.dequantize_4bit(packed, state).double() - bnb_selftest.reference_dequantize(packed, state)
        ).abs()
        wrong_here = not bool((off <= bnb_selftest.tolerance(state)).all())
        verdict = bnb_selftest.check("cpu")
        assert bool(verdict.wrong) == wrong_here == verdict.around
        assert verdict.ok and verdict.still_wrong == ()
        fixed = (
            bnbf.dequantize_4bit(packed, state).double() - bnb_selftest.reference_dequantize(packed, state)
        ).abs()
        assert bool((fixed <= bnb_selftest.tolerance(state)).all())
    finally:
        bnb_selftest.check("cpu")  # as every 4-bit load leaves it


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_linear4bit_forward_and_backward_match_the_reference(compute_dtype):
    """A 48-wide Linear4bit (NF4, double quant) after the self-test: its output and its input's gradient are
    the float64 product with the weights unpacked by plain torch, within the matmul's rounding."""
    assert bnb_selftest.check("cpu").ok
    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 32, bias=False)
    layer = bnb.nn.Linear4bit(48, 32, bias=False, compute_dtype=compute_dtype, quant_type="nf4")
    params = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4")
    layer.weight = params._quantize("cpu")  # what .to(device) does for a weight that arrives unquantized
    weight = bnb_selftest.reference_dequantize(layer.weight.data, layer.weight.quant_state)
    x = torch.randn(5, 48, dtype=compute_dtype, requires_grad=True)
    grad = torch.linspace(-1, 1, 5 * 32, dtype=compute_dtype).reshape(5, 32)
    layer(x).backward(grad)
    y = layer(x).double()
    x64, grad64 = x.detach().double(), grad.double()
    # a sum of K products in the dtype is within K * eps of the sum of their magnitudes (Higham), the
    # weights' cast to the dtype one eps more, the output's rounding one more: (K + 2) * eps * |x| @ |W|.T
    eps = torch.finfo(compute_dtype).eps
    assert bool(((y - x64 @ weight.T).abs() <= (48 + 2) * eps * (x64.abs() @ weight.abs().T)).all())
    assert bool(
        ((x.grad.double() - grad64 @ weight).abs() <= (32 + 2) * eps * (grad64.abs() @ weight.abs())).all()
    )


def test_a_load_whose_weights_would_stay_wrong_is_refused_naming_the_layer_and_its_width():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(48, 64))
    for index in (0, 1):
        model[index] = bnb.nn.Linear4bit(model[index].in_features, 64, quant_type="nf4")
        model[index].weight = model[index].weight._quantize("cpu")
    assert bnb_selftest.four_bit_widths(model) == {"0": ("cpu", 64), "1": ("cpu", 48)}
    wrong = bnb_selftest.Verdict("cpu", ("128x48 nf4 float32 off by 0.0818",))
    with pytest.raises(TrainingGuardError) as refused:
        bnb_selftest.guard(model, wrong)
    line = str(refused.value)
    assert "\n" not in line and "1 (48 values a row)" in line and "wrong on this CPU" in line
    assert bnb_selftest.guard(model).ok  # this process's own verdict: right, or gone around
