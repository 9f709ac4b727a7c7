"""The checkpointing policies' table (registries/checkpointing.py): the recipe accepts exactly its entries,
the checkpointing code, the tracer, the closed form and the planner read their traits from it, and no
module outside it lists or compares policy names."""

import ast
from pathlib import Path

import pytest

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.memory import checkpointing, formula, planner
from qlora_kit.memory.shapes import model_shape
from qlora_kit.model import loading
from qlora_kit.recipe.memory import MemorySection
from qlora_kit.registries import checkpointing as table

PACKAGE = Path(__file__).resolve().parents[1] / "qlora_kit"
NAMES = {"none", "full", "selective", "every_n", "per_layer", "auto"}  # today's entries, for the scan


def needed(name: str) -> dict:
    """The memory fields a policy cannot do without (the table's ``needs``), filled."""
    return {"budget_gb": {"budget_gb": 20}, "layer_policies": {"layer_policies": ["full"] * 4}}.get(
        table.policy(name).needs, {}
    )


def test_the_recipe_accepts_every_entry_and_nothing_else():
    for name in table.names():
        assert MemorySection(checkpointing=name, **needed(name)).checkpointing == name
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict({"memory": {"checkpointing": "sometimes"}})
    assert str(info.value) == (
        "memory.checkpointing: must be one of 'none', 'every_n', 'selective', 'full', 'per_layer' or 'auto' "
        "(got 'sometimes')"
    )
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict({"memory": {"checkpointing": "per_layer", "layer_policies": ["every_n"]}})
    assert str(info.value) == (
        "memory.layer_policies.0: must be one of 'none', 'selective' or 'full' (got 'every_n')"
    )


@pytest.fixture
def made_up(monkeypatch):
    """A policy that exists only in the table: a layer that keeps its input (as full does), a planner
    candidate; and a planned one that needs budget_gb (as auto does)."""
    spec = table.PolicySpec(
        "input_only", table.UNIFORM, table.KEEPS_INPUT, recompute_share=1.0, candidate=True
    )
    monkeypatch.setitem(table.POLICIES, spec.name, spec)
    monkeypatch.setitem(
        table.POLICIES, "budgeted", table.PolicySpec("budgeted", table.PLANNED, needs="budget_gb")
    )
    return spec.name


def test_a_policy_added_to_the_table_is_accepted_expanded_and_applied(made_up):
    recipe = Recipe.from_dict({"memory": {"checkpointing": made_up}})
    assert checkpointing.layer_policies(recipe.memory, 4) == [made_up] * 4
    mixed = MemorySection(checkpointing="per_layer", layer_policies=[made_up, "none", made_up, "none"])
    assert checkpointing.layer_policies(mixed, 4) == [made_up, "none", made_up, "none"]
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict({"memory": {"checkpointing": "budgeted"}})
    assert str(info.value) == "memory.budget_gb: required with memory.checkpointing: budgeted"
    base = loading.load_base_model(recipe.model, recipe.quant)
    assert checkpointing.enable_checkpointing(base, recipe.memory) == [0, 1, 2, 3]
    assert checkpointing.applied_policies(base) == ["full"] * 4  # keeps what full keeps: read back as full


def test_the_planner_counts_a_policy_added_to_the_table_as_what_it_keeps(made_up):
    recipe = Recipe.from_dict({"memory": {"checkpointing": made_up}})
    assert planner.candidate_policies(4)[-1] == (made_up, 1)
    shape = model_shape(recipe)
    formula_of = {
        p: formula.formula_activation_bytes(shape, recipe, [p] * 4, 1, 64) for p in ("full", made_up)
    }
    assert formula_of[made_up].per_layer == formula_of["full"].per_layer
    assert formula_of[made_up].recompute_cost == [1.0] * 4
    the_plan = planner.plan(
        recipe, device="cpu"
    )  # traced: the tracer's figures for a layer keeping its input
    rows = {row.policy: row for row in the_plan.policies}
    assert the_plan.activation_source == "traced"
    assert (rows[made_up].peak, rows[made_up].recompute_cost) == (
        rows["full"].peak,
        rows["full"].recompute_cost,
    )
    assert the_plan.chosen(recipe) is rows[made_up]


def _policy_literals(tree: ast.AST) -> list[int]:
    """Lines that list two or more policy names, compare with one, or compare ``.checkpointing`` with a
    string: what the table answers instead."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            items = node.keys if isinstance(node, ast.Dict) else node.elts
            named = [i for i in items if isinstance(i, ast.Constant) and i.value in NAMES]
            if len(named) >= 2:
                found.append(node.lineno)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            if any(s.value in NAMES - {"none", "full", "auto"} for s in strings) or (
                strings and any(isinstance(s, ast.Attribute) and s.attr == "checkpointing" for s in sides)
            ):
                found.append(node.lineno)
    return found


def test_no_module_outside_the_table_lists_or_compares_policy_names():
    table_module = PACKAGE / "registries" / "checkpointing.py"
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != table_module and (lines := _policy_literals(ast.parse(path.read_text())))
    }
    assert found == {}


def test_the_scan_sees_a_literal_list_and_a_comparison():
    assert _policy_literals(ast.parse('POLICIES = ("none", "selective", "full")')) == [1]
    assert _policy_literals(ast.parse('if memory.checkpointing != "auto": pass')) == [1]
    assert _policy_literals(ast.parse('if policy == "every_n": pass')) == [1]
