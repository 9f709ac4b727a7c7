"""Mixtures of experts: the fused 3-D experts really in 4 bits, LoRA on them in low-rank form in peft's own
format, and the families qlora_kit cannot pack refused at load (model/moe_experts.py)."""

from __future__ import annotations

import json
from pathlib import Path

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from qlora_kit import Recipe, train
from qlora_kit.errors import RecipeError
from qlora_kit.memory.shapes import model_shape
from qlora_kit.model import adapters, builtin, moe_experts
from qlora_kit.model import loading as model

from .conftest import quick_recipe

MOE_BUILTINS = sorted(builtin.TINY_MOE_ARCHITECTURES)  # gpt-oss, Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE


def moe_recipe(name: str = "tiny-qwen3-moe", **values) -> Recipe:
    return Recipe.from_dict({"model": {"path": f"builtin:{name}"}, **values})  # lora's defaults hold


def dequantized_16bit(four_bit, recipe: Recipe):
    """The recipe's model in 16 bits whose every weight is the 4-bit model's, dequantized: the base a
    merged or plain-peft reload compares against."""
    path = model.resolve_model_path(recipe.model)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, recipe.quant.compute_dtype), device_map={"": "cpu"}
    )
    modules = dict(base.named_modules())
    for name, module in four_bit.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = module.weight
            modules[name].weight.data.copy_(bnbf.dequantize_4bit(weight.data, weight.quant_state))
        for param in moe_experts.stacks_of(module):
            stats = getattr(module, f"{param}_4bit", None)
            if stats is not None:
                packed = getattr(module, param)
                expert_weights = [
                    bnbf.dequantize_4bit(packed[e], stats.state(e)) for e in range(stats.shape[0])
                ]
                stack = torch.stack(expert_weights)
                getattr(modules[name], param).data.copy_(stack.transpose(1, 2) if stats.transposed else stack)
    reference = dict(base.named_parameters())
    for name, param in four_bit.named_parameters():  # what stayed in 16 bits (biases, norms, sinks) as is
        if param.is_floating_point() and name in reference and reference[name].shape == param.shape:
            reference[name].data.copy_(param.data)
    return base.eval()


def batch(model_, rows: int = 2, length: int = 24):
    ids = torch.randint(5, 600, (rows, length), generator=torch.Generator().manual_seed(3))
    return ids.to(model_.device)


