"""The planner held to a GPU's measurements, not to itself: benchmarks/results/planner-h200-2026-12-04.json.

The table is what ``benchmarks/gpu_check.py`` measured through ``trainer.train()`` on an H200 (a 1B
Llama, 4 x 2,048 tokens, bf16 autocast). The plan is computed here, on the CPU, for ``device=cuda`` from
the same config and batch: the trace runs on fake tensors and calls the kernels CUDA would pick
(``memory/device_kernels.py``), so a 1B config plans in about a second. Every policy's planned peak must
sit within -2%..+5% of the measured one (a plan under the measurement is the one that lets a run run out
of memory), its bytes saved for backward within 0.1%, and the long-context row within +10%.
"""

import json
from pathlib import Path

import pytest
import transformers

from qlora_kit import Recipe
from qlora_kit.memory.device_kernels import FLASH
from qlora_kit.memory.max_length import WAYS, planned_at
from qlora_kit.memory.planner import GIB, plan

TABLE = json.loads(
    (Path(__file__).parents[1] / "benchmarks/results/planner-h200-2026-12-04.json").read_text()
)


@pytest.fixture(scope="module")
def measured_model(tmp_path_factory) -> Path:
    """The measured model's config alone (planning reads no weights)."""
    folder = tmp_path_factory.mktemp("llama-1b")
    transformers.LlamaConfig(**TABLE["model"]).save_pretrained(folder)
    (folder / "rows.jsonl").write_text('{"text": "a row"}\n')
    return folder


def recipe_for(folder: Path, memory: dict, seq: int) -> Recipe:
    """gpu_check.recipe_for's recipe: unpacked text rows, the defaults otherwise."""
    return Recipe.from_dict(
        {
            "model": {"path": str(folder)},
            "memory": memory,
            "data": {
                "path": str(folder / "rows.jsonl"),
                "format": "text",
                "max_seq_len": seq,
                "packing": False,
            },
            "train": {"output_dir": str(folder / "out"), "micro_batch_size": TABLE["batch"]},
        }
    )


@pytest.mark.parametrize("row", TABLE["policies"], ids=lambda row: json.dumps(row["memory"]))
def test_each_policy_plans_within_minus_2_plus_5_percent_of_the_h200(measured_model, row):
    recipe = recipe_for(measured_model, row["memory"], TABLE["seq"])
    # the measured rows are each exactly seq tokens: no padding mask, so CUDA ran its flash kernel
    the_plan = plan(recipe, batch=TABLE["batch"], seq=TABLE["seq"], device="cuda", padded=False)
    chosen = the_plan.chosen(recipe)
    assert the_plan.kernels == (FLASH,)
    assert chosen.activations / 2**20 == pytest.approx(row["saved_mib"], rel=1e-3)
    ratio = chosen.peak / GIB / row["peak_gib"]
    assert 0.98 <= ratio <= 1.05, f"planned {chosen.peak / GIB:.2f} GiB, measured {row['peak_gib']}"


def test_the_long_context_row_plans_within_10_percent_of_the_h200(measured_model):
    row = TABLE["long_context"]
    recipe = recipe_for(measured_model, {}, 64)
    planned = planned_at(recipe, WAYS["full + offload + tiles"], row["seq"], "cuda")
    assert planned.host / GIB == pytest.approx(row["host_gib"], abs=0.01)
    assert 1.0 <= planned.peak / GIB / row["peak_gib"] <= 1.10
