"""The traced planner: activation bytes from the model's own code on fake tensors, against the bytes a
real run (4-bit bitsandbytes layers, peft LoRA, the run's checkpointing) saves for backward, on every
builtin architecture, each checkpointing policy, packing on and off, without autocast and under the
Trainer's bf16 autocast (the GPU's path)."""

import contextlib

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.memory import checkpointing, fake_forward, tracing
from qlora_kit.memory.accounting import OUTSIDE, measure_saved_bytes
from qlora_kit.memory.planner import activation_bytes, plan
from qlora_kit.memory.shapes import model_shape
from qlora_kit.memory.tracing import trace_layers
from qlora_kit.model import adapters, builtin
from qlora_kit.model import loading as model

pytestmark = pytest.mark.slow  # traces every architecture and kernel: full suite only

ARCHITECTURES = sorted(builtin.TINY_ARCHITECTURES)  # nine families: Llama ... GPT-2, OLMo-2
POLICIES = [("none", 1), ("every_n", 2), ("full", 1)]
BATCH, SEQ = 2, 64


def recipe_for(arch: str, policy: str, every_n: int, packing: bool) -> Recipe:
    return Recipe.from_dict(
        {
            "model": {"path": f"builtin:{arch}"},
            "memory": {"checkpointing": policy, "every_n": every_n, "chunked_loss": False},
            "lora": {"dropout": 0.05},
            "data": {"packing": packing},
        }
    )


