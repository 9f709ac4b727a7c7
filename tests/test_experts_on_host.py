"""memory.experts_on_host (memory/experts_on_host.py): a mixture's 4-bit experts live in host memory and
visit the "device" a layer at a time. On the CPU the device storage and the host copy are two storages and
every copy is counted, so the same losses and gradients as the resident experts prove the copies are whole
and on time, and the counts prove when they happen."""

from __future__ import annotations

import collections
import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from qlora_kit import Recipe, train
from qlora_kit.errors import RecipeError
from qlora_kit.memory import auto, experts_on_host
from qlora_kit.memory.planner import GIB, plan
from qlora_kit.memory.shapes import model_shape, weight_bytes
from qlora_kit.model import loading, moe_experts
from qlora_kit.training.pipeline import build

from .conftest import quick_recipe, run_cli_output

MIXTURE = "builtin:tiny-qwen3-moe"
# The same float32 numbers, which the backward may sum in another order on some CPUs (bit for bit on AMD
# EPYC; on an Intel Xeon with AVX-512 at one thread every LoRA gradient moved, by up to 7e-7 of its largest
# element, the loss not at all): a weight gradient sums over the micro-batch's <= 1,024 positions, whose
# reordered sum moves by up to ~eps * sqrt(1024) = 32 eps of its terms; doubled for the layers a gradient
# passes. A stale or wrong expert copied moves a gradient by 1e-2 and more.
SUMMED_IN_ANOTHER_ORDER = 64 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The run's model under a checkpointing policy, with its experts resident or on the host, built once
    for the module (builds are most of these tests' time): (policy, on_host) -> (model, first micro-batch)."""
    models = {}

    def build_once(policy: str, on_host: bool):
        if (policy, on_host) not in models:
            recipe = quick_recipe(
                tmp_path_factory.mktemp(f"{policy}-{on_host}"),
                **{"model.path": MIXTURE, "memory.checkpointing": policy, "memory.experts_on_host": on_host},
            )
            setup = build(recipe)
            for name, param in setup.model.named_parameters():
                if "lora_B" in name:  # peft starts B at zero: no gradient would reach A
                    torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(1))
            trainer = setup.trainer
            inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
            models[policy, on_host] = setup.model, inputs
        return models[policy, on_host]

    return build_once


def one_step(model, inputs, path: str):
    """One forward and backward of the run's first micro-batch on the matmul path: (loss, LoRA gradients)."""
    moe_experts.set_matmul_path(model, path)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.slow  # two builds a policy (shared with the forward's test)
@pytest.mark.parametrize("policy", ["none", "full"])
def test_losses_and_lora_gradients_equal_the_resident_experts(built, policy):
    """On the looped and the grouped matmul paths, each layer's experts are copied once in the forward pass
    and once in the backward pass (a full checkpoint's recompute shares the backward's copy), and none is
    left on the device after backward; the loss and every LoRA gradient are the resident run's, to the
    order the backward sums in (below)."""
    resident, on_host = built(policy, False), built(policy, True)
    layers = experts_on_host.layers_on_host(on_host[0])
    assert len(layers) == on_host[0].config.num_hidden_layers
    for path in ("looped", "grouped"):
        resident_loss, resident_grads = one_step(*resident, path)
        before = [collections.Counter(layer.copies) for layer in layers]
        loss, grads = one_step(*on_host, path)
        assert abs(loss - resident_loss) <= SUMMED_IN_ANOTHER_ORDER * abs(resident_loss), path
        assert grads.keys() == resident_grads.keys()
        assert any(".experts." in n for n in grads)  # the experts' own LoRA trains
        for name in grads:
            drift = (grads[name] - resident_grads[name]).abs().max() / resident_grads[name].abs().max()
            assert drift <= SUMMED_IN_ANOTHER_ORDER, (path, name, float(drift))
        copies = [dict(layer.copies - seen) for layer, seen in zip(layers, before, strict=True)]
        assert copies == [{"forward": 1, "backward": 1}] * len(layers), path
        assert not any(layer.filled for layer in layers)
        assert all(s.nbytes() == 0 for layer in layers for s in layer.storages)