@pytest.mark.parametrize("name", MOE_BUILTINS)
def test_experts_are_loaded_in_4_bits(name):
    """From the loaded tensors: every fused expert weight is packed uint8 (two values a byte), none is left
    in 16 bits, and the experts take at most 0.30x their bf16 bytes; the router stays in bf16."""
    recipe = moe_recipe(name)
    base = model.load_base_model(recipe.model, recipe.quant)
    experts = moe_experts.fused_experts(base)
    text = base.config.get_text_config()  # DeepSeek's and GLM's first layer is dense
    assert len(experts) == text.num_hidden_layers - getattr(text, "first_k_dense_replace", 0)
    for _, module in experts:
        for param in moe_experts.stacks_of(module):
            packed = getattr(module, param)
            e, out_features, in_features = moe_experts.logical_shape(module, param)
            assert packed.dtype == torch.uint8 and packed.shape == (e, out_features * in_features // 2)
    # gpt-oss's expert biases, (experts x out) each, stay in 16 bits
    biases = [p for n, p in base.named_parameters() if ".experts." in n and n.endswith("_bias")]
    floating = [n for n, p in base.named_parameters() if ".experts." in n and p.is_floating_point()]
    assert len(floating) == len(biases)
    sizes = moe_experts.bytes_by_kind(base)
    bf16 = sum(
        2 * e * o * i
        for _, m in experts
        for e, o, i in (moe_experts.logical_shape(m, p) for p in moe_experts.stacks_of(m))
    ) + sum(2 * p.numel() for p in biases)
    assert sizes["experts"] <= 0.30 * bf16
    routers = [p for n, p in base.named_parameters() if moe_experts.kind_of(n) == "router"]
    # DeepSeek's and GLM's routers are kept in float32 by their own code (_keep_in_fp32_modules)
    assert routers and all(p.dtype in (torch.bfloat16, torch.float32) for p in routers)


def test_4bit_experts_compute_what_transformers_computes_with_their_dequantized_weights():
    """The routed loop over packed experts gives exactly the logits of transformers' own experts
    implementation on the same weights dequantized (nothing is routed to the wrong expert or slot)."""
    recipe = moe_recipe()
    four_bit = model.load_base_model(recipe.model, recipe.quant).eval()
    reference = dequantized_16bit(four_bit, recipe)
    ids = batch(four_bit)
    with torch.no_grad():
        ours, theirs = four_bit(ids).logits, reference(ids).logits
    assert torch.equal(ours, theirs)


@pytest.mark.slow  # two models loaded
# gpt-oss: stored transposed and biased; Qwen2-MoE: a shared expert beside the routed ones
@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-qwen2-moe"])
def test_lora_on_experts_reloads_with_plain_peft_on_the_16bit_model(tmp_path, family):
    """The adapter trained on packed experts is peft's own target_parameters format: plain
    PeftModel.from_pretrained on the 16-bit model (peft's ParamWrapper) gives the same logits; the router
    carries no LoRA. Qwen2-MoE's shared expert and its gate carry LoRA as the linear layers they are, saved
    beside the routed experts' and read back by plain peft. gpt-oss in float32: in bfloat16 the comparison
    failed on some runs (max difference 0.44 of the logits' scale), most likely its router's top-2 of 8
    flipping at near-ties between the low-rank and the merged update."""
    recipe = moe_recipe(
        family, **({"quant": {"compute_dtype": "float32"}} if family == "tiny-gpt-oss" else {})
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    reference = dequantized_16bit(base, recipe)  # before peft wraps the base's layers in place
    peft_model = adapters.attach_lora(base, recipe.lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    adapters.save_adapter(peft_model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    counts = moe_experts.trainable_by_kind(peft_model)
    assert counts["experts"] > 0 and counts["attention"] > 0 and counts["router"] == 0
    saved = load_file(tmp_path / "adapter_model.safetensors")
    shared = {key.split(".mlp.")[1].split(".lora_")[0] for key in saved if ".shared_expert" in key}
    if family == "tiny-qwen2-moe":
        assert shared == {f"shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")} | {
            "shared_expert_gate"
        }
        assert counts["shared experts"] > 0
    else:
        assert shared == set()

    plain = PeftModel.from_pretrained(reference, str(tmp_path)).eval()
    assert type(plain.base_model.model.model.layers[0].mlp.experts).__module__ == "peft.tuners.lora.layer"
    ids = batch(base)
    with torch.no_grad():
        ours, theirs = peft_model.eval()(ids).logits.float(), plain(ids).logits.float()
        with plain.disable_adapter():
            without = plain(ids).logits.float()
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < 0.1 * scale  # the dense models' tolerance (test_after_training)
    assert (theirs - without).abs().max() > 0.3 * scale  # the LoRA moves the logits more than that
    if family == "tiny-qwen2-moe":  # the shared expert's LoRA alone moves them too: it was read back
        with torch.no_grad():
            for key, param in plain.named_parameters():
                if "lora_B" in key and ".shared_expert" not in key:
                    param.zero_()
            only_shared = plain(ids).logits.float()
        assert (only_shared - without).abs().max() > 0.05 * scale


class LargestTensor(TorchDispatchMode):
    """The most elements any operation outputs (a materialized B @ A for every expert would show)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.slow  # every operation of a forward and backward watched
def test_lora_on_experts_never_materializes_the_update_of_the_stack():
    """Forward and backward with LoRA on the experts create no floating tensor as large as an expert
    stack: the update goes through the rank-r bottleneck, per expert, for its tokens only (peft's own
    ParamWrapper adds B @ A for all experts at every forward). 16-bit experts, where peft's wrapper runs."""
    recipe = moe_recipe(quant={"bits": 16})
    base = model.load_base_model(recipe.model, recipe.quant)
    peft_model = adapters.attach_lora(base, recipe.lora).train()
    stack = min(
        e * o * i
        for _, m in moe_experts.fused_experts(base)
        for e, o, i in (moe_experts.logical_shape(m, p) for p in moe_experts.stacks_of(m))
    )
    ids = batch(base)
    with LargestTensor() as seen:
        peft_model(input_ids=ids, labels=ids).loss.backward()
    assert 0 < seen.largest < stack
    grads = [p.grad for n, p in peft_model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_experts_can_be_left_out():
    recipe = moe_recipe(lora={"dropout": 0.05, "experts": False})
    base = model.load_base_model(recipe.model, recipe.quant)
    counts = moe_experts.trainable_by_kind(adapters.attach_lora(base, recipe.lora))
    assert counts["experts"] == 0 and counts["router"] == 0 and counts["attention"] > 0


def test_the_router_is_frozen_unless_asked_and_then_trains_and_saves_whole(tmp_path):
    """lora.router: each layer's router trains whole (its gradient flows, its copy is saved in the adapter
    as peft's modules_to_save); by default it carries nothing trainable."""
    default = moe_recipe()
    frozen = adapters.attach_lora(model.load_base_model(default.model, default.quant), default.lora)
    assert moe_experts.trainable_by_kind(frozen)["router"] == 0
    recipe = moe_recipe(lora={"dropout": 0.0, "router": True})
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    routers = [
        p for n, p in peft_model.named_parameters() if moe_experts.kind_of(n) == "router" and p.requires_grad
    ]
    assert len(routers) == 4 and moe_experts.trainable_by_kind(peft_model)["router"] == 4 * 8 * 128
    ids = batch(peft_model)
    peft_model.train()(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)
    adapters.save_adapter(peft_model, tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sum(".mlp.gate." in key for key in saved) == 4


def save_phimoe(folder) -> None:
    """A tiny PhiMoE, a mixture the families table does not list, saved as transformers saves it."""
    config = transformers.PhimoeConfig(
        vocab_size=640,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    builtin.build_tokenizer().save_pretrained(folder)


def test_a_mixture_the_table_does_not_list_loads_in_4_bits_from_its_declared_layout(tmp_path):
    """A mixture the families table does not list (PhiMoE, whose router is a linear layer of its own): its
    experts' layout is read from transformers' declaration on the module, so they pack in 4 bits, the planner
    plans them as 4-bit stacks from the config's common keys, and all-linear leaves its router (a linear
    subclass returning logits, weights and picks) to its own forward. Red with the old model_type gate."""
    save_phimoe(tmp_path)
    recipe = Recipe.from_dict({"model": {"path": str(tmp_path)}, "lora": {"dropout": 0}})
    base = model.load_base_model(recipe.model, recipe.quant)
    packed = [e for _, e in moe_experts.fused_experts(base) if hasattr(e, "gate_up_proj_4bit")]
    assert packed and all(e.gate_up_proj.dtype == torch.uint8 for e in packed)
    shape = model_shape(recipe)
    assert shape.expert_stacks and all(s.active == 2 for s in shape.expert_stacks)
    peft_model = adapters.attach_lora(base, recipe.lora)
    trained = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert any(".experts." in name for name in trained) and not any(".router." in name for name in trained)


def test_a_mixture_the_table_does_not_list_takes_lora_in_16_bits_and_refuses_its_router_in_one_line(tmp_path):
    """quant.bits 16 loads a mixture the families table does not list (PhiMoE): LoRA reaches its experts
    where they were found (red on an AttributeError for the table's missing entry), and lora.router, whose
    router the table would name, is one line."""
    save_phimoe(tmp_path)
    recipe = Recipe.from_dict(
        {"model": {"path": str(tmp_path)}, "quant": {"bits": 16}, "lora": {"dropout": 0}}
    )
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    trained = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert any(".experts." in name for name in trained) and any(".self_attn." in name for name in trained)
    router = recipe.with_overrides({"lora.router": True})
    with pytest.raises(
        RecipeError, match=r"^lora\.router: phimoe's router is not in qlora_kit's families table$"
    ):
        adapters.attach_lora(model.load_base_model(router.model, router.quant), router.lora)


@pytest.mark.slow
def test_moe_trains_through_the_trainer_under_bf16_autocast(tmp_path):
    """The MoE demo's path, short: the Trainer under accelerate's bf16 autocast (a GPU's default), experts in
    4 bits, every layer checkpointed; the loss falls and the experts' LoRA matrices move. The routing figures
    in metrics.jsonl count each training forward's tokens once (top-2: two picks a position), not the
    forward passes checkpointing recomputes in backward, and the auxiliary loss is logged when the config
    computes it."""
    from qlora_kit.training.pipeline import build

    recipe = quick_recipe(
        tmp_path / "out",
        **{
            "model.path": "builtin:tiny-qwen3-moe",
            "train.max_steps": 6,
            "train.logging_steps": 2,
            "train.mixed_precision": "bf16",
            "memory.checkpointing": "full",
        },
    )
    setup = build(recipe)
    setup.model.get_base_model().config.output_router_logits = True  # the aux loss, as a config can ask
    positions = []

    def count(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            positions.append(kwargs["input_ids"].numel())

    setup.model.register_forward_pre_hook(count, with_kwargs=True)
    setup.trainer.train()
    rows = [json.loads(line) for line in (setup.run.output_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "loss" in row]
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.5
    model_ = setup.model
    moved = [p for n, p in model_.named_parameters() if ".experts." in n and "lora_B" in n]
    assert moved and all(p.abs().sum() > 0 for p in moved)
    moe_experts.check_no_16bit_experts(model_)
    loads = [row["tokens_per_expert"] for row in logged]
    assert len(loads) == 3 and all(len(load) == 4 and len(load[0]) == 8 for load in loads)
    for layer in range(4):
        assert sum(sum(load[layer]) for load in loads) == 2 * sum(positions)
    assert all(row["aux_loss"] > 0 and row["max_load"] >= 1.0 and "idle" in row for row in logged)


def test_the_chunked_head_adds_the_auxiliary_loss_as_transformers_does():
    """With the config's output_router_logits, transformers adds router_aux_loss_coef x the load-balancing
    loss to the loss; the chunked head (which runs the model without labels) adds the same."""
    from qlora_kit.memory.loss_head import chunked_lm_loss

    recipe = moe_recipe()
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    peft_model.get_base_model().config.output_router_logits = True
    ids = batch(peft_model)
    with torch.no_grad():
        expected = peft_model(input_ids=ids, labels=ids).loss
        without_aux = peft_model(input_ids=ids, labels=ids, output_router_logits=False).loss
        chunked = chunked_lm_loss(peft_model, {"input_ids": ids, "labels": ids}, chunk_tokens=16)
    assert expected > without_aux
    assert chunked == pytest.approx(float(expected), rel=1e-5)


def test_an_expert_without_tokens_for_many_steps_is_warned_of_once(caplog):
    """The routing figures of a window, and one warning naming the starved expert once it has had no token
    for IDLE_STEPS optimizer steps (not before, and not again)."""
    from types import SimpleNamespace

    from qlora_kit.training.watch.expert_load import IDLE_STEPS, ExpertLoad
    from qlora_kit.training.watch.metrics_log import MetricsLog

    recipe = moe_recipe()
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    metrics = MetricsLog(Path("/dev/null"))
    load = ExpertLoad(peft_model, metrics)
    assert len(load.routers) == 4 and load.experts == 8
    routed = torch.arange(8).repeat(4)
    routed[routed == 5] = 4  # expert 5 gets nothing, expert 4 twice its share
    warnings = []
    for step in range(10, 10 * (IDLE_STEPS // 10 + 2), 10):
        load.counts = [torch.bincount(routed, minlength=8)] * 4
        logs = {"loss": 1.0}
        with caplog.at_level("WARNING", logger="qlora_kit.training.pipeline"):
            load.on_log(None, SimpleNamespace(global_step=step), None, logs=logs)
        warnings.append(sum("without a token" in r.message for r in caplog.records))
        assert logs["experts/idle"] == 4 and logs["experts/max_load"] == 2.0
        assert metrics.attached["tokens_per_expert"][0][5] == 0
    first = IDLE_STEPS // 10 - 1  # the window that reached IDLE_STEPS steps without a token
    assert warnings[:first] == [0] * first and warnings[first:] == [1] * (len(warnings) - first)
    assert "layer 0 expert 5" in caplog.text


@pytest.mark.slow  # trains 3 steps and merges
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_a_mixture_saved_by_transformers_trains_merges_and_reloads_at_the_defaults(tmp_path, caplog, name):
    """Issue 58's user: a Qwen3-MoE saved with save_pretrained (16 experts, 4 per token), a recipe with
    no lora section (lora.dropout auto: none, as peft allows on the experts; lora.experts on): it trains,
    the adapter holds LoRA on the experts without dropout, and merge's drift check passes at its bounds,
    the merged folder read back by plain transformers. A Qwen2-MoE the same, with LoRA on its shared
    expert too, merged into its dense linear layers."""
    from transformers import AutoConfig, AutoTokenizer

    from qlora_kit.after.merge import merge_adapter

    source = model.resolve_model_path(moe_recipe(name).model)
    config = AutoConfig.from_pretrained(source)
    config.num_experts, config.num_experts_per_tok = 16, 4
    torch.manual_seed(0)
    saved = tmp_path / "qwen3-moe"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(saved)
    AutoTokenizer.from_pretrained(source).save_pretrained(saved)
    recipe = Recipe.from_dict(
        {
            "model": {"path": str(saved)},
            "quant": {"compute_dtype": "float32"},  # bf16 is emulated on these CPUs
            "data": {"max_seq_len": 64, "packing": True},
            "train": {
                "output_dir": str(tmp_path / "out"),
                "max_steps": 3,
                "micro_batch_size": 8,
                "sample_prompts": 0,
                "eval_steps": None,
            },
        }
    )
    with caplog.at_level("INFO", logger="qlora_kit"):
        out = train(recipe).output_dir
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["lora_dropout"] == 0.0 and "mlp.experts.gate_up_proj" in adapter["target_parameters"]
    assert "lora.dropout auto: 0 (LoRA on the experts takes no dropout)" in caplog.text  # said in the log
    result = merge_adapter(out, tmp_path / "merged")  # refused past its bounds: no force
    assert result.drift.positions > 0 and (tmp_path / "merged" / "config.json").is_file()
    if name == "tiny-qwen2-moe":  # the shared expert trained (LoRA moved) and merged into plain linears
        saved_lora = load_file(out / "adapter_model.safetensors")
        shared = [v for k, v in saved_lora.items() if ".shared_expert" in k and "lora_B" in k]
        assert len(shared) == 4 * config.num_hidden_layers and all(v.abs().sum() > 0 for v in shared)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        layer = merged.model.layers[0].mlp
        assert type(layer.shared_expert.up_proj) is torch.nn.Linear
        assert type(layer.shared_expert_gate) is torch.nn.Linear


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "minimax", "granitemoe", "dbrx"])
def test_a_mixture_at_4_bits_is_packed_on_the_host_before_it_goes_to_the_gpu(model_type):
    """Loaded by transformers' device map, a mixture's experts reach the GPU in 16 bits before they are
    packed (a 30B-A3B: ~57 GB against ~17 packed): on a GPU every 4-bit mixture, listed in the families
    table or not, loads on the host first; a dense model, a 16-bit load and a CPU-only run do not."""
    config = transformers.AutoConfig.for_model(model_type)
    four_bit, sixteen_bit = 4, 16
    assert model.packs_on_host_first(config, four_bit, cuda=True)
    assert not model.packs_on_host_first(config, sixteen_bit, cuda=True)
    assert not model.packs_on_host_first(config, four_bit, cuda=False)
    assert not model.packs_on_host_first(transformers.AutoConfig.for_model("llama"), four_bit, cuda=True)