def batch_of(packing: bool) -> dict[str, torch.Tensor]:
    """As the collator builds it: packed rows carry restarting position ids and no attention mask;
    unpacked rows are padded to the longest (the planner plans a padded batch: its mask is kept)."""
    ids = torch.randint(5, 600, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if not packing:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[-1, -SEQ // 8 :] = 0  # the last row is shorter
        batch["attention_mask"] = mask
    if packing:
        positions = torch.arange(SEQ).repeat(BATCH, 1)
        positions[:, SEQ // 2 :] -= SEQ // 2
        batch["position_ids"] = positions
    return batch


@pytest.fixture(scope="module")
def measured():
    """Saved bytes per (arch, policy, packing, precision): one real 4-bit model per (arch, policy), set up
    in the order pipeline.build uses (load, checkpointing, LoRA)."""
    results = {}
    for arch in ARCHITECTURES:
        for policy, every_n in POLICIES:
            recipe = recipe_for(arch, policy, every_n, packing=False)
            base = model.load_base_model(recipe.model, recipe.quant)
            checkpointing.enable_checkpointing(base, recipe.memory)
            peft_model = adapters.attach_lora(base, recipe.lora)
            for packing in (False, True):
                for precision in ("no", "bf16"):
                    autocast = (
                        torch.autocast("cpu", dtype=torch.bfloat16)
                        if precision == "bf16"
                        else contextlib.nullcontext()
                    )
                    with autocast:
                        saved = measure_saved_bytes(peft_model, batch_of(packing))
                    results[arch, policy, packing, precision] = saved
    return results


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(("policy", "every_n"), POLICIES)
@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_traced_activations_match_saved_bytes_within_5_percent(
    measured, arch, policy, every_n, packing, precision
):
    saved = measured[arch, policy, packing, precision]
    recipe = recipe_for(arch, policy, every_n, packing)
    predicted = activation_bytes(
        model_shape(recipe), recipe, policy, every_n, BATCH, SEQ, "cpu", precision=precision
    )
    assert predicted.source == "traced"
    assert predicted.total == pytest.approx(saved.total, rel=0.05)
    assert predicted.head == pytest.approx(saved.per_layer[OUTSIDE], rel=0.05)
    for index, nbytes in enumerate(predicted.per_layer):
        assert nbytes == pytest.approx(saved.per_layer.get(f"layer {index}", 0), rel=0.05), f"layer {index}"


def test_layers_of_each_type_are_traced_once():
    """Gemma-2 alternates sliding and full attention: one layer of each is traced, then repeated."""
    recipe = recipe_for("tiny-gemma2", "none", 1, packing=True)
    shape = model_shape(recipe)
    traced = trace_layers(shape.config, recipe, BATCH, SEQ)
    assert set(traced.kept) == {"sliding_attention", "full_attention"}
    assert traced.layer_types == tuple(shape.config.layer_types)
    assert len(traced.per_layer([False] * shape.layers)) == shape.layers


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plan_runs_on_every_architecture_the_pipeline_trains(arch):
    the_plan = plan(recipe_for(arch, "none", 1, packing=True), device="cpu")
    assert the_plan.activation_source == "traced"
    peaks = [p.peak for p in the_plan.policies]
    assert peaks == sorted(peaks, reverse=True), "more recompute never costs more memory"


def test_a_65b_plan_traces_two_layers_not_eighty(monkeypatch):
    """Counted, not timed: every model the tracer runs has two decoder layers, and a plan of every
    policy runs it four times (without checkpointing, with full and with selective checkpointing, and
    every_n's spacing: layer 0 checkpointed, layer 1 keeping the tensors every layer shares)."""
    traced_layers = []
    real_trace = fake_forward.trace

    def counting(config, *args):
        traced_layers.append(config.num_hidden_layers)
        return real_trace(config, *args)

    monkeypatch.setattr(fake_forward, "trace", counting)
    monkeypatch.setattr(tracing, "_TRACED", {})  # no figures cached by an earlier test
    recipe = Recipe.from_dict({"model": {"path": "huggyllama/llama-65b"}, "train": {"micro_batch_size": 1}})
    the_plan = plan(recipe, seq=2048)
    assert the_plan.activation_source == "traced" and the_plan.shape.layers == 80
    assert traced_layers == [2, 2, 2, 2], traced_layers
    # a plan that differs in checkpointing only (every_n's spacing, per-layer policies) traces nothing more:
    # every trace sets its own policy
    spaced = recipe.with_overrides({"memory.checkpointing": "every_n", "memory.every_n": 3})
    assert plan(spaced, seq=2048).activation_source == "traced"
    assert traced_layers == [2, 2, 2, 2], traced_layers


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])  # the kernels that train on a CPU
@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_the_planner_traces_the_recipes_attention_kernel(kernel, packing):
    """Eager keeps the score matrix, sdpa with a packed rows' mask repeats K/V to every head: each
    kernel's own bytes, not one formula's."""
    recipe = recipe_for("tiny-llama", "none", 1, packing).with_overrides(
        {"model.attn_implementation": kernel}
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    peft_model = adapters.attach_lora(base, recipe.lora)
    saved = measure_saved_bytes(peft_model, batch_of(packing))
    predicted = activation_bytes(model_shape(recipe), recipe, "none", 1, BATCH, SEQ, "cpu")
    assert predicted.source == "traced"
    assert predicted.total == pytest.approx(saved.total, rel=0.05)


@pytest.mark.parametrize("arch", ["tiny-qwen3-moe", "tiny-deepseek-v3"])  # the second: a dense layer first
def test_a_mixture_traced_with_a_few_experts_has_the_figures_of_every_expert(arch):
    """fake_forward traces a mixture with FEW_EXPERTS experts routed and one more, and extrapolates to all
    of them: the saved bytes of each layer equal, to the byte, a trace of every expert (a counter of its
    own makes trace run them all), and so do the recompute costs at rows of the flops-bound size; 16 experts
    top-2, LoRA on every expert, under bf16 autocast (where each expert's LoRA factors are copied)."""
    from qlora_kit.memory.accounting import SavedTensors

    recipe = Recipe.from_dict({"model": {"path": f"builtin:{arch}"}, "memory": {"chunked_loss": False}})
    assert recipe.lora.experts
    config = model_shape(recipe).config
    key = "num_experts" if hasattr(config, "num_experts") else "n_routed_experts"
    setattr(config, key, 16)
    shape = fake_forward.Shape(BATCH, SEQ)
    for kind in ("none", "full", "selective"):
        few = fake_forward.trace(config, recipe, kind, shape, "bf16", set())
        every = fake_forward.trace(
            config, recipe, kind, shape, "bf16", set(), counter=lambda m: SavedTensors(m)
        )
        assert few[0] == every[0], kind
        for layer, costs in every[1].items():
            assert few[1][layer] == pytest.approx(costs, rel=1e-9), (kind, layer)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gemma4"])  # Gemma 4: per-layer embeddings outside
def test_one_trace_of_full_logits_gives_the_chunked_heads_figures(arch, monkeypatch):
    """trace_layers' cache leaves memory.chunked_loss out: the full-logits trace's figure outside the layers
    when the head was called (fake_forward.BEFORE_HEAD) is, to the byte, a trace of the forward the chunked
    head runs (final_hidden_states, no labels), its layers' figures and costs the same, under bf16
    autocast with and without checkpointing; and both heads' plans come from one trace (red with the
    figure read at the forward's end, or the head in the cache's key again)."""
    recipe = Recipe.from_dict({"model": {"path": f"builtin:{arch}"}, "memory": {"chunked_loss": True}})
    full_logits = recipe.model_copy(
        update={"memory": recipe.memory.model_copy(update={"chunked_loss": False})}
    )
    config = model_shape(recipe).config
    shape = fake_forward.Shape(BATCH, SEQ)
    for kind in ("none", "full"):
        chunked, chunked_costs = fake_forward.trace(config, recipe, kind, shape, "bf16", set())
        full, full_costs = fake_forward.trace(config, full_logits, kind, shape, "bf16", set())
        assert full[fake_forward.BEFORE_HEAD] == chunked[OUTSIDE] < full[OUTSIDE], kind
        layers = [name for name in full if name.startswith("layer ")]
        assert [full[name] for name in layers] == [chunked[name] for name in layers], kind
        assert full_costs == chunked_costs, kind
    traced, real_trace_both = [], tracing._trace_both

    def counting(*args):
        traced.append(args)
        return real_trace_both(*args)

    monkeypatch.setattr(tracing, "_TRACED", {})  # no figures cached by an earlier test
    monkeypatch.setattr(tracing, "_trace_both", counting)
    both = [trace_layers(config, r, BATCH, SEQ, "bf16") for r in (full_logits, recipe)]
    assert len(traced) == 1
    assert not both[0].chunked_head and both[1].chunked_head
    assert (
        (both[1].head, both[1].head_checkpointed)
        == both[0].chunked_heads
        != (both[0].head, both[0].head_checkpointed)
    )
