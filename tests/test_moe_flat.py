"""DBRX's experts, flat 2-D stacks transformers does not declare (model/moe_flat.py): packed in 4 bits by the
families table's entry, computing what transformers' own DbrxExperts loop computes in float64 on the same
dequantized weights with LoRA's update merged in peft's own 2-D form; the adapter holds the tensors plain
peft makes on the 16-bit model, and the whole row (train, plan, merge, plain peft) works with every expert
weight in 4 bits."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import transformers
from peft import get_peft_model, get_peft_model_state_dict
from transformers.models.dbrx.modeling_dbrx import DbrxExperts

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.model import adapters, experts_selfcheck, moe_experts, moe_flat
from qlora_kit.registries import families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import families_matrix  # noqa: E402

# each test builds a DBRX (1.5 s here) and packs, wraps or loads it: 2-5 s, past the fast tier's share
pytestmark = pytest.mark.slow

EXPERTS, HIDDEN, FFN = 4, 64, 32


def tiny_dbrx(dtype=torch.float32):
    """A DBRX of 1 layer, 4 experts (top 2), hidden 64, with random weights."""
    torch.manual_seed(0)
    config = transformers.DbrxConfig(
        d_model=HIDDEN,
        n_heads=4,
        n_layers=1,
        vocab_size=256,
        attn_config={"kv_n_heads": 1, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": FFN, "moe_num_experts": EXPERTS, "moe_top_k": 2},
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def packed_with_lora(compute_dtype: str):
    """The tiny DBRX with its experts packed and LoRA (r 4) on every stack, B drawn non-zero."""
    recipe = Recipe.from_dict(
        {
            "quant": {"compute_dtype": compute_dtype},
            "lora": {"rank": 4, "dropout": 0.0, "target_modules": ["Wqkv"]},
        }
    )
    dtype, quant = getattr(torch, compute_dtype), recipe.quant
    model = tiny_dbrx(dtype)
    assert moe_experts.quantize_experts(model, dtype, quant.quant_type, quant.double_quant) == 1
    peft_model = get_peft_model(model, adapters.lora_config(recipe.lora, model))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    return peft_model


def merged_reference(block, layout) -> DbrxExperts:
    """transformers' DbrxExperts in float64 holding the block's stacks dequantized with each stack's LoRA
    update B @ A * scaling added (peft's get_delta_weight for a 2-D parameter)."""
    holder = moe_flat.holder_of(block, layout)
    unpacked = copy.deepcopy(holder)
    for stack in moe_flat.stack_names(layout):
        moe_flat.unpack_stack(unpacked, stack)
    reference = copy.deepcopy(block).double()
    reference.__dict__.pop("forward", None)
    reference.mlp = unpacked.double()
    wrapper = block.mlp
    while isinstance(wrapper, moe_flat.LoraFlatExperts):
        delta = wrapper.get_delta_weight("default").double()  # (experts x rows, columns)
        getattr(reference.mlp, wrapper.parameter_name).data += delta
        wrapper = wrapper.base_layer
    return reference


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_dbrx_experts_pack_in_4_bits_and_compute_transformers_loop_with_lora_in_float64(compute_dtype):
    """Every stack of every layer packed (uint8, statistics beside it), LoRA on each stack in peft's 2-D
    shapes, and one block's forward within the compute dtype's tolerance of transformers' own loop in float64
    on the dequantized weights plus the LoRA update. Red with the gate and up stacks swapped in the families
    entry (0.6 of the largest output), with the down stack's factors applied as the gate's (B's slice
    and A swapped: a shape error), with the routing weights left out (0.8), or with the forward taking no
    LoRA factors (no gradient reaches them)."""
    dtype = getattr(torch, compute_dtype)
    peft_model = packed_with_lora(compute_dtype)
    blocks = moe_flat.flat_experts(peft_model)
    assert len(blocks) == 1
    name, block, layout = blocks[0]
    holder = moe_flat.holder_of(block, layout)
    for stack in moe_flat.stack_names(layout):
        assert getattr(holder, stack).dtype == torch.uint8
        assert getattr(holder, f"{stack}_4bit").shape[0] == EXPERTS
    lora = {
        n: tuple(p.shape) for n, p in peft_model.named_parameters() if ".experts." in n and p.requires_grad
    }
    assert lora[f"{name}.mlp.lora_A.default.weight"] == (4, HIDDEN)  # peft's: (r, columns)
    assert lora[f"{name}.mlp.base_layer.base_layer.lora_B.default.weight"] == (EXPERTS * FFN, 4)

    states, picks, weights = experts_selfcheck.random_batch(block, HIDDEN, dtype, seed=1)
    reference = merged_reference(block, layout)
    with torch.no_grad():
        ours = block(states, picks, weights)
        expected = reference(states.double()[None], picks, weights.double()).view(states.shape)
    assert ours.dtype == dtype
    assert experts_selfcheck.difference(ours, expected) <= experts_selfcheck.tolerance(dtype)
    block(states, picks, weights).float().square().sum().backward()  # every stack's factors train
    factors = [(n, p) for n, p in block.named_parameters() if "lora_" in n]
    assert len(factors) == 6 and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in factors)


