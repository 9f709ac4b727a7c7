"""A family of any shape is one entry: a made-up family with decoder layers of two sizes and two kinds, added
through one entry of the families table (its builtin comes from that entry), loads in 4 bits, trains, is
planned within the grid's bounds against what its run saved, and merges.

The made-up architecture is transformers' own Gemma 4 text classes under a model_type of its own
(``two_shape_text``, registered with AutoConfig and AutoModelForCausalLM), so no code keyed by Gemma 4's
model_type can serve it. Its shape is not the tiny Gemma 4's: a full-attention layer first and last, two
sliding-window layers between (two kinds); the full-attention layers' heads are 64 wide with a key/value head
per query head, the sliding ones' 32 wide on 2 key/value heads (a heterogeneous ``per_layer_config``), and the
last layer reuses the first's keys and values with an MLP twice as wide (``use_double_wide_mlp``): layers of
two attention sizes and two MLP sizes. Per-layer embeddings (64 wide) beside the main ones.
"""

from __future__ import annotations

import math

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig

from qlora_kit.registries import families
from qlora_kit.registries.family_traits import GATED, Family, NoExport
from tests.conftest import quick_recipe
from tests.test_planner_grid import write_rows

pytestmark = pytest.mark.slow  # builds, trains and merges a model


class TwoShapeTextConfig(Gemma4TextConfig):
    model_type = "two_shape_text"


class TwoShapeForCausalLM(Gemma4ForCausalLM):
    config_class = TwoShapeTextConfig


AutoConfig.register(TwoShapeTextConfig.model_type, TwoShapeTextConfig, exist_ok=True)
AutoModelForCausalLM.register(TwoShapeTextConfig, TwoShapeForCausalLM, exist_ok=True)

FULL, SLIDING = "full_attention", "sliding_attention"
# the full-attention layers' heads (the sliding ones': 32 wide, 2 key/value heads)
WIDE_HEADS = {"head_dim": 64, "num_key_value_heads": 4}
TWO_SHAPE = Family(
    model_type=TwoShapeTextConfig.model_type,
    config_class=TwoShapeTextConfig.__name__,
    tiny="tiny-two-shape",
    tiny_config={
        "head_dim": 32,
        "layer_types": [FULL, SLIDING, SLIDING, FULL],
        "sliding_window": 32,
        "per_layer_config": {0: WIDE_HEADS, 3: WIDE_HEADS},
        "num_kv_shared_layers": 1,  # the last layer reads the first's keys and values
        "use_double_wide_mlp": True,  # and its MLP is 512 wide (the others' 256)
        # per-layer embeddings beside the main ones (transformers' Gemma 4 skips its layers that reuse keys
        # and values only where the model has them: without, its forward fails on per_layer_inputs None)
        "hidden_size_per_layer_input": 64,
        "vocab_size_per_layer_input": 640,  # the builtin tokenizer's
    },
    linears=(*families.LLAMA_LINEARS, "per_layer_input_gate", "per_layer_projection"),  # Gemma 4's
    attention_inputs=families.QKV,
    mlp=GATED,
    export=NoExport("a made-up family (tests/test_two_shape_family.py)"),
)


@pytest.fixture
def two_shape_family(monkeypatch):
    """The made-up family's one entry, in the table for this test only."""
    monkeypatch.setitem(families.FAMILIES, TWO_SHAPE.model_type, TWO_SHAPE)
    return TWO_SHAPE


class BatchShapes(TrainerCallback):
    """The (batch, tokens) of every micro-batch the run's model is handed."""

    def __init__(self):
        self.shapes: list[tuple[int, int]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_pre_hook(
            lambda module, args, kwargs: self.shapes.append(tuple(kwargs["input_ids"].shape)),
            with_kwargs=True,
        )


def test_a_family_of_two_layer_sizes_and_kinds_loads_trains_plans_and_merges(two_shape_family, tmp_path):
    from qlora_kit import merge
    from qlora_kit.memory.monitor import MIB
    from qlora_kit.memory.planner import plan
    from qlora_kit.registries import metric_keys as keys
    from qlora_kit.training.pipeline import run

    rows, held_out = tmp_path / "rows.jsonl", tmp_path / "held_out.jsonl"
    write_rows(rows, "chat", 40)
    held_out.write_text("".join(rows.read_text().splitlines(keepends=True)[:2]))  # merge's drift rows
    recipe = quick_recipe(
        tmp_path / "run",
        **{
            "model.path": f"builtin:{two_shape_family.tiny}",
            "data.path": str(rows),
            "data.val_path": str(held_out),
            "data.format": "chat",
            "data.max_seq_len": 128,
            "memory.checkpointing": "none",  # every layer keeps its activations: each kind's figure counts
            "memory.chunked_loss": False,
            "lora.dropout": 0.0,
            "train.micro_batch_size": 2,
            "train.max_steps": 2,
        },
    )
    shapes = BatchShapes()
    result = run(recipe, callbacks=[shapes])

    # loaded: the two kinds' and two sizes' linears in 4 bits, each with its own width
    layers = result.model.base_model.model.model.layers
    assert [layer.self_attn.layer_type for layer in layers] == [FULL, SLIDING, SLIDING, FULL]
    widths = [(layer.self_attn.q_proj.out_features, layer.mlp.down_proj.in_features) for layer in layers]
    assert widths == [(256, 256), (128, 256), (128, 256), (256, 512)]
    assert all(layer.mlp.down_proj.base_layer.weight.dtype == torch.uint8 for layer in layers)
    # trained: the steps ran, at finite losses, and moved every LoRA B off its zero start
    assert result.steps == 2 and all(math.isfinite(loss) for loss in result.train_losses)
    lora_b = [p for name, p in result.model.named_parameters() if "lora_B" in name]
    assert lora_b and all(p.detach().abs().sum() > 0 for p in lora_b)

    # planned: the plan of the batch it trained on against the bytes the run counted as saved, the grid's bound
    batch, seq = max(shapes.shapes)
    the_plan = plan(recipe, batch=batch, seq=seq, device="cpu")
    assert the_plan.activation_source == "traced"  # each kind of layer traced, not the formula's one layer
    # its weights: every linear the run loaded in 4 bits, at each layer's own width
    loaded = [m for m in result.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert the_plan.shape.quantized_values == sum(m.weight.quant_state.shape.numel() for m in loaded)
    planned = the_plan.chosen(recipe).activations
    measured = result.memory[keys.SAVED_MIB] * MIB
    print(f"planned {planned}, measured {measured:.0f}: {planned / measured - 1:+.2%} at {batch} x {seq}")
    assert -0.02 <= planned / measured - 1 <= 0.05, (planned, measured)

    # merged: drift-checked against the trained adapter, and transformers reads the folder back as the family
    merge(str(result.output_dir), str(tmp_path / "merged"))  # raises where the merged model drifts
    back = AutoConfig.from_pretrained(tmp_path / "merged")
    assert back.model_type == TWO_SHAPE.model_type and back.per_layer_config[0].head_dim == 64
