"""Selective checkpointing and per-layer plans: the same losses and LoRA gradients as no checkpointing (bf16
autocast, LoRA dropout, packed and padded rows) on every builtin family, the bytes the planner traced for
them, and auto's per-layer choice applied layer by layer."""

import itertools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.memory import checkpointing, layer_choice, layer_costs
from qlora_kit.memory.accounting import OUTSIDE, SavedTensors, measure_saved_bytes
from qlora_kit.memory.auto import choose_layers, resolve_checkpointing
from qlora_kit.memory.layer_costs import LayerCosts
from qlora_kit.memory.planner import GIB, activation_bytes, plan
from qlora_kit.memory.shapes import model_shape
from qlora_kit.model import adapters, builtin
from qlora_kit.model import loading as model
from tests.test_tracing import batch_of

ARCHITECTURES = sorted(builtin.TINY_ARCHITECTURES)  # the nine families the pipeline trains
BATCH, SEQ = 2, 64
MIXED = ["selective", "none", "full", "selective"]  # a per-layer plan for the four-layer tiny models


def recipe_for(arch: str, policy: str, packing: bool = False, layers: list[str] | None = None) -> Recipe:
    memory = {"checkpointing": policy, "chunked_loss": False}
    if layers is not None:
        memory["layer_policies"] = layers
    return Recipe.from_dict(
        {
            "model": {"path": f"builtin:{arch}"},
            "memory": memory,
            "lora": {"dropout": 0.1},
            "data": {"packing": packing},
        }
    )


