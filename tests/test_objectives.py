"""The objective table (registries/objectives.py): every objective is one entry, whose module
(training/objective_trainer.py's ``MODULES``, imported explicitly) builds it, and nothing outside the
objective modules asks ``train.objective == "..."``."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from qlora_kit.registries import objectives
from qlora_kit.registries.objectives import OBJECTIVES

PACKAGE = Path(__file__).resolve().parents[1] / "qlora_kit"
ASKED = re.compile(r"""objective\s*(==|!=|\bin\b|\bnot in\b)\s*[\("']""")


def objective_modules() -> dict[str, str]:
    """train.objective -> the module ``MODULES`` imports for it, read from each loader's import statement
    (without running it: TRL stays unimported here)."""
    from qlora_kit.training.objective_trainer import MODULES

    modules = {}
    for name, load in MODULES.items():
        (node,) = [n for n in ast.walk(ast.parse(inspect.getsource(load))) if isinstance(n, ast.ImportFrom)]
        (alias,) = node.names
        modules[name] = f"{node.module}.{alias.name}"
    return modules


def test_no_module_outside_the_objective_modules_asks_which_objective_it_is():
    """A feature that needs to know the objective reads a trait of its entry; a comparison with a name
    means the table is missing that trait."""
    own = set(objective_modules().values())
    asking = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if module in own:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if ASKED.search(line.split("#")[0]):
                asking.append(f"{module}:{number}: {line.strip()}")
    assert asking == []


def test_every_objective_has_one_module_and_every_module_one_objective():
    assert set(objective_modules()) == set(OBJECTIVES)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_objective_names_a_module_that_builds_it(name):
    from qlora_kit.after.evaluate import OBJECTIVE_METRICS

    spec = OBJECTIVES[name]
    assert spec.name == name
    assert spec.rows in (objectives.SEQUENCES, objectives.PAIRS, objectives.PROMPTS, objectives.UNPAIRED)
    path = PACKAGE.parent / (objective_modules()[name].replace(".", "/") + ".py")
    source = path.read_text()
    # the builder's two functions, without importing TRL here
    assert "\ndef prepare(recipe" in source and "\ndef trainer_parts(recipe" in source
    if name in OBJECTIVE_METRICS:
        assert callable(OBJECTIVE_METRICS[name]())
    for key, label in (*spec.console, *spec.eval_line, *spec.summary):
        assert key and label
    # a figure shown or summarised is one the metrics file keeps (its eval_ twin included)
    for key, _ in spec.summary:
        assert key.removeprefix("eval_") in spec.metric_keys


def test_every_objective_metric_is_a_tables_objective():
    from qlora_kit.after.evaluate import OBJECTIVE_METRICS

    assert set(OBJECTIVE_METRICS) <= set(OBJECTIVES)


def test_the_recipe_takes_exactly_the_tables_objectives():
    from qlora_kit.recipe.recipe import Recipe

    for name in OBJECTIVES:
        assert Recipe.from_dict({"train": {"objective": name}, **_data_for(name)}).train.objective == name
    with pytest.raises(ValueError, match=r"train\.objective"):
        Recipe.from_dict({"train": {"objective": "nosuch"}})


def _data_for(name: str) -> dict:
    rows = OBJECTIVES[name].rows
    if rows == objectives.PAIRS:
        return {"data": {"path": "builtin:demo-preferences", "format": "preference_alpaca"}}
    if rows == objectives.PROMPTS:
        return {"grpo": {"rewards": [{"name": "exact_match"}]}}
    if rows == objectives.UNPAIRED:
        return {"data": {"path": "builtin:demo-feedback", "format": "feedback"}}
    return {}
