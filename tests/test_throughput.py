"""Throughput in metrics.jsonl: the model-FLOPs count against torch's own FLOP counter, and the logged
trained tokens against the training set's labels over one epoch."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qlora_kit import Recipe, train
from qlora_kit.data import prepare
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.model import adapters
from qlora_kit.model import loading as model
from qlora_kit.training.watch.throughput import flops_per_token, peak_tflops
from tests.conftest import quick_recipe


@pytest.mark.parametrize("model_path", ["builtin:tiny-llama", "builtin:tiny-gemma4"])
@pytest.mark.parametrize("sequence", [32, 256])
def test_model_flops_per_token_match_torchs_flop_counter_for_lora_on_a_frozen_base(sequence, model_path):
    """16-bit weights and eager attention: torch's counter sees matmuls, not bitsandbytes' 4-bit kernel or
    the CPU's fused sdpa; the FLOPs are the same on the GPU's kernels. Gemma 4's attention is counted layer
    by layer (heads of 64 in its full-attention layers, 32 in the others: the count is 8% low at 256 tokens
    if it reads every layer's as the sliding layers')."""
    recipe = Recipe.from_dict(
        {
            "model": {"path": model_path, "attn_implementation": "eager"},
            "quant": {"bits": 16, "compute_dtype": "float32"},
            "lora": {"dropout": 0.0},
            "data": {"packing": False},
        }
    )
    lora = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora).train()
    ids = torch.randint(5, 600, (2, sequence))
    with FlopCounterMode(display=False) as counter:
        lora(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops() / ids.numel()
    # within 3%: backward skips the input gradient of the first layer's projections (their input, the
    # frozen embeddings, needs none), 2% of the work on this 4-layer model, less on deeper ones; and within
    # 5% for Gemma 4, whose per-layer embeddings' projection reads the embeddings too (4.4% at 32 tokens)
    bound = 0.05 if "gemma4" in model_path else 0.03
    assert measured == pytest.approx(flops_per_token(lora, sequence), rel=bound)


@pytest.mark.slow  # trains: the fast tier (-m 'not slow') trains nothing
def test_trained_tokens_over_an_epoch_are_the_training_sets_and_mfu_needs_a_peak(tmp_path):
    out = tmp_path / "out"
    recipe = quick_recipe(out, **{"train.epochs": 1, "train.logging_steps": 1, "train.peak_tflops": 0.001})
    train(recipe)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    tokenizer = model.load_tokenizer(recipe.model)
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    expected = sum(sum(t != IGNORE_INDEX for t in labels) for labels in prepared.train["labels"])
    assert steps[-1]["trained_tokens"] == expected
    assert [r["trained_tokens"] for r in steps] == sorted(r["trained_tokens"] for r in steps)
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in steps)
    if not torch.cuda.is_available():
        assert peak_tflops(None) is None  # a CPU has no known peak: no MFU unless the recipe gives one


def test_the_flop_count_includes_gpt2s_conv1d_projections():
    """One definition of a linear layer (model/layers.py): GPT-2's Conv1D projections count for MFU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from qlora_kit.training.watch.throughput import FlopsPerToken

    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    per_layer = 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32  # c_attn, c_proj, c_fc, mlp.c_proj
    assert FlopsPerToken(model).weights == 2 * per_layer + 32 * 64  # and the head
