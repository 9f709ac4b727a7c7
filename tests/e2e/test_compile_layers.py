"""train.compile: each decoder layer compiled (training/compiled.py), under every checkpointing policy and
both loss heads, with LoRA on 4-bit linears: no graph break, a bounded number of graphs over varied
sequence lengths, and the eager run's losses.

Each policy's compiled run and eager run are built by ``pipeline.build`` with the same seed and stepped
on the same batches through the Trainer's own ``training_step`` (our step, guards and accounting
included). The layers compile once for the process per checkpoint kind (one code object for all layers;
the checkpoint, traced inside the layer's forward, makes full, none and selective a graph each), so each
kind's first test pays its compile: the defaults (full), none, and per_layer (selective)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from qlora_kit import Recipe
from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.training import compiled
from qlora_kit.training.pipeline import build
from tests.test_compile_choice import assert_decided_by_its_figures

pytestmark = pytest.mark.slow  # compiling a layer takes tens of seconds on 2 cores

# Sequence lengths of successive micro-batches (packing, the last batch, other data): a recompile with
# the lengths dynamic after the first change, then none.
LENGTHS = (32, 48, 40, 24, 56)
# The compiled graph sums in another order (fused kernels): in float32 compute each of a layer's
# reductions rounds by ~eps * sqrt(n); sqrt(eps) (3.5e-4 relative) bounds the loss's drift over the
# tiny Llama's 4 layers, while a graph that computes something else is off by 1e-2 and more.
TOLERANCE = torch.finfo(torch.float32).eps ** 0.5

POLICIES = {
    "none, transformers' loss": {"memory.checkpointing": "none", "memory.chunked_loss": False},
    "every_n": {"memory.checkpointing": "every_n", "memory.every_n": 2},
    "per_layer": {
        "memory.checkpointing": "per_layer",
        "memory.layer_policies": ["full", "none", "selective", "none"],
    },
    "selective": {"memory.checkpointing": "selective"},
    "offload": {"memory.offload_activations": True},
}
# The layers each policy leaves eager, and why (compiled.py's docstring)
EAGER = {"offload": dict.fromkeys(range(4), compiled.OFFLOAD_REASON)}


def _trainer(tmp_path, compile_layers: bool | str, overrides: dict, recipe: str = "recipes/demo.yaml"):
    values = {
        "train.output_dir": str(tmp_path / f"compile-{compile_layers}"),
        "train.compile": compile_layers,
        "train.micro_batch_size": 2,
        "train.max_steps": 100,
        "train.probe_worst_batch": False,
        "data.packing": False,
        "data.max_seq_len": max(LENGTHS),
        **overrides,
    }
    torch.manual_seed(0)
    trainer = build(Recipe.from_yaml(recipe, values)).trainer
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)
    trainer.model.train()
    return trainer


def _losses(trainer, batches) -> list[float]:
    return [float(trainer.training_step(trainer.model_wrapped, batch)) for batch in batches]


def _batches() -> list[dict]:
    """Two rows a batch, the second padded over its last quarter as the run's collator pads a shorter row:
    the layers see an attention mask, as on the run's own rows, so the graphs compiled here serve auto's
    timed micro-batch of the demo's rows (one without a mask compiles another graph)."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for length in LENGTHS:
        ids = torch.randint(5, 600, (2, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, length - length // 4 :] = 0
        ids[1, length - length // 4 :] = 0  # the pad token
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def test_the_defaults_compile_one_graph_without_a_break_and_follow_the_eager_losses(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    batches = _batches()
    eager = _losses(_trainer(tmp_path, False, {}), batches)
    run = _trainer(tmp_path, True, {})
    assert compiled.decoder_layers_compiled(run.model)
    result = compiled.compile_decoder_layers(run.model)  # again: what it compiles, reported
    losses = _losses(run, batches)

    # every layer compiled under the defaults (full checkpointing, the chunked head): the policies'
    # test's claims for the defaults, on these runs
    assert result.compiled == [0, 1, 2, 3] and not result.eager and not result.partly
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # one graph for the first length, one with the lengths dynamic; five lengths, no third
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert losses == pytest.approx(eager, rel=TOLERANCE)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_runs_compiled_or_names_why_a_layer_is_eager(tmp_path, name):
    counters.clear()
    batches = _batches()[:2]
    eager = _losses(_trainer(tmp_path, False, POLICIES[name]), batches)
    run = _trainer(tmp_path, True, POLICIES[name])
    result = compiled.compile_decoder_layers(run.model)  # again: what it compiles, reported
    losses = _losses(run, batches)

    assert result.eager == EAGER.get(name, {})
    assert result.compiled == [i for i in range(4) if i not in result.eager]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert losses == pytest.approx(eager, rel=TOLERANCE)


def test_auto_on_a_long_run_times_a_compile_and_decides_by_it(tmp_path, caplog):
    # 100,000 planned steps: the bound passes, so a compile is timed (the graph the defaults' test compiled
    # serves it when the tests run in order) and any saving repays it
    with caplog.at_level(logging.INFO, logger="qlora_kit.training.compile_choice"):
        trainer = _trainer(tmp_path, "auto", {"train.max_steps": 100_000})
    # the decision's own line (compiled.py logs "train.compile: N of M decoder layers compiled" too, seen
    # here when an earlier test set qlora_kit's loggers to INFO)
    decisions = [r for r in caplog.records if r.name == "qlora_kit.training.compile_choice"]
    (line,) = [r.getMessage() for r in decisions if r.getMessage().startswith("train.compile: ")]
    assert "compiled) = " in line, line  # timed, not bounded
    assert_decided_by_its_figures(line, trainer.model, steps=100_000, compiler_started=True)


def test_a_mixture_compiles_all_but_its_routed_experts_and_follows_the_eager_losses(tmp_path):
    """The tiny Qwen3-MoE under the defaults (full checkpointing, the chunked head), five lengths: its
    attention and norms run compiled, its router (whose forward hook counts the experts' load) and routed
    experts eager, with no graph break, two graphs per compiled class, and the eager run's losses."""
    torch._dynamo.reset()
    counters.clear()
    batches = _batches()
    mixture = {"model.path": "builtin:tiny-qwen3-moe"}
    eager = _losses(_trainer(tmp_path, False, mixture), batches)
    run = _trainer(tmp_path, True, mixture)
    result = compiled.compile_decoder_layers(run.model)  # again: what it compiles, reported
    losses = _losses(run, batches)

    layers = decoder_layers(run.model)
    assert result.compiled == list(range(len(layers))) and not result.eager
    assert result.partly == dict.fromkeys(range(len(layers)), compiled.ROUTED_REASON)
    for layer in layers:
        regions = compiled.regions_around(layer, compiled.routed_paths(run.model))
        assert layer.self_attn in regions and all(_compiled(region) for region in regions)
        assert not _compiled(layer.mlp.experts) and not _compiled(layer.mlp.gate)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    classes = {
        type(region) for region in compiled.regions_around(layers[0], compiled.routed_paths(run.model))
    }
    assert counters["stats"]["unique_graphs"] == 2 * len(classes), dict(counters["stats"])
    assert losses == pytest.approx(eager, rel=TOLERANCE)


def _compiled(module) -> bool:
    return module._compiled_call_impl is not None or hasattr(module.__dict__.get("forward"), "own_forward")


def test_uncompiling_a_mixture_gives_each_region_back_the_forward_it_had():
    """accelerate's hooks (a device map's) set a module's ``forward`` on the instance: a region compiled over
    one gets it back when the layers are uncompiled (auto uncompiles when the compile does not pay)."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from qlora_kit.model.loading import load_base_model

    recipe = Recipe.from_dict({"model": {"path": "builtin:tiny-qwen3-moe"}})
    model = load_base_model(recipe.model, recipe.quant)
    hooked = decoder_layers(model)[0].self_attn
    add_hook_to_module(hooked, ModelHook())
    accelerate_forward = hooked.forward
    compiled.compile_decoder_layers(model)
    assert compiled.decoder_layers_compiled(model) and hooked.forward is not accelerate_forward
    compiled.uncompile_decoder_layers(model)
    assert not compiled.decoder_layers_compiled(model)
    assert hooked.forward is accelerate_forward
    assert all("forward" not in layer.self_attn.__dict__ for layer in decoder_layers(model)[1:])


def test_a_hybrid_compiles_its_attention_layers_and_says_why_its_recurrent_ones_stay_eager(caplog):
    from qlora_kit.model.loading import load_base_model

    recipe = Recipe.from_dict({"model": {"path": "builtin:tiny-qwen3.5"}})
    model = load_base_model(recipe.model, recipe.quant)
    kinds = model.config.get_text_config().layer_types
    with caplog.at_level(logging.INFO, logger="qlora_kit.training.compiled"):
        result = compiled.compile_decoder_layers(model)
    assert result.compiled == [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    assert result.eager == {
        i: compiled.RECURRENT_REASON for i, k in enumerate(kinds) if k != "full_attention"
    }
    assert result.compiled and result.eager
    assert f"eager: {compiled.RECURRENT_REASON}" in caplog.text
    compiled.uncompile_decoder_layers(model)
    assert not compiled.decoder_layers_compiled(model)


def test_a_vision_language_model_compiles_its_decoder_layers_on_image_batches(tmp_path):
    """Qwen2.5-VL's image rows (pixel values, image grids, 3-D rotary positions) as the run's own collator
    makes them, three batches of three lengths: the images are merged into the hidden states before the
    first layer, so a layer sees another sequence length and nothing else: no graph break, one graph for
    the first length and one dynamic, and the eager run's losses."""
    torch._dynamo.reset()
    counters.clear()
    vlm = {"model.path": "builtin:tiny-qwen2.5-vl", "train.micro_batch_size": 4, "data.max_seq_len": 64}
    eager_run = _trainer(tmp_path, False, vlm, recipe="recipes/demo-vlm.yaml")
    batches = list(itertools.islice(iter(eager_run.get_train_dataloader()), 3))
    assert all("pixel_values" in b and "image_grid_thw" in b for b in batches)
    assert len({b["input_ids"].shape[1] for b in batches}) == 3  # three lengths: a recompile is due
    eager = _losses(eager_run, batches)
    run = _trainer(tmp_path, True, vlm, recipe="recipes/demo-vlm.yaml")
    assert compiled.decoder_layers_compiled(run.model)
    losses = _losses(run, batches)

    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert losses == pytest.approx(eager, rel=TOLERANCE)
