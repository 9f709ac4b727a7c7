"""benchmarks/families_matrix.py's rows on a fixed sample (the whole table: benchmarks/results/families-matrix.md):
a tiny random model of each model_type, saved into a folder, goes through qlora_kit as a user's checkpoint
would. A type that is no decoder-only text model is skipped, saying why; one qlora_kit cannot train is refused
in its one line, before any training (the fast tier); one that works loads in 4 bits, trains two steps under
full checkpointing as the planner plans, merges and loads back by plain peft (slow: it trains)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import families_matrix  # noqa: E402

# model_type -> (outcome, where it stopped, what its line says)
NOT_TRAINED = {
    "bert": ("skipped", "", "an encoder (masked LM)"),
    # refused before the weights load: the config names no attention heads
    "mamba": ("refused", "run", "mamba has no attention layers"),
    # refused once loaded: FalconLinear subclasses nn.Linear, which bitsandbytes' integration does not replace
    "falcon": ("refused", "run", "4-bit loading quantized none of falcon's linear layers (FalconLinear)"),
    # refused before the weights load: Gemma 3n writes into a linear layer's weight in its forward pass
    "gemma3n_text": ("refused", "run", "gemma3n_text cannot load in 4 bits: its AltUp clamps"),
    # refused before the weights load: its config sets its attention's sizes layer by layer, which qlora_kit
    # reads once for all (it reads Gemma 4's head_dim and num_key_value_heads layer by layer)
    "dots3_note_text": ("refused", "run", "dots3_note_text sets kv_lora_rank, num_attention_heads"),
    # refused once loaded: Llama 4's experts are not declared with transformers' use_experts_implementation,
    # whose layout qlora_kit reads to pack them
    "llama4_text": (
        "refused",
        "run",
        "model.layers.0.feed_forward.experts (Llama4TextExperts) is not declared with transformers' "
        "use_experts_implementation",
    ),
}


@pytest.mark.parametrize("model_type", NOT_TRAINED)
def test_a_model_qlora_kit_does_not_train_is_skipped_or_refused_in_one_line(model_type, tmp_path):
    row = families_matrix.check_model_type(model_type, tmp_path)
    outcome, stage, line = NOT_TRAINED[model_type]
    assert (row.outcome, row.stage) == (outcome, stage), row
    assert line in row.line and "\n" not in row.line, row
    assert row.measured is None and row.planned is None


@pytest.mark.slow  # it trains two steps
def test_llama_works_from_its_folder_through_merge_and_plain_peft(tmp_path):
    row = families_matrix.check_model_type("llama", tmp_path)
    assert row.outcome == "works", row
    assert row.four_bit == 1.0, "every linear layer of the decoder in 4 bits"
    # full checkpointing keeps each layer's input and the head's: the planner plans it within a percent
    assert abs(row.planned / row.measured - 1) < 0.01, row


@pytest.mark.parametrize(
    ("model_type", "line"),
    [
        ("mamba", "model.path: mamba has no attention layers"),
        ("openai-gpt", "model.path: openai-gpt's transformers code (OpenAIGPTLMHeadModel) does not support"),
        ("dots3_note_text", "model.path: dots3_note_text sets kv_lora_rank, num_attention_heads"),
    ],
)
def test_plan_refuses_what_train_refuses_in_the_same_one_line(model_type, line, tmp_path):
    """The planner reads the config and a meta model: it refuses such a model as loading does, not with a
    traceback from a layer it cannot size."""
    from tiny_configs import build_model

    from qlora_kit.errors import RecipeError
    from qlora_kit.memory.planner import plan

    path = build_model(model_type, tmp_path / "model")
    recipe = families_matrix.recipe_for(path, tmp_path / "run")
    with pytest.raises(RecipeError) as refused:
        plan(recipe, device="cpu")
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