def test_dbrx_adapter_holds_the_tensors_plain_peft_makes_on_the_16_bit_model():
    """The packed model's adapter tensors have the names and shapes plain peft gives the same targets on
    transformers' 16-bit DBRX (so it reloads there and merges); unpacking gives the 2-D stacks back."""
    peft_model = packed_with_lora("float32")
    ours = {k: v.shape for k, v in get_peft_model_state_dict(peft_model).items()}
    plain = get_peft_model(tiny_dbrx(), copy.deepcopy(peft_model.peft_config["default"]))
    theirs = {k: v.shape for k, v in get_peft_model_state_dict(plain).items()}
    assert ours == theirs and any(".experts.mlp." in k for k in ours)
    base = peft_model.get_base_model()
    assert moe_experts.dequantize_experts(base) == 3
    assert base.transformer.blocks[0].ffn.experts.mlp.base_layer.base_layer.base_layer.w1.shape == (
        EXPERTS * FFN,
        HIDDEN,
    )


def test_the_load_time_check_passes_dbrx_and_refuses_a_families_entry_that_lies(monkeypatch):
    """The self-check at load runs a packed block against DbrxExperts' own forward on the dequantized weights:
    it passes the table's entry, and refuses one that reads the up stack as the gate in one line naming the
    layer and the entry. Red when check() leaves flat stacks unchecked (the lie loads)."""
    quant = Recipe.from_dict({"quant": {"compute_dtype": "float32"}}).quant
    model = tiny_dbrx()
    moe_experts.quantize_experts(model, torch.float32, quant.quant_type, quant.double_quant)
    experts_selfcheck.check(model)  # no refusal
    lie = dataclasses.replace(families.FLAT_EXPERTS["dbrx"], gate="v1", up="w1")
    monkeypatch.setitem(families.FLAT_EXPERTS, "dbrx", lie)
    model = tiny_dbrx()
    moe_experts.quantize_experts(model, torch.float32, quant.quant_type, quant.double_quant)
    with pytest.raises(RecipeError) as refused:
        experts_selfcheck.check(model)
    line = str(refused.value)
    assert line.startswith("model.path: transformer.blocks.0.ffn.experts's 4-bit experts do not compute"), (
        line
    )
    assert "reads mlp.v1/w1/w2 as gate/up/down" in line and "\n" not in line, line


def test_dbrx_row_works_with_every_expert_in_4_bits(tmp_path):
    row = families_matrix.check_model_type("dbrx", tmp_path)
    assert row.outcome == "works", row
    assert row.four_bit == 1.0, row  # was 0.10: the experts stayed in 16 bits
