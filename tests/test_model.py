"""4-bit loading: layer types, packed dtypes, quantization state, and the CPU repacking trap."""

import bitsandbytes as bnb
import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.memory import checkpointing
from qlora_kit.model import adapters
from qlora_kit.model import loading as model


def load(**quant):
    recipe = Recipe.from_dict({"quant": quant})
    return model.load_base_model(recipe.model, recipe.quant)


def decoder_linears(base):
    return {
        name: m for name, m in base.named_modules() if ".layers." in name and isinstance(m, torch.nn.Linear)
    }


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_every_decoder_linear_is_packed_4bit(quant_type, double_quant):
    base = load(quant_type=quant_type, double_quant=double_quant)
    linears = decoder_linears(base)
    assert len(linears) == 4 * 7  # 4 layers x (q, k, v, o, gate, up, down)
    for name, layer in linears.items():
        assert isinstance(layer, bnb.nn.Linear4bit), name
        assert layer.weight.dtype == torch.uint8, name
        # two 4-bit values per byte
        assert layer.weight.numel() * 2 == layer.in_features * layer.out_features
        state = layer.weight.quant_state
        assert state.quant_type == quant_type
        assert state.nested is double_quant
        assert state.blocksize == 64
        assert layer.support_avx512bf16_for_cpu is False


def test_unquantized_layers_stay_in_compute_dtype():
    base = load(compute_dtype="bfloat16")
    assert base.get_input_embeddings().weight.dtype == torch.bfloat16
    assert base.get_output_embeddings().weight.dtype == torch.bfloat16
    assert not isinstance(base.get_output_embeddings(), bnb.nn.Linear4bit)
    assert base.model.norm.weight.dtype == torch.bfloat16


def test_quant_storage_is_the_container_dtype():
    base = load(quant_storage="bfloat16")
    layer = base.model.layers[0].self_attn.q_proj
    assert layer.weight.dtype == torch.bfloat16
    assert layer.weight.numel() * 4 == layer.in_features * layer.out_features


def _lora_grads(peft_model, batch):
    peft_model.zero_grad()
    peft_model.train()
    peft_model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def test_lora_gradients_do_not_change_after_an_eval_pass():
    """Regression: on AVX512-BF16 CPUs an eval forward without grad used to repack the 4-bit weights."""
    recipe = Recipe.from_dict({"lora": {"dropout": 0.0}})
    base = model.load_base_model(recipe.model, recipe.quant)
    checkpointing.enable_checkpointing(base, recipe.memory)
    peft_model = adapters.attach_lora(base, recipe.lora)
    # Non-zero B so both A and B receive gradients on the first backward.
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ids = torch.randint(5, 600, (2, 24))
    batch = {"input_ids": ids, "labels": ids}
    before = _lora_grads(peft_model, batch)
    peft_model.eval()
    with torch.no_grad():
        peft_model(input_ids=ids)
    after = _lora_grads(peft_model, batch)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
