"""The objective table (registries/objectives.py): every objective is one entry whose module builds it, and
nothing outside the objective modules asks ``train.objective == "..."``."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from qlora_kit.registries import objectives
from qlora_kit.registries.objectives import OBJECTIVES

PACKAGE = Path(__file__).resolve().parents[1] / "qlora_kit"
ASKED = re.compile(r"""objective\s*(==|!=|\bin\b|\bnot in\b)\s*[\("']""")


def test_no_module_outside_the_objective_modules_asks_which_objective_it_is():
    """A feature that needs to know the objective reads a trait of its entry; a comparison with a name
    means the table is missing that trait."""
    own = {spec.module for spec in OBJECTIVES.values()}
    asking = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if module in own:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if ASKED.search(line.split("#")[0]):
                asking.append(f"{module}:{number}: {line.strip()}")
    assert asking == []


@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_objective_names_a_module_that_builds_it(name):
    spec = OBJECTIVES[name]
    assert spec.name == name
    assert spec.rows in (objectives.SEQUENCES, objectives.PAIRS, objectives.PROMPTS, objectives.UNPAIRED)
    path = PACKAGE.parent / (spec.module.replace(".", "/") + ".py")
    source = path.read_text()
    # the builder's two functions, without importing TRL here
    assert "\ndef prepare(recipe" in source and "\ndef trainer_parts(recipe" in source
    if spec.eval_metrics is not None:
        module, function = spec.eval_metrics.split(":")
        assert callable(getattr(importlib.import_module(module), function))
    for key, label in (*spec.console, *spec.eval_line, *spec.summary):
        assert key and label
    # a figure shown or summarised is one the metrics file keeps (its eval_ twin included)
    for key, _ in spec.summary:
        assert key.removeprefix("eval_") in spec.metric_keys


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