@pytest.mark.slow  # the gradients' test's model (a build when run alone)
def test_a_forward_holds_at_most_two_layers_and_an_evaluation_copies_each_once(built):
    """Without gradients (evaluation, sample prompts) each layer is copied once and emptied after its
    block; while a layer computes, at most it and the next (prefetched) are on the device. The packed
    weights really are emptied: every byte the experts hold sits on the host between uses."""
    model, _ = built("full", True)
    layers = experts_on_host.layers_on_host(model)
    before = [collections.Counter(layer.copies) for layer in layers]
    packed = sum(
        getattr(m, name).nbytes  # from the shape: the storage is empty
        for _, m in moe_experts.fused_experts(model)
        for name in moe_experts.stacks_of(m)
    )
    assert sum(layer.nbytes for layer in layers) > packed  # the packed weights and their statistics
    on_device = []
    blocks = {id(m) for m in model.modules() if hasattr(m, "experts")}
    hooks = [
        m.register_forward_pre_hook(lambda *_: on_device.append(sum(layer.filled for layer in layers)))
        for m in model.modules()
        if id(m) in blocks
    ]
    with torch.no_grad():
        model(input_ids=torch.randint(5, 600, (1, 16), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    assert on_device and max(on_device) <= 2
    assert [layer.copies - seen for layer, seen in zip(layers, before, strict=True)] == [
        collections.Counter(forward=1)
    ] * len(layers)
    assert not any(layer.filled for layer in layers)


def storage_bytes(model) -> int:
    """Bytes the model's tensors hold where they live (each storage once; an emptied one holds none): its
    parameters, buffers and Linear4bit quantization states."""
    tensors = [*model.parameters(), *model.buffers(), *experts_on_host._quant_state_tensors(model)]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(nbytes for ptr, nbytes in held.items() if nbytes)


def whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


@pytest.mark.slow  # two loads
def test_loading_keeps_the_experts_on_the_host_and_puts_only_the_rest_on_the_device():
    """The load path with memory.experts_on_host: the model comes back with every layer's packed experts in
    their host copies, byte for byte a resident load's, their device tensors empty and never filled (no copy
    counted), so the device holds the resident load's bytes less exactly the planned host bytes."""
    recipe = Recipe.from_dict({"model": {"path": MIXTURE}, "memory": {"experts_on_host": True}})
    base = loading.load_base_model(
        recipe.model, recipe.quant, experts_to_host=experts_on_host.keep_experts_on_host
    )
    resident = loading.load_base_model(recipe.model, recipe.quant)
    layers = experts_on_host.layers_on_host(base)
    found = moe_experts.fused_experts(resident)
    assert len(layers) == len(found) == base.config.num_hidden_layers
    for layer, (_, experts) in zip(layers, found, strict=True):
        assert not layer.filled and not layer.copies
        assert all(s.nbytes() == 0 for s in layer.storages)
        loaded = {t.untyped_storage().data_ptr(): t for t in [*experts.parameters(), *experts.buffers()]}
        as_bytes = sorted(whole_storage(t).numpy().tobytes() for t in loaded.values())
        assert sorted(h.numpy().tobytes() for h in layer.host) == as_bytes
    planned_on_host = weight_bytes(model_shape(recipe), recipe).experts  # Plan.host_experts, untraced
    assert planned_on_host == sum(layer.nbytes for layer in layers)
    assert storage_bytes(resident) - storage_bytes(base) == planned_on_host


@pytest.mark.slow  # a two-step run and a resume of its second step
def test_a_resumed_run_ends_with_the_adapter_of_an_uninterrupted_one(tmp_path):
    """A run of two steps, straight through, then its second checkpoint and its finished marker lost (as if
    killed while writing them) and the run resumed from checkpoint-1: the same adapter. The straight run
    is its own reference (one build less than a separate one, the same proof)."""
    settings = {
        "model.path": MIXTURE,
        "memory.experts_on_host": True,
        "train.max_steps": 2,
        "train.save_steps": 1,
        "data.packing": False,
    }
    recipe = quick_recipe(tmp_path / "run", **settings)
    whole = train(recipe)
    straight = load_file(whole.output_dir / "adapter_model.safetensors")
    shutil.rmtree(whole.output_dir / "checkpoint-2")
    (whole.output_dir / "adapter_config.json").unlink()
    resumed = train(recipe, resume=True)
    again = load_file(resumed.output_dir / "adapter_model.safetensors")
    assert straight.keys() == again.keys()
    assert all(torch.equal(straight[k], again[k]) for k in straight)


def test_a_dense_model_asking_for_it_is_refused_naming_the_field():
    recipe = Recipe.from_dict({"model": {"path": "builtin:tiny-llama"}})
    base = loading.load_base_model(recipe.model, recipe.quant)
    with pytest.raises(RecipeError, match=r"^memory.experts_on_host: llama is not a mixture"):
        experts_on_host.keep_experts_on_host(base, "memory.experts_on_host")
    assert experts_on_host.keep_experts_on_host(base) is None


def test_auto_needs_a_budget():
    with pytest.raises(ValueError, match=r"memory\.budget_gb: required with memory\.experts_on_host: auto"):
        Recipe.from_dict({"memory": {"experts_on_host": "auto"}})


@functools.cache  # the plans are the tests' cost: each one once for the module
def planned(budget_gb: float | None = None, on_host: bool | str = False):
    memory = {"checkpointing": "full", "experts_on_host": on_host}
    if budget_gb is not None:
        memory["budget_gb"] = budget_gb
    recipe = Recipe.from_dict({"model": {"path": MIXTURE}, "memory": memory, "train": {"grad_accum": 4}})
    return recipe, plan(recipe, device="cpu")


@pytest.mark.slow  # two plans traced
def test_the_plan_keeps_every_layers_experts_on_the_host_and_two_layers_on_the_device():
    recipe, resident = planned()
    _, on_host = planned(on_host=True)
    experts, layers = resident.weights.experts, recipe_layers(recipe)
    assert experts > 0 and on_host.host_experts == experts and resident.host_experts == 0
    assert on_host.experts_in_flight == 2 * experts // layers  # the tiny mixture's layers are alike
    assert resident.static - on_host.static == experts - on_host.experts_in_flight
    assert on_host.experts_copied_per_step == 2 * experts * 4  # forward and backward, 4 micro-batches
    full, full_on_host = resident.chosen(recipe), on_host.chosen(recipe)
    assert full.peak - full_on_host.peak == experts - on_host.experts_in_flight  # loading is below both
    # loading keeps them on the host: the device holds the rest and one layer's while it is swapped
    assert resident.load_peak - on_host.load_peak == experts - on_host.experts_in_flight // 2


def recipe_layers(recipe) -> int:
    return len({stack.name.rsplit(".", 1)[0] for stack in model_shape(recipe).expert_stacks})


@pytest.mark.slow  # plans traced at two budgets
def test_auto_keeps_the_experts_on_the_host_only_where_the_budget_needs_it():
    """Two budgets: between the two plans' peaks auto moves them (the run's resolution and the plan
    agree), above the resident peak it leaves them on the device."""
    recipe, resident = planned()
    _, on_host = planned(on_host=True)
    low, high = on_host.chosen(recipe).peak, resident.chosen(recipe).peak
    for budget, expected in (((low + high) / 2, True), (high * 1.01, False)):
        recipe, the_plan = planned(budget / GIB, on_host="auto")
        assert the_plan.experts_on_host is expected
        memory, _ = auto.resolve_auto(recipe)
        assert memory.experts_on_host is expected


def test_it_is_refused_with_fsdp():
    fields = {
        "train": {"fsdp": True},
        "optimizer": {"name": "adamw_torch"},
        "memory": {"experts_on_host": True},
    }
    fields["quant"] = {"compute_dtype": "bfloat16", "quant_storage": "bfloat16"}
    with pytest.raises(ValueError, match=r"memory\.experts_on_host: not with train\.fsdp"):
        Recipe.from_dict(fields)


@pytest.mark.slow  # two plans of the demo mixture
def test_qlora_kit_plan_shows_the_host_and_device_split_and_the_bytes_copied(monkeypatch, capsys):
    argv = ["plan", "demo-moe", "--set", "memory.experts_on_host=true", "--set", "train.grad_accum=2"]
    code, out, err = run_cli_output(argv, monkeypatch, capsys)
    assert code == 0, err
    for shown in ("in pinned host memory", "two layers' in flight", "copied to the device per step"):
        assert shown in out
    assert "experts on host: the training peak under full is" in out
    code, out, err = run_cli_output([*argv, "--json"], monkeypatch, capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["experts_on_host"] is True
    assert shown["experts_copied_per_step"] == 2 * 2 * shown["experts_host"] > 0
    assert 2 * shown["experts_in_flight"] == shown["experts_host"]  # two of the demo mixture's four layers
