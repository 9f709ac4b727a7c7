"""The experts' layout read from transformers' declaration, not a list of model types, and checked by the
model's own numbers at every load (model/moe_experts.py, model/experts_selfcheck.py): each layout transformers
declares (no gate, a norm after each expert, transposed stacks, biases, interleaved gate/up) packs in 4 bits
and computes what the float64 reference computes; a layout that lies is refused in one line naming the layer
and the attribute; experts transformers does not declare (Llama 4's) are refused naming what is missing."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers.models.aria.configuration_aria import AriaTextConfig
from transformers.models.aria.modeling_aria import AriaExperts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.memory.shapes import model_shape
from qlora_kit.model import builtin, experts_selfcheck, moe_experts
from qlora_kit.model import loading as model

# one experts module of each declared layout, 4 experts, hidden 64 (transformers' own classes and configs)
LAYOUTS = {
    # has_gate=False: up_proj alone and the activation
    "nemotron_h": lambda: NemotronHExperts(
        transformers.NemotronHConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4)
    ),
    # has_post_expert_norm=True: an RMSNorm after each expert, before its routing weight
    "muse_spark": lambda: MuseSparkExperts(
        MuseSparkTextConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            moe_hidden_size=64,
            moe_intermediate_size=32,
            num_local_experts=4,
        )
    ),
    # is_transposed=True: (experts, in, out) stacks
    "aria": lambda: AriaExperts(AriaTextConfig(hidden_size=64, intermediate_size=32, moe_num_experts=4)),
    # transposed, biased, gate/up interleaved (its own _apply_gate, a clamped SwiGLU)
    "gpt_oss": lambda: GptOssExperts(
        transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
    ),
    "qwen3_moe": lambda: Qwen3MoeExperts(
        transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4)
    ),
}


def packed_experts(layout: str, compute_dtype: str = "float32"):
    """The layout's experts with random weights, and a copy packed in 4 bits with the recipe's defaults."""
    torch.manual_seed(0)
    experts = LAYOUTS[layout]().to(getattr(torch, compute_dtype))  # loaded in the compute dtype
    with torch.no_grad():
        for name, param in experts.named_parameters():
            param.normal_(0.0, 0.1) if "norm" not in name else param.uniform_(0.5, 1.5)
    quant = Recipe.from_dict({"quant": {"compute_dtype": compute_dtype}}).quant
    packed = copy.deepcopy(experts)
    moe_experts.pack_experts(packed, getattr(torch, compute_dtype), quant.quant_type, quant.double_quant)
    return experts, packed


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_declared_layout_packs_and_computes_the_float64_reference(layout, compute_dtype):
    """The packed experts' routed loop against transformers' eager forward in float64 on the same dequantized
    weights (an independent reference: the model authors' loop, another dtype), within the tolerance of the
    compute dtype; and the load-time self-check passes. Red when experts_forward ignores has_gate (a
    gate_up_proj that is not there) or applies the post-expert norm nowhere (0.3 of the largest output)."""
    dtype = getattr(torch, compute_dtype)
    _, packed = packed_experts(layout, compute_dtype)
    experts_selfcheck.check_experts("layer", packed)  # no refusal
    reference = experts_selfcheck.dequantized_copy(packed).to(torch.float64)
    hidden = moe_experts.logical_shape(packed, "down_proj")[1]
    states, picks, weights = experts_selfcheck.random_batch(packed, hidden, dtype, seed=1)
    with torch.no_grad():
        expected = experts_selfcheck.eager_forward(packed)(
            reference, states.double(), picks, weights.double()
        )
        ours = moe_experts.experts_forward(packed, states, picks, weights)
    assert ours.dtype == dtype
    assert experts_selfcheck.difference(ours, expected) <= experts_selfcheck.tolerance(dtype)


@pytest.mark.parametrize(
    ("layout", "attribute"),
    [
        ("qwen3_moe", "is_transposed"),  # Qwen3-MoE's (experts, out, in) read as (experts, in, out)
        ("aria", "is_transposed"),  # and the other way
        ("muse_spark", "has_post_expert_norm"),  # a norm after each expert left out
        ("nemotron_h", "has_gate"),  # an up projection read as gate and up
    ],
)
def test_a_declared_layout_that_lies_is_refused_naming_the_layer_and_the_attribute(layout, attribute):
    """The module's declaration flipped before packing: the load-time check compares with the model's own eager
    forward (which hard-codes the real layout) and refuses in one line naming the layer and the attribute.
    Red when the check is skipped (the lie trains) or compares the routed loop with itself."""
    torch.manual_seed(0)
    experts = LAYOUTS[layout]()
    with torch.no_grad():
        for name, param in experts.named_parameters():
            param.normal_(0.0, 0.1) if "norm" not in name else param.uniform_(0.5, 1.5)
    declared = getattr(experts, attribute)
    setattr(experts, attribute, not declared)
    quant = Recipe.from_dict({"quant": {"compute_dtype": "float32"}}).quant
    # the stacks it finds (has_gate is read in the forward)
    moe_experts.pack_experts(experts, torch.float32, quant.quant_type, quant.double_quant)
    with pytest.raises(RecipeError) as refused:
        experts_selfcheck.check_experts("model.layers.3.mlp.experts", experts)
    line = str(refused.value)
    assert line.startswith("model.path: model.layers.3.mlp.experts's 4-bit experts do not compute"), line
    assert f"its declared {attribute}={not declared} is wrong" in line and "\n" not in line, line


def save_llama4(folder):
    config = transformers.Llama4TextConfig(
        vocab_size=640,
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=1,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    builtin.build_tokenizer().save_pretrained(folder)


def test_experts_transformers_does_not_declare_are_refused_at_load_and_plan_naming_what_is_missing(tmp_path):
    """Llama 4's experts are not decorated (their forward takes tokens already grouped by expert): refused in
    one line naming the module and what is missing, at load and in the planner alike, never loaded with the
    experts silently in 16 bits."""
    save_llama4(tmp_path)
    recipe = Recipe.from_dict({"model": {"path": str(tmp_path)}})
    expected = (
        r"^model\.path: llama4_text is a mixture of experts whose experts cannot be loaded in 4 bits: "
        r"model\.layers\.0\.feed_forward\.experts \(Llama4TextExperts\) is not declared with transformers' "
        r"use_experts_implementation"
    )
    with pytest.raises(RecipeError, match=expected):
        model.load_base_model(recipe.model, recipe.quant)
    with pytest.raises(RecipeError, match=expected):
        model_shape(recipe)


def wrapped_with_lora(layout: str, compute_dtype: str):
    """The layout's packed experts inside a module, LoRA (r 4) on each of its stacks as qlora_kit puts it."""
    _, packed = packed_experts(layout, compute_dtype)
    holder = torch.nn.Module()
    holder.experts = packed
    config = LoraConfig(
        r=4,
        target_modules=[],
        target_parameters=[f"experts.{name}" for name in moe_experts.stacks_of(packed)],
    )
    config._register_custom_module({type(packed): moe_experts.LoraExperts})
    return get_peft_model(holder, config)


@pytest.mark.slow  # ten peft wraps and checks, ~1.5 s each
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_on_every_declared_layout_computes_what_peft_param_wrapper_computes(layout, compute_dtype):
    """The self-check's LoRA half passes on every declared layout (transposed stacks included) in each
    compute dtype: our low-rank forward against the eager forward on W + peft's get_delta_weight, B drawn
    non-zero. Red when each expert's update is left unscaled in expert_matmul (0.2-0.3 of the largest
    output)."""
    experts_selfcheck.check_lora(wrapped_with_lora(layout, compute_dtype))  # no refusal


@pytest.mark.slow  # a peft wrap and a check, ~1.5 s
def test_lora_factors_read_wrong_are_refused_naming_the_experts(monkeypatch):
    """A LoRA forward that takes B's expert axis for its rank axis (a reshape of the same numbers) is refused
    in one line naming the experts module, before it trains. Red when check_lora returns without comparing."""
    model = wrapped_with_lora("qwen3_moe", "float32")
    right = moe_experts.LoraExperts.low_rank_factors

    def expert_axis_misread(self, adapter):
        a, b, scaling = right(self, adapter)
        return a, b.reshape(b.shape[0], self.num_experts, -1).transpose(1, 2), scaling

    monkeypatch.setattr(moe_experts.LoraExperts, "low_rank_factors", expert_axis_misread)
    with pytest.raises(RecipeError) as refused:
        experts_selfcheck.check_lora(model)
    line = str(refused.value)
    assert line.startswith(
        "lora.experts: LoRA on base_model.model.experts's 4-bit experts does not compute"
    ), line
    assert "\n" not in line
