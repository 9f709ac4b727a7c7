"""The per-op diagnostic: a real forward's saved bytes and the planner's trace, lined up op by op."""

from collections import defaultdict

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.memory import checkpointing, saved_by_op
from qlora_kit.model import adapters
from qlora_kit.model import loading as model

BATCH, SEQ = 2, 64


@pytest.fixture(scope="module")
def run():
    """tiny-llama as the run loads it (NF4, LoRA with dropout), no checkpointing, full logits."""
    recipe = Recipe.from_dict(
        {
            "model": {"path": "builtin:tiny-llama"},
            "memory": {"checkpointing": "none", "chunked_loss": False},
            "data": {"packing": False},
        }
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    checkpointing.enable_checkpointing(base, recipe.memory)
    peft_model = adapters.attach_lora(base, recipe.lora)
    ids = torch.randint(5, 600, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return recipe, base.config, peft_model, ids


def per_module(rows, side):
    totals = defaultdict(int)
    for row in rows:
        totals[row.module] += getattr(row, side)
    return dict(totals)


def test_rows_of_one_length_agree_module_by_module(run):
    recipe, config, peft_model, ids = run
    measured = saved_by_op.measured_by_op(peft_model, {"input_ids": ids, "labels": ids})
    rows = saved_by_op.compare(measured, saved_by_op.traced_by_op(config, recipe, BATCH, SEQ, padded=False))
    assert sum(r.measured for r in rows) == sum(r.traced for r in rows) > 0
    assert per_module(rows, "measured") == per_module(rows, "traced")
    assert any(r.module.startswith("model.layers.3.self_attn") for r in rows), "every layer's modules named"


def test_a_padded_run_against_an_unpadded_trace_names_attentions_mask(run):
    """The planted difference: the run's batch is padded (an attention mask), the trace's is not. The
    diagnostic names the mask sdpa keeps (``aten.where`` in each layer's attention) and nothing outside
    attention."""
    recipe, config, peft_model, ids = run
    mask = torch.ones_like(ids)
    mask[1, 48:] = 0
    measured = saved_by_op.measured_by_op(
        peft_model, {"input_ids": ids, "labels": ids, "attention_mask": mask}
    )
    rows = saved_by_op.compare(measured, saved_by_op.traced_by_op(config, recipe, BATCH, SEQ, padded=False))
    where = {r.module: r for r in rows if r.op == "aten.where"}
    for layer in range(config.num_hidden_layers):
        row = where[f"model.layers.{layer}.self_attn"]
        assert row.traced == 0 < row.measured, row
    run, trace = per_module(rows, "measured"), per_module(rows, "traced")
    differing = {m for m in run if run[m] != trace[m]}
    assert differing and all(".self_attn" in m for m in differing), differing
    assert "aten.where" in saved_by_op.table(rows, limit=len(rows))