def loss_and_grads(peft_model, batch, policies: list[str]) -> tuple[float, dict[str, torch.Tensor], object]:
    """One forward (its saved bytes counted) and backward under the Trainer's bf16 autocast, with
    ``policies`` applied to the layers (the model was set up for them); the RNG seeded alike, so LoRA
    dropout draws the same masks."""
    layers = checkpointing.decoder_layers(peft_model)
    for layer, policy in zip(layers, policies, strict=True):
        layer.gradient_checkpointing = policy != "none"
    peft_model.zero_grad()
    peft_model.train()
    torch.manual_seed(0)
    counter = SavedTensors(peft_model)
    with counter.counting(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = peft_model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    return loss.item(), grads, counter.result()


def compare(arch: str, policy: str, packing: bool, layers: list[str] | None = None) -> None:
    """Losses and gradients equal to no checkpointing's on the same model (checkpointing switched off on
    its layers), and the bytes saved as the planner traces them (within 5%, per layer and in total)."""
    recipe = recipe_for(arch, policy, packing, layers)
    base = model.load_base_model(recipe.model, recipe.quant)
    checkpointing.enable_checkpointing(base, recipe.memory)
    applied = checkpointing.applied_policies(base)
    assert applied == (layers or [policy] * len(applied))
    torch.manual_seed(0)
    peft_model = adapters.attach_lora(base, recipe.lora)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # as after some steps: peft starts B at zero, where A would get no gradient
            param.data.normal_(0, 0.05)
    batch = batch_of(packing)
    loss, grads, saved = loss_and_grads(peft_model, batch, applied)
    reference, expected, _ = loss_and_grads(peft_model, batch, ["none"] * len(applied))
    assert loss == pytest.approx(reference, rel=1e-3)
    assert [n for n, g in grads.items() if not g.abs().sum() > 0] == [], "every LoRA tensor gets a gradient"
    for name, grad in grads.items():
        scale = expected[name].abs().max().item()
        assert (grad - expected[name]).abs().max().item() <= 1e-2 * scale, name  # bf16: reduction order
    predicted = activation_bytes(model_shape(recipe), recipe, policy, 1, BATCH, SEQ, "cpu", precision="bf16")
    assert predicted.source == "traced"
    assert predicted.total == pytest.approx(saved.total, rel=0.05)
    assert predicted.head == pytest.approx(saved.per_layer[OUTSIDE], rel=0.05)
    for index, nbytes in enumerate(predicted.per_layer):
        assert nbytes == pytest.approx(saved.per_layer.get(f"layer {index}", 0), rel=0.05), f"layer {index}"


@pytest.mark.slow  # traces and plans every layer: the full suite runs it
def test_selective_matches_no_checkpointing_and_the_plan():
    compare("tiny-llama", "selective", packing=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_selective_matches_no_checkpointing_on_every_family(arch, packing):
    compare(arch, "selective", packing)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_mixed_per_layer_plan_matches_no_checkpointing_on_every_family(arch):
    compare(arch, "per_layer", packing=True, layers=MIXED)


def test_selective_keeps_less_than_none_and_more_than_full():
    """Measured on the real 4-bit model: a selective layer keeps its input and the kept ops' outputs."""
    kept = {}
    for policy in ("none", "selective", "full"):
        recipe = recipe_for("tiny-llama", policy)
        base = model.load_base_model(recipe.model, recipe.quant)
        checkpointing.enable_checkpointing(base, recipe.memory)
        peft_model = adapters.attach_lora(base, recipe.lora)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept[policy] = measure_saved_bytes(peft_model, batch_of(False)).per_layer["layer 1"]
    assert kept["full"] < kept["selective"] < 0.5 * kept["none"]


def test_a_per_layer_plan_of_the_wrong_length_is_one_clear_error():
    recipe = recipe_for("tiny-llama", "per_layer", layers=["full", "none"])
    base = model.load_base_model(recipe.model, recipe.quant)
    with pytest.raises(RecipeError, match=r"memory.layer_policies: one policy per decoder layer, 4"):
        checkpointing.enable_checkpointing(base, recipe.memory)


def test_per_layer_needs_its_layer_policies():
    with pytest.raises(ValueError, match=r"memory\.layer_policies: required"):
        Recipe.from_dict({"memory": {"checkpointing": "per_layer"}})


@pytest.mark.slow  # traces and plans every layer: the full suite runs it
def test_auto_resolves_to_a_per_layer_plan_that_fits(tmp_path):
    """Between selective's peak and every_n's, auto mixes: the recipe it resolves to names each layer,
    the peak fits, and its recompute cost is no more than any uniform policy's that fits (counted FLOPs
    here; resolved with costs read from a checkpoint instead of timed)."""
    recipe = recipe_for("tiny-llama", "none")
    the_plan = plan(recipe, device="cpu")
    peaks = {row.policy: row.peak for row in the_plan.policies}
    budget = (peaks["selective"] + peaks["every_n=3"]) / 2 / GIB
    auto = recipe.with_overrides({"memory.checkpointing": "auto", "memory.budget_gb": budget})
    row, _ = choose_layers(auto, budget, the_plan)
    assert row.policy == "per_layer" and row.peak <= budget * GIB
    fitting = [p.recompute_cost for p in the_plan.policies if p.peak <= budget * GIB]
    assert row.recompute_cost < min(fitting)
    costs = LayerCosts(selective=0.009, full=0.012, source="given")
    layer_costs.write(tmp_path, costs)
    resolved = resolve_checkpointing(auto.with_overrides({"memory.over_budget": False}), tmp_path)
    # the CLI plans for this machine's device (the CPU here), as `plan` above
    row, _ = choose_layers(auto, budget, the_plan, costs)
    assert resolved.checkpointing == "per_layer" and resolved.layer_policies == row.layers


def test_cheapest_fit_is_the_optimum_of_a_small_case():
    """Three layers, every choice enumerated: the search returns the cheapest that fits."""
    options = [
        {"none": (100, 0.0), "selective": (40, 0.5), "full": (5, 1.0)},
        {"none": (90, 0.0), "selective": (35, 0.7), "full": (5, 1.0)},
        {"none": (120, 0.0), "selective": (30, 0.4), "full": (5, 1.0)},
    ]
    for budget in (15, 60, 100, 150, 200, 400):
        best = min(
            (sum(o[p][1] for o, p in zip(options, picks, strict=True)), picks)
            for picks in itertools.product(*[list(o) for o in options])
            if sum(o[p][0] for o, p in zip(options, picks, strict=True)) <= budget
        )
        got = layer_choice.cheapest_fit(options, budget)
        assert sum(o[p][1] for o, p in zip(options, got, strict=True)) == pytest.approx(best[0]), budget
        assert sum(o[p][0] for o, p in zip(options, got, strict=True)) <= budget
    assert layer_choice.cheapest_fit(options, 14) is None


@pytest.mark.slow
def test_a_mixed_plan_from_auto_trains_and_resumes_bit_identically(tmp_path, qlora_kit_here):
    """auto at a budget between selective's and every_n's peaks resolves to a per-layer mix; six steps
    straight and three steps then a resume from checkpoint-3 end with the same adapter, bit for bit
    (LoRA dropout on: the recompute replays the RNG the checkpoint restored). Both runs are the CLI in
    this process (a process start was most of a tiny run's time; a killed run's resume from the shell is
    tests/e2e/test_faults.py's)."""
    fields = {
        "data": {"max_seq_len": 64, "packing": False},
        "lora": {"dropout": 0.1},
        "train": {
            "max_steps": 6,
            "save_steps": 3,
            "micro_batch_size": 4,
            "eval_steps": None,
            "sample_prompts": 0,
        },
    }
    the_plan = plan(Recipe.from_dict(fields), device="cpu")
    peaks = {row.policy: row.peak for row in the_plan.policies}
    fields["memory"] = {
        "checkpointing": "auto",
        "budget_gb": (peaks["selective"] + peaks["every_n=3"]) / 2 / GIB,
    }
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(fields))

    def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
        return qlora_kit_here("train", str(recipe), "--output-dir", str(out), *extra)

    straight = train(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert "memory.checkpointing auto: per_layer" in straight.stderr
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = train(resumed_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr and "checkpoint-3" in resumed.stderr
    # the layers were chosen with the costs timed by the first run, not timed again
    assert (resumed_dir / "checkpoint-3" / layer_costs.COSTS_FILE).is_file()
    assert "checkpointing auto: the recompute costs of checkpoint-3" in resumed.stderr
    expected = load_file(tmp_path / "straight" / "adapter_model.safetensors")
    got = load_file(resumed_dir / "adapter_model.safetensors")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.slow  # loads the 4-bit model and runs a forward: about 14 s on 2 busy cores
def test_a_selective_layer_keeps_at_least_its_4bit_matmuls_and_attention_outputs_counted_by_hand():
    """A lower bound written from the config, tensor by tensor (not the policy's own list): each of the
    seven 4-bit linears' bf16 outputs (q, k, v, o, gate, up, down) and attention's output. A policy that
    let the 4-bit matmuls go (recomputing the layer's costliest ops) keeps far less than this."""
    from tests.test_tracing import BATCH as ROWS
    from tests.test_tracing import SEQ as LENGTH

    recipe = recipe_for("tiny-llama", "selective")
    base = model.load_base_model(recipe.model, recipe.quant)
    checkpointing.enable_checkpointing(base, recipe.memory)
    peft_model = adapters.attach_lora(base, recipe.lora)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = measure_saved_bytes(peft_model, batch_of(False)).per_layer["layer 1"]
    cfg = base.config
    tokens, bf16 = ROWS * LENGTH, 2
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    outputs = cfg.hidden_size + 2 * kv + cfg.hidden_size + 2 * cfg.intermediate_size + cfg.hidden_size
    attention = cfg.hidden_size  # sdpa's output, (tokens x heads x head_dim)
    assert kept >= tokens * bf16 * (outputs + attention), (kept, tokens * bf16 * (outputs + attention))


class ContextBefore212:
    """torch 2.4-2.11's SelectiveCheckpointContext: no ``op_output`` (the policy runs before the op)."""

    def __init__(self, *, is_recompute, op_output=None) -> None:
        self.is_recompute = is_recompute


def test_selective_runs_and_counts_alike_on_a_torch_whose_context_has_no_op_output(monkeypatch):
    """The H200 run (torch 2.11): ``selective`` and ``auto`` crashed reading ``ctx.op_output``. The same
    losses, gradients and counted bytes as no checkpointing, with torch's context as 2.11 builds it."""
    import torch.utils.checkpoint as torch_checkpoint

    monkeypatch.setattr(torch_checkpoint, "SelectiveCheckpointContext", ContextBefore212)
    compare("tiny-llama", "selective", packing=False)
