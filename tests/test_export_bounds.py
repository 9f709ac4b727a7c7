"""The parity report's file-vs-floor bounds (after/parity_judgement.py), derived from merge's error model
(after/drift_bounds.py): llama.cpp's q8_0 input rounding as the model counts it against gguf's own q8_0
rounding of the same activations, and the reader's arithmetic ordered as the readers' are."""

from __future__ import annotations

import pytest
import torch

from qlora_kit.after import drift_bounds
from qlora_kit.after.parity_judgement import FloorBounds, reader_variance

gguf = pytest.importorskip("gguf")


def test_q8_0s_input_rounding_is_what_the_block_model_derives():
    """block_rounding_variance at the peaks BlockPeaks measures on a linear layer's input, against that
    input rounded by gguf's q8_0 (llama.cpp's quantize_row_q8_0: blocks of 32 in steps of absmax / 127)
    over 4,096 blocks, one feature an outlier 8x the rest. The model gives every value an error uniform
    over a step; a block's peak is exact (1 value of 32), so the sampled variance lies between 31/32 of the
    model and the model, within the sampling's spread (about 0.5% of the mean here: 5% each side)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(128, 1024, generator=generator)  # (rows, features): 32 blocks a row
    inputs[:, 5] *= 8
    layer = torch.nn.Linear(1024, 4)
    peaks = drift_bounds.BlockPeaks(layer)
    layer(inputs)
    peaks.remove()
    qtype = gguf.GGMLQuantizationType.Q8_0
    rounded = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(inputs.numpy(), qtype), qtype))
    sampled = float((rounded - inputs).square().sum() / inputs.square().sum())
    modelled = drift_bounds.block_rounding_variance(peaks.ratio())
    assert modelled * 31 / 32 * 0.95 <= sampled <= modelled * 1.05, (sampled, modelled)
    assert 4 < peaks.ratio() < 32  # Gaussian blocks' peaks, raised by the outlier: measured, not assumed


def test_each_readers_bound_follows_its_arithmetic():
    """transformers reads the floor's own weights in float32: its bound is float32's roundoff alone, far
    below llama.cpp's, which rounds its inputs (f16 << q8_0's 8 bits); more layers, a wider bound."""
    log_probs = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).mul(3)  # (T, V) logits

    def bound(kind, reader, passes=17):
        return FloorBounds(kind, passes, [log_probs], 5.0).max_kl(reader)

    assert reader_variance("q8_0", "transformers", 5.0) == reader_variance("float16", "transformers", 5.0)
    assert bound("q8_0", "transformers") < bound("f16", "llama.cpp") < bound("q8_0", "llama.cpp")
    assert bound("q8_0", "llama.cpp", passes=121) > bound("q8_0", "llama.cpp")


def test_the_floors_inputs_are_rounded_as_q8_0_rounds_them():
    """RoundedInputs, the in-memory reading of llama.cpp's q8_0 products whose KL the llama.cpp bound
    counts, gives a linear layer the input gguf's own q8_0 round trip gives, bit for bit (the steps at the
    float32 scale, read back at the float16 one the block stores)."""
    generator = torch.Generator().manual_seed(2)
    inputs = torch.randn(16, 256, generator=generator)
    inputs[:, 3] *= 9
    qtype = gguf.GGMLQuantizationType.Q8_0
    expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(inputs.numpy(), qtype), qtype))
    layer = torch.nn.Linear(256, 1, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[0, 3] = 1.0  # reads the outlier feature of each row as the layer received it
        rounding = drift_bounds.RoundedInputs(layer)
        got = layer(inputs)[:, 0]
        rounding.remove()
        plain = layer(inputs)[:, 0]
    assert torch.equal(got, expected[:, 3]) and not torch.equal(plain, got)


@pytest.mark.slow  # builds and rounds the tiny model, ~3 s
def test_the_bounds_benchmark_writes_its_table_of_the_bounds_derived(tmp_path):
    """benchmarks/export_floor_bounds.py --untrained at smoke size: the table of the bounds for each reader,
    finite, each at SAFETY times its expectation, llama.cpp's q8_0 one over transformers' reading. In this
    process (tests/benchmark_smoke.run_script: its argv and sys.path as from the shell), not a second
    interpreter's ~7 s of imports: the claim is the table, checked as every script's is."""
    from tests.benchmark_smoke import run_script
    from tests.e2e.test_benchmarks import BENCHMARKS, TABLES, check_smoke_table

    committed = BENCHMARKS / "results" / TABLES["export_floor_bounds.py"][0]
    before = committed.read_bytes()
    status = run_script("export_floor_bounds.py", tmp_path, "--untrained")
    assert status["exit"] == 0, status.get("error")
    _, tables = check_smoke_table("export_floor_bounds.py", tmp_path, before, ("--untrained",))
    bounds = {(row[0], row[1]): float(row[-1]) for row in tables[0][1]}
    assert bounds[("llama.cpp", "q8_0")] > bounds[("llama.cpp", "f16")] > bounds[("transformers", "q8_0")]
