"""The planner: weight figures, activation bytes against what autograd really saves, and auto."""

import bitsandbytes as bnb
import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.memory import checkpointing
from qlora_kit.memory.accounting import OUTSIDE, measure_saved_bytes
from qlora_kit.memory.auto import choose_layers, choose_policy
from qlora_kit.memory.planner import GIB, activation_bytes, plan
from qlora_kit.memory.shapes import model_shape, weight_bytes
from qlora_kit.model import adapters
from qlora_kit.model import loading as model
from qlora_kit.registries.optimizers import OPTIMIZERS

POLICIES = [("none", 2), ("every_n", 2), ("every_n", 3), ("full", 1)]
SHAPES = [(1, 64), (2, 32), (4, 96)]


def recipe_for(policy, every_n, arch="tiny-llama", chunked=False, dropout=0.05):
    return Recipe.from_dict(
        {
            "model": {"path": f"builtin:{arch}"},
            "memory": {
                "checkpointing": policy,
                "every_n": every_n,
                "chunked_loss": chunked,
                "loss_chunk_tokens": 40,
            },
            "lora": {"dropout": dropout},
            "data": {"packing": False},
        }
    )


@pytest.fixture(scope="module")
def measured():
    """Saved bytes per (arch, policy, every_n, chunked, batch, seq), one model per configuration."""
    results = {}
    for arch in ("tiny-llama", "tiny-qwen2"):
        for policy, every_n in POLICIES:
            for chunked in (False, True):
                recipe = recipe_for(policy, every_n, arch, chunked)
                base = model.load_base_model(recipe.model, recipe.quant)
                checkpointing.enable_checkpointing(base, recipe.memory)
                peft_model = adapters.attach_lora(base, recipe.lora)
                for batch, seq in SHAPES:
                    ids = torch.randint(5, 600, (batch, seq), generator=torch.Generator().manual_seed(batch))
                    saved = measure_saved_bytes(
                        peft_model, {"input_ids": ids, "labels": ids}, 40 if chunked else None
                    )
                    results[arch, policy, every_n, chunked, batch, seq] = (recipe, saved)
    return results


@pytest.mark.slow  # runs forward and backward on 16 models; test_planner_oracle.py is the fast tier's check
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize(("policy", "every_n"), POLICIES)
@pytest.mark.parametrize("chunked", [False, True], ids=["full-logits", "chunked-loss"])
@pytest.mark.parametrize(("batch", "seq"), SHAPES)
def test_predicted_activations_match_saved_bytes_within_5_percent(
    measured, arch, policy, every_n, chunked, batch, seq
):
    recipe, saved = measured[arch, policy, every_n, chunked, batch, seq]
    predicted = activation_bytes(model_shape(recipe), recipe, policy, every_n, batch, seq, device="cpu")
    assert predicted.source == "traced"
    assert predicted.total == pytest.approx(saved.total, rel=0.05)
    assert predicted.head == pytest.approx(saved.per_layer[OUTSIDE], rel=0.05)
    for index, nbytes in enumerate(predicted.per_layer):
        assert nbytes == pytest.approx(saved.per_layer.get(f"layer {index}", 0), rel=0.05), f"layer {index}"


