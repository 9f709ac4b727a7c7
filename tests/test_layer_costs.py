"""checkpointing auto's cost model: auto never costs more than the uniform policy (every_n among them) that
fits the same budget under the costs it chose by, the costs are timed on the run's own layers, and a
resumed run chooses with the costs its checkpoint was trained with."""

import itertools

import pytest

from qlora_kit import Recipe
from qlora_kit.memory import layer_costs
from qlora_kit.memory.auto import choose_layers, resolve_auto
from qlora_kit.memory.layer_costs import LayerCosts
from qlora_kit.memory.planner import GIB, plan

pytestmark = pytest.mark.slow  # times layers' recomputes: the full suite runs it, the inner loop skips it

# selective dearer than full (this CPU: benchmarks/checkpointing_frontier.py), and cheap (a GPU's shape)
COSTS = {
    "selective dearer": LayerCosts(selective=0.02, full=0.012, source="given"),
    "selective cheap": LayerCosts(selective=0.002, full=0.012, source="given"),
    "counted": None,
}


def tiny(**memory) -> Recipe:
    return Recipe.from_dict(
        {
            "data": {"packing": False, "max_seq_len": 64},
            "train": {"micro_batch_size": 2},
            "memory": {"chunked_loss": False, **memory},
        }
    )


def total(the_plan, layers: list[str], costs: LayerCosts | None) -> float:
    if costs is not None:
        return sum(costs.of(p) for p in layers)
    counted = the_plan.activations(layers).recompute_cost
    return sum(counted)


@pytest.mark.parametrize("name", list(COSTS))
def test_auto_never_costs_more_than_the_uniform_policy_that_fits(name):
    """At every uniform policy's own peak (where the search's rounding can miss that very choice) and
    between them: auto fits and costs no more than the cheapest uniform policy that fits; where
    selective costs more than full it keeps no selective layer."""
    costs = COSTS[name]
    recipe = tiny()
    the_plan = plan(recipe, device="cpu")
    rows = the_plan.policies[1:]
    peaks = sorted({row.peak for row in rows})
    budgets = [*peaks, *((a + b) / 2 for a, b in itertools.pairwise(peaks))]
    for budget in budgets:
        row, why = choose_layers(recipe, budget / GIB, the_plan, costs)
        assert row.peak <= budget, why
        fitting = [r for r in rows if r.peak <= budget]
        best = min(total(the_plan, r.layers, costs) for r in fitting)
        assert total(the_plan, row.layers, costs) <= best * (1 + 1e-9), (budget, row.layers, why)
        if name == "selective dearer":
            assert "selective" not in row.layers, why


def test_resume_chooses_with_the_checkpoints_costs(tmp_path):
    """A checkpoint's costs are read back and chosen with, not measured again: two sets of costs that
    rank selective and full apart give two different plans for the same budget."""
    the_plan = plan(tiny(), device="cpu")
    peaks = {row.policy: row.peak for row in the_plan.policies}
    budget = (peaks["selective"] + peaks["every_n=3"]) / 2 / GIB
    recipe = tiny(checkpointing="auto", budget_gb=budget)
    chosen = {}
    for name in ("selective dearer", "selective cheap"):
        checkpoint = tmp_path / name / "checkpoint-3"
        checkpoint.mkdir(parents=True)
        layer_costs.write(checkpoint, COSTS[name])
        assert layer_costs.read(checkpoint) == COSTS[name]
        memory, costs = resolve_auto(recipe, checkpoint)
        assert costs == COSTS[name]
        chosen[name] = memory.layer_policies or [memory.checkpointing]
    assert "selective" in chosen["selective cheap"]
    assert "selective" not in chosen["selective dearer"]
    assert layer_costs.read(tmp_path) is None  # no file: measured afresh


def test_costs_are_timed_on_the_runs_layers():
    """Without a checkpoint auto times the three policies on the model's own layers (4-bit, LoRA,
    its autocast): full and selective each add time to a step, and the plan names where the costs came
    from."""
    the_plan = plan(tiny(), device="cpu")
    peaks = {row.policy: row.peak for row in the_plan.policies}
    recipe = tiny(checkpointing="auto", budget_gb=(peaks["selective"] + peaks["every_n=3"]) / 2 / GIB)
    memory, costs = resolve_auto(recipe)
    assert costs is not None and costs.source.startswith("measured on cpu")
    assert costs.full > 0 and costs.selective > 0
    row, why = choose_layers(recipe, recipe.memory.budget_gb, the_plan, costs)
    assert (
        memory.layer_policies or [memory.checkpointing] * 4
    ) == row.layers or memory.checkpointing == "every_n"
    assert "recompute costs: measured on cpu" in why
