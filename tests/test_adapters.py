"""LoRA attachment: what trains, and how recipe fields reach peft."""

import bitsandbytes as bnb

from qlora_kit import Recipe
from qlora_kit.model import adapters
from qlora_kit.model import loading as model


def attach(**lora):
    recipe = Recipe.from_dict({"lora": lora})
    base = model.load_base_model(recipe.model, recipe.quant)
    return adapters.attach_lora(base, recipe.lora)


def test_only_lora_matrices_require_grad():
    peft_model = attach(rank=8)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every 4-bit linear got an adapter, and the output head did not
    wrapped = [
        m for m in peft_model.modules() if isinstance(getattr(m, "base_layer", None), bnb.nn.Linear4bit)
    ]
    assert len(wrapped) == 28
    assert not hasattr(peft_model.base_model.model.lm_head, "lora_A")
    lora_a = peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    assert lora_a.weight.shape == (8, 128)


def test_target_list_and_options_reach_peft():
    peft_model = attach(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], rslora=True, bias="lora_only")
    config = peft_model.peft_config["default"]
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert config.use_rslora and config.bias == "lora_only"
    adapted = {n.split(".")[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 8 / 4**0.5  # rsLoRA: alpha / sqrt(r)


def test_dora_adds_a_magnitude_vector():
    peft_model = attach(rank=4, dora=True, target_modules=["q_proj"])
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names)


def test_trainable_count_counts_4bit_values_not_bytes():
    peft_model = attach(rank=8)
    trainable, total = adapters.trainable_parameter_count(peft_model)
    base_values = sum(
        m.in_features * m.out_features for m in peft_model.modules() if isinstance(m, bnb.nn.Linear4bit)
    )
    lora_values = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == lora_values
    assert total > base_values + lora_values  # plus embeddings, norms and head
