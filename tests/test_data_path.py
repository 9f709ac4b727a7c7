"""One data path for every objective (data/mixture.py): a mixture's ``weight``, ``rows`` and ``data.dedup``
give the same rows of each source under SFT, DPO, KTO and GRPO, in each run's log and in ``qlora-kit data``'s
view (issue 72: GRPO and KTO concatenated their sources whatever the recipe said, and KTO's log named its
source None)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from qlora_kit import Recipe
from qlora_kit.data.demo import demo_data_files

ROOT = Path(__file__).resolve().parents[1]
# each objective: its demo recipe, the builtin set whose rows its format holds
OBJECTIVES = {
    "sft": ("demo.yaml", "demo-facts"),
    "dpo": ("demo-dpo.yaml", "demo-preferences"),
    "kto": ("demo-kto.yaml", "demo-feedback"),
    "grpo": ("demo-grpo.yaml", "demo-facts"),
}
SMALL = {  # a step of each on the tiny builtin model in seconds
    "sft": {},
    "dpo": {},
    "kto": {},
    "grpo": {"grpo.num_generations": 2, "grpo.max_completion_length": 2},
}
# a source's line in the run's log and the data view: its name, its rows in the mixture and its repeats
LINE = re.compile(
    r"(?P<name>[\w.]+\.jsonl)[^:]*: .*; (?P<taken>\d+) rows in the mixture, (?P<repeats>\d+) left out"
)


def two_sources(folder: Path, builtin: str) -> tuple[str, str]:
    """Source a: 12 rows of the builtin set and 4 of them again (16, of which 12 differ); source b: the
    next 36 rows, none like a's. The same shape in every objective's format."""
    rows = [json.loads(line) for line in demo_data_files(builtin)[0].read_text().splitlines()]
    first, second = rows[:12] + rows[:4], rows[12:48]
    assert len({json.dumps(r) for r in first + second}) == 48
    paths = []
    for name, part in (("a.jsonl", first), ("b.jsonl", second)):
        path = folder / name
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        paths.append(str(path))
    return paths[0], paths[1]


def mixture_recipe(objective: str, folder: Path, weights: dict, **more) -> Recipe:
    recipe_file, builtin = OBJECTIVES[objective]
    folder.mkdir(parents=True, exist_ok=True)
    a, b = two_sources(folder, builtin)
    values = {
        "data.path": None,
        "data.sources": [{"path": a, **weights["a"]}, {"path": b, **weights["b"]}],
        "data.dedup": True,
        "data.packing": False,
        "data.val_fraction": 0.0,
        "train.output_dir": str(folder / "run"),
        "train.sample_prompts": 0,
        "train.eval_steps": None,
        "train.micro_batch_size": 4,
        **SMALL[objective],
        **more,
    }
    return Recipe.from_yaml(ROOT / "recipes" / recipe_file, overrides=values)


def counts(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Each source's (rows in the mixture, rows left out as repeats), from the report's lines."""
    found = {}
    for line in lines:
        match = LINE.search(line)
        if match:
            found[match["name"]] = (int(match["taken"]), int(match["repeats"]))
    return found


ROWS_AND_WEIGHT = {"a": {"rows": 20}, "b": {"weight": 1}}
# a: all 16 rows and 4 again, 8 of the 20 repeats; b: its 36 rows, the only weighted source
ROWS_AND_WEIGHT_COUNTS = {"a.jsonl": (20, 8), "b.jsonl": (36, 0)}


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_weights_rows_and_dedup_give_every_objective_the_same_rows_of_each_source(
    objective, tmp_path, tokenizer
):
    """1:3 weights share the 52 rows 13:39 (b repeats 3 of its 36 rows to give 39, which data.dedup leaves
    out again); each objective's own data path counts as SFT's."""
    from qlora_kit.training.objective_trainer import builder

    weights = {"a": {"weight": 1}, "b": {"weight": 3}}
    found = {}
    for name in ("sft", objective):
        recipe = mixture_recipe(name, tmp_path / name, weights)
        prepared = builder(recipe).prepare(recipe, tokenizer)
        found[name] = counts([report.summary() for report in prepared.train_reports])
    assert found["sft"]["a.jsonl"][0] == 13 and found["sft"]["b.jsonl"] == (39, 3)
    assert found[objective] == found["sft"]
    assert len(prepared.train) == 52 - sum(repeats for _, repeats in found["sft"].values())


@pytest.mark.slow  # a step of each objective's Trainer
@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_a_run_trains_the_mixture_the_data_view_shows(objective, tmp_path, tokenizer, caplog):
    """A step of each objective on a capped, weighted, deduplicated two-source mixture: the run's log
    names each source with the rows it took and left out as repeats, and ``qlora-kit data`` says the same."""
    from qlora_kit import train
    from qlora_kit.data.report import inspect_data

    recipe = mixture_recipe(objective, tmp_path, ROWS_AND_WEIGHT, **{"train.max_steps": 1})
    with caplog.at_level(logging.INFO, logger="qlora_kit.training.pipeline"):
        train(recipe)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data ")]
    assert counts(logged) == ROWS_AND_WEIGHT_COUNTS, logged
    assert not any("data None" in line for line in logged), logged
    view = inspect_data(recipe, tokenizer, count=1)
    assert counts([report.summary() for report in view.reports]) == ROWS_AND_WEIGHT_COUNTS