def test_weight_figures_match_the_loaded_model_and_published_counts():
    recipe = Recipe()
    base = model.load_base_model(recipe.model, recipe.quant)
    weights = weight_bytes(model_shape(recipe), recipe)
    quantized = unquantized = 0
    for module in base.modules():
        for param in module.parameters(recurse=False):
            if isinstance(module, bnb.nn.Linear4bit) and param is module.weight:
                state = param.quant_state  # packed weights + 8-bit absmax + second-level absmax and code
                quantized += param.nbytes + state.absmax.nbytes + state.state2.absmax.nbytes
                quantized += state.state2.code.nbytes + state.offset.nbytes
            else:
                unquantized += param.nbytes
    assert weights.unquantized == unquantized
    assert weights.quantized == pytest.approx(quantized, rel=0.01)
    # The QLoRA paper: double quantization costs 8/64 + 32/(64*256) = 0.127 bits per parameter on top of 4.
    llama3 = Recipe.from_dict({"model": {"path": "meta-llama/Meta-Llama-3-8B"}})
    shape = model_shape(llama3)
    bits = 8 * weight_bytes(shape, llama3).quantized / shape.quantized_values
    assert bits == pytest.approx(4 + 0.127, abs=0.002)
    # Published parameter counts: Llama-3-8B 8.03 B, Mistral-7B 7.25 B, Qwen2.5-7B 7.61 B.
    for hub_id, billions in [
        ("meta-llama/Meta-Llama-3-8B", 8.03),
        ("mistralai/Mistral-7B-v0.3", 7.25),
        ("Qwen/Qwen2.5-7B", 7.61),
    ]:
        shape = model_shape(Recipe.from_dict({"model": {"path": hub_id}}))
        assert (shape.quantized_values + shape.unquantized_values) / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.parametrize("arch", ["tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_expert_figures_match_the_loaded_mixture_by_hand(arch, double_quant):
    """Every expert held in 4 bits: the planner's expert bytes against the packed tensors counted here
    (values, per-expert statistics, code tables), and its LoRA count against peft's trainable parameters."""
    recipe = Recipe.from_dict(
        {
            "model": {"path": f"builtin:{arch}"},
            "lora": {"dropout": 0.0},
            "quant": {"double_quant": double_quant},
        }
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    packed = 0
    for module in base.modules():
        if hasattr(module, "gate_up_proj_4bit"):
            for name in ("gate_up_proj", "down_proj"):
                assert getattr(module, name).dtype == torch.uint8
                packed += getattr(module, name).nbytes
                packed += sum(b.nbytes for b in getattr(module, f"{name}_4bit").buffers())
    shape = model_shape(recipe)
    weights = weight_bytes(shape, recipe)
    assert packed and weights.experts == packed
    assert 8 * weights.experts / shape.expert_values < 4.6  # not 16 bits: what a plain bnb load keeps
    peft_model = adapters.attach_lora(base, recipe.lora)
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    assert weights.lora_values == sum(p.numel() for p in trained)
    assert shape.active_expert_values * 4 == shape.expert_values  # 2 of 8 experts per token
    if not double_quant:
        return  # the optimizer's state below does not depend on how the base is quantized
    # The optimizer's state, as bitsandbytes allocates it at the first step (8-bit for the experts'
    # stacked LoRA, 32-bit for tensors under its min_8bit_size): the plan counted the linears' alone.
    optimizer = OPTIMIZERS[recipe.optimizer.name].load_class()(trained, lr=1e-3)
    for param in trained:
        param.grad = torch.ones_like(param)
    optimizer.step()
    state = sum(t.nbytes for kept in optimizer.state.values() for t in kept.values() if torch.is_tensor(t))
    assert plan(recipe, batch=1, seq=8, device="cpu").optimizer_state == state


@pytest.mark.slow  # traces and measures two models
@pytest.mark.parametrize("experts", [True, False], ids=["lora-on-experts", "experts-frozen"])
def test_a_mixture_is_traced_through_the_loop_its_4bit_experts_run(experts):
    """Fake tensors hold no routing: the planner traces the 4-bit experts' loop with the picks spread evenly
    (what it keeps grows with an expert's tokens, so any routing keeps the same), with the experts' LoRA or
    without it, and matches what a real forward on the loaded model saves for backward (transformers' own
    experts code, traced instead, keeps 6% less than the loop the run uses)."""
    recipe = Recipe.from_dict(
        {
            "model": {"path": "builtin:tiny-qwen3-moe"},
            "lora": {"dropout": 0.0, "experts": experts},
            "memory": {"checkpointing": "none", "chunked_loss": False},
            "data": {"packing": False},
        }
    )
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    ids = torch.randint(5, 600, (1, 64), generator=torch.Generator().manual_seed(2))
    saved = measure_saved_bytes(peft_model, {"input_ids": ids, "labels": ids}, None)
    predicted = activation_bytes(model_shape(recipe), recipe, "none", 1, 1, 64, device="cpu")
    assert predicted.source == "traced"
    assert predicted.total == pytest.approx(saved.total, rel=0.01)


def test_lora_parameter_count_matches_peft():
    recipe = Recipe.from_dict({"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}})
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    expected = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert weight_bytes(model_shape(recipe), recipe).lora_values == expected


def test_auto_picks_the_least_recompute_that_fits():
    """auto mixes none / selective / full per layer: within the budget, never costlier (in the planner's
    recompute cost) than any uniform or every_n policy that fits the same budget."""
    recipe = Recipe.from_dict({"model": {"path": "meta-llama/Meta-Llama-3-8B"}, "lora": {"rank": 64}})
    the_plan = plan(recipe, batch=4, seq=1024)
    peaks = {p.policy: p.peak / GIB for p in the_plan.policies}
    assert peaks["none"] > peaks["every_n=2"] > peaks["selective"] > peaks["full"]
    assert choose_policy(recipe, peaks["none"] + 1, the_plan)[:2] == ("none", 2)
    mixed = 0
    for budget in [
        peaks["every_n=2"] + 0.01,
        (peaks["every_n=2"] + peaks["selective"]) / 2,
        peaks["selective"],
    ]:
        row, why = choose_layers(recipe, budget, the_plan)
        assert row.peak <= budget * GIB and len(row.layers) == 32 and "recomputed" in why
        fitting = [p for p in the_plan.policies if p.peak <= budget * GIB]
        assert row.recompute_cost <= min(p.recompute_cost for p in fitting) + 1e-9
        mixed += row.policy == "per_layer"
    assert mixed, "some budget between the uniform policies is met by a mix"
    policy, _, why = choose_policy(recipe, 1.0, the_plan)
    assert policy == "full" and "nothing fits" in why


@pytest.mark.slow  # traces a plan: the full suite runs it
def test_chunked_loss_shrinks_the_head_term():
    full = plan(recipe_for("full", 1, "tiny-llama", chunked=False), batch=4, seq=256)
    chunked = plan(recipe_for("full", 1, "tiny-llama", chunked=True), batch=4, seq=256)
    assert chunked.chosen(recipe_for("full", 1, chunked=True)).activations < full.policies[-1].activations


@pytest.mark.slow  # traces a plan: the full suite runs it
def test_fsdp_plans_per_gpu_with_weights_and_optimizer_state_sharded():
    fsdp = Recipe.from_yaml(
        "recipes/llama3-8b-alpaca-fsdp-2x24gb.yaml", overrides={"model.path": "huggyllama/llama-65b"}
    )
    one, two, four = (plan(fsdp, processes=n) for n in (1, 2, 4))
    sharded = one.weights.quantized + one.weights.lora + one.optimizer_state
    # doubling the GPUs halves the sharded part; the root and the gathered layers stay whole
    assert two.static - four.static == sharded // 2 - sharded // 4
    assert one.static - two.static > 0.4 * sharded
    assert two.static > one.weights.unquantized + 2 * two.layer_weights
    assert four.lora_grads < two.lora_grads < one.lora_grads
    # every GPU first loads the whole 4-bit model, so no peak is below that
    assert all(p.peak >= four.load_peak for p in four.policies)
    assert four.load_peak == one.weights.quantized + one.weights.unquantized
    # without FSDP every process holds a whole copy (DDP): more processes change nothing per GPU
    ddp = fsdp.with_overrides({"train.fsdp": False, "quant.quant_storage": "uint8"})
    assert [p.peak for p in plan(ddp, processes=4).policies] == [p.peak for p in plan(ddp).policies]
