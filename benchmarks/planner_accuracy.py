"""The planner against what a run really saves for backward, on every builtin architecture.

For each of the nine builtin families (Llama, Qwen2, Mistral, Qwen3, Phi-3, Gemma-2, GPT-NeoX, GPT-2,
OLMo-2), each checkpointing policy (none, every 2nd layer, full) and packing off and on, a run is set
up by ``pipeline.build`` (real NF4 layers, peft LoRA r=16 all-linear with dropout 0.05, the run's
checkpointing) and one forward pass at 2 x 512 tokens is measured with ``accounting.SavedTensors``,
without autocast and under the Trainer's bf16 autocast (the GPU's default path). Next to it: the traced
planner's prediction (``memory/tracing.py``) and the Llama-shaped formula it replaced. Last, how long
``plan`` takes for the shipped real-model recipes and a 65B model, offline.

    python benchmarks/planner_accuracy.py
    python benchmarks/planner_accuracy.py --smoke --out /tmp/x   # every_n=2 at 2 x 64 tokens, packing on and off
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import torch
from common import markdown_table, parser, write_result

BATCH, SEQ, SMOKE_SEQ = 2, 512, 64
POLICIES = [("none", 1), ("every_n", 2), ("full", 1)]
MIB = 2**20
RECIPES = [
    "recipes/llama3-8b-alpaca-24gb.yaml",
    "recipes/mistral-7b-alpaca-24gb.yaml",
    "recipes/qwen2.5-7b-alpaca-24gb.yaml",
]


def recipe_for(arch: str, policy: str, every_n: int, packing: bool, out: Path, seq: int):
    from qlora_kit import Recipe

    return Recipe.from_dict(
        {
            "model": {"path": f"builtin:{arch}"},
            "memory": {"checkpointing": policy, "every_n": every_n, "chunked_loss": False},
            "lora": {"dropout": 0.05},
            "data": {"packing": packing, "max_seq_len": seq},
            "train": {"output_dir": str(out), "micro_batch_size": BATCH},
        }
    )


def batch_of(packing: bool, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 600, (BATCH, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if packing:  # as the packing collator hands rows over: restarting positions, no attention mask
        positions = torch.arange(seq).repeat(BATCH, 1)
        positions[:, seq // 2 :] -= seq // 2
        batch["position_ids"] = positions
    return batch


def measure_row(arch: str, policy: str, every_n: int, packing: bool, out: Path, seq: int) -> list[str]:
    from qlora_kit.memory.accounting import measure_saved_bytes
    from qlora_kit.memory.planner import activation_bytes, formula_activation_bytes
    from qlora_kit.memory.shapes import model_shape
    from qlora_kit.training.pipeline import build

    recipe = recipe_for(arch, policy, every_n, packing, out, seq)
    setup = build(recipe)
    shape = model_shape(recipe)
    cells = [arch, policy if policy != "every_n" else f"every_n={every_n}", "on" if packing else "off"]
    for precision in ("no", "bf16"):
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        )
        with autocast:
            saved = measure_saved_bytes(setup.model, batch_of(packing, seq)).total
        traced = activation_bytes(shape, recipe, policy, every_n, BATCH, seq, "cpu", precision=precision)
        formula = formula_activation_bytes(shape, recipe, policy, every_n, BATCH, seq, "cpu").total
        assert traced.source == "traced", f"{arch}: tracing fell back to the formula"
        cells += [
            f"{saved / MIB:.2f}",
            f"{traced.total / MIB:.2f} ({traced.total / saved - 1:+.1%})",
            f"{formula / MIB:.2f} ({formula / saved - 1:+.1%})",
        ]
    return cells


def plan_seconds() -> list[list[str]]:
    from qlora_kit import Recipe
    from qlora_kit.memory.planner import plan

    recipes = [(path, Recipe.from_yaml(path)) for path in RECIPES]
    recipes.append(
        ("huggyllama/llama-65b, 1 x 2048", Recipe.from_dict({"model": {"path": "huggyllama/llama-65b"}}))
    )
    rows = []
    for name, recipe in recipes:
        start = time.perf_counter()
        the_plan = plan(recipe, batch=1 if "65b" in name else None, seq=2048 if "65b" in name else None)
        seconds = time.perf_counter() - start
        rows.append([name, str(the_plan.shape.layers), the_plan.activation_source, f"{seconds:.2f}"])
    return rows


def main() -> None:
    from qlora_kit.model import builtin

    args = parser(__doc__).parse_args()
    policies, seq = ([("every_n", 2)], SMOKE_SEQ) if args.smoke else (POLICIES, SEQ)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in sorted(builtin.TINY_ARCHITECTURES):
            for policy, every_n in policies:
                for packing in (False, True):
                    rows.append(measure_row(arch, policy, every_n, packing, Path(tmp) / "out", seq))
                    print(" | ".join(rows[-1]), flush=True)
    headers = ["model", "policy", "packing"]
    for precision in ("no autocast", "bf16 autocast"):
        headers += [f"measured MiB ({precision})", "traced MiB (error)", "formula MiB (error)"]
    table = markdown_table(headers, rows)
    errors = [float(cell.split("(")[1].rstrip("%)")) for row in rows for cell in (row[4], row[7])]
    timing = markdown_table(["recipe", "layers", "activations", "plan seconds"], plan_seconds())
    write_result(
        "planner-accuracy-cpu",
        "Planner: predicted vs measured saved-for-backward bytes, per architecture (CPU)",
        f"{table}\n\nLargest traced error: {max(errors, key=abs):+.1f}% (target: every row within +-5%).\n\n"
        f"## Planning time, offline\n\n{timing}",
        f"Batch {BATCH} x {seq} tokens, every position trained, transformers' loss; NF4 + double quant, LoRA r=16 "
        "all-linear (dropout 0.05); each architecture's default attention implementation; models are the "
        "builtin tiny configs (hidden 128, 4 layers). Measured: accounting.SavedTensors on one forward of a run "
        "set up by pipeline.build.",
        args.out,
    )


if __name__ == "__main__":
    main()
