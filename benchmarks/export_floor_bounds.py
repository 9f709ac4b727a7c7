"""Export floor bounds: the bounds the parity report derives for a file against its floor, on the real model.

The report derives how far a reader may read an export from its floor (after/parity_judgement.py) from
the reader's arithmetic, the products the error passes through and the floor's own log-probabilities at
the answers. Two ways to see those bounds against what files really do:

- ``--untrained``: the bounds alone, on the model's own weights (no adapter: the floor is the base
  rounded into q8_0 and f16) over the sweep's 16 held-out rows, for each reader and type, with what
  they are made of (products, q8_0 peak ratio, the log-probabilities' variance). Minutes on 2 cores.
- otherwise, the first ``--adapters`` adapters of export_calibration.py's grid trained, each exported
  as a q8_0 GGUF, right and with the update x 0.9 and x 0.5, read by every reader; each comparison's KL
  over the bound the report derived for it, and its verdict.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REAL_MODEL, device_name, markdown_table, parser, scratch_folder, write_result
from benchmarks.export_calibration import (
    GGUF_CANDIDATES,
    GRID,
    PROMPTS,
    adapter_recipe,
    chat_files,
    gguf_rows,
)
from benchmarks.export_calibration import train_adapter as trained

CANDIDATES = (*GGUF_CANDIDATES, ("q8_0 GGUF, update x 0.5", False, 0.5))
READERS = (("transformers", "q8_0"), ("llama.cpp", "f16"), ("llama.cpp", "q8_0"))


def untrained_bounds(args, model: str, work: Path, data: tuple[Path, Path]) -> tuple[list, str]:
    """Per (reader, type): the bound a file of that type is held to against its floor, the model's base
    rounded into the type standing for the floor."""
    from qlora_kit.after import drift_bounds, floor, parity
    from qlora_kit.after.parity_judgement import FloorBounds, reader_variance
    from qlora_kit.model import loading

    recipe = adapter_recipe(GRID[0], work / "untrained", data, model)
    tokenizer = loading.load_tokenizer(recipe.model)
    pairs, _ = parity.prompt_pairs(recipe, tokenizer, None, PROMPTS)
    rows = []
    for kind in dict.fromkeys(kind for _, kind in READERS):
        lm = floor.round_into(floor.merged_model(recipe, None, "dequantized"), kind)
        peaks = drift_bounds.BlockPeaks(lm)
        reader = parity.TransformersModel(lm, tokenizer)
        asked = [
            (parity.training_ids(tokenizer, prompt), tokenizer(answer, add_special_tokens=False)["input_ids"])
            for prompt, answer in pairs
        ]
        logits = [reader.answer_logits(ids, answer) for ids, answer in asked]
        peaks.remove()
        rounding = drift_bounds.RoundedInputs(lm)  # llama.cpp's q8_0 input rounding, in memory
        rounded = [reader.answer_logits(ids, answer) for ids, answer in asked]
        rounding.remove()
        measured = float(
            torch.cat([parity.kl_per_position(f, r) for f, r in zip(logits, rounded, strict=True)]).mean()
        )
        passes = drift_bounds.rounding_passes(lm.config)
        log_probs = torch.cat(logits).double().log_softmax(-1)
        # Var_p(log p), the spread the KL's second-order term scales (at a relative variance of 2: x 1)
        spread = float(drift_bounds.kl_of_relative_error(log_probs, 2.0).mean())
        modelled = FloorBounds(kind, passes, logits, peaks.ratio())
        bounds = FloorBounds(kind, passes, logits, peaks.ratio(), rounded if kind == "q8_0" else None)
        for name in (r for r, k in READERS if k == kind):
            variance = reader_variance(kind, name, peaks.ratio())
            rows.append([name, kind, passes, f"{peaks.ratio():.2f}", f"{variance:.3g}", f"{spread:.3g}"])
            rows[-1] += [len(log_probs), f"{modelled.max_kl(name) / drift_bounds.SAFETY:.3g}"]
            rows[-1] += [f"{measured:.3g}" if name == "llama.cpp" and kind == "q8_0" else "-"]
            rows[-1].append(f"{bounds.max_kl(name):.3g}")
            print(" | ".join(map(str, rows[-1])), flush=True)
        del lm, reader
        floor.free_memory()
    columns = ["reader", "type", "products", "q8_0 peak ratio", "variance a product"]
    columns += ["mean Var(log p)", "answer positions", "modelled KL", "measured q8_0 inputs' KL"]
    columns.append("bound against the floor")
    notes = (
        f"{model.removeprefix('builtin:')} untrained: its weights rounded into each type stand for the floor, "
        f"on export_calibration.py's {PROMPTS} held-out rows; the bound is drift_bounds.SAFETY x the mean "
        "expected KL(floor || file) at the answers (after/parity_judgement.py). Modelled KL: the per-product "
        "model's expectation (each product's relative error reaching the logits whole); measured: the floor "
        "with its linear layers' inputs rounded as llama.cpp's q8_0 products round them (drift_bounds."
        "RoundedInputs), which the bound for llama.cpp reading q8_0 counts in place of the modelled share."
    )
    return [markdown_table(columns, rows)], notes


def exported_bounds(args, model: str, work: Path, data: tuple[Path, Path]) -> tuple[list, str]:
    """The first --adapters adapters' q8_0 GGUFs, right and wrong, each comparison's KL over its bound."""
    rows, ratios = [], {}
    for index, adapter in enumerate(GRID[: args.adapters]):
        run = trained(adapter, work / f"run-{index}", data, model)
        readers = ("transformers", "llama.cpp")
        for label, correct, c in gguf_rows(run, work / f"export-{index}", readers, CANDIDATES):
            allowed = c["floor"]["max_kl"]
            rows.append([adapter.name, label, c["reader"], c["against"], f"{c['top1_agreement']:.1%}"])
            rows[-1] += [f"{c['mean_kl']:.3g}", f"{allowed:.3g}", f"{c['mean_kl'] / allowed:.3g}"]
            rows[-1] += ["refused" if c["failures"] else "passes", c["positions"]]
            ratios.setdefault((c["reader"], c["against"], correct), []).append(c["mean_kl"] / allowed)
            print(" | ".join(map(str, rows[-1])), flush=True)
    columns = ["adapter", "export", "reader", "against", "top-1", "mean KL", "allowed", "KL / allowed"]
    summary = []
    for reader, against in dict.fromkeys((r, a) for r, a, _ in ratios):
        worst = max(ratios.get((reader, against, True), [float("nan")]))
        best = min(ratios.get((reader, against, False), [float("nan")]))
        summary.append([reader, against, f"{worst:.3g}", f"{best:.3g}"])
    tables = [
        markdown_table([*columns, "verdict", "positions"], rows),
        markdown_table(
            ["reader", "against", "worst correct KL / allowed", "best wrong KL / allowed"], summary
        ),
    ]
    notes = (
        f"{model.removeprefix('builtin:')}: the first {args.adapters} adapters of export_calibration.py's grid, "
        f"{PROMPTS} held-out rows each; allowed: the bound the report derived (against the floor: the reader's "
        "arithmetic; against the trained model: the floor's own KL plus that). A correct file passes at KL / "
        "allowed <= 1."
    )
    return tables, notes


def main() -> None:
    args = PARSER.parse_args()
    model = f"builtin:{REAL_MODEL}" if args.real_model else "builtin:tiny-llama"
    work = args.work or scratch_folder("export-floor-bounds-")  # named by --work: kept
    work.mkdir(parents=True, exist_ok=True)
    data = chat_files(work)
    measure = untrained_bounds if args.untrained else exported_bounds
    tables, notes = measure(args, model, work, data)
    name = "untrained" if args.untrained else "exported"
    write_result(
        f"export-floor-bounds-{name}{'-real' if args.real_model else ''}-{device_name()}",
        "Export floor bounds: " + ("derived, untrained" if args.untrained else "right and wrong q8_0 GGUFs"),
        "\n\n".join(tables),
        notes,
        args.out,
    )


PARSER = parser(__doc__)
PARSER.add_argument("--untrained", action="store_true", help="the bounds alone, on the model's own weights")
PARSER.add_argument("--adapters", type=int, default=1, help="the grid's first N adapters (not --untrained)")
PARSER.add_argument("--work", type=Path, help="an earlier run's folder of adapters and exports, reused")

if __name__ == "__main__":
    main()
