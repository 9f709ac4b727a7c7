"""Out-of-memory recovery (train.on_oom: split) against runs that never ran out: steps, examples per step,
the loss curve, and the time the failed attempts cost.

A CPU has no device memory to run out of, so the fault injector (``QLORA_KIT_OOM_CAP_BYTES``,
testing/oom_faults.py) raises a real ``torch.OutOfMemoryError`` when a forward pass saves more than a cap.
The data are 39 short rows and one long one (--smoke: 15 and one, two steps); the cap is 1.5 times the largest forward pass of 4 rows,
so only a micro-batch of 8 holding the long row passes it. Three runs, bf16 autocast through the Trainer:
micro-batch 4 with accumulation 2 (the reference the split run should follow), micro-batch 8 uncapped,
and micro-batch 8 capped, which splits at the step of the long row and keeps micro-batch 4 from there.

    python benchmarks/oom_recovery.py
    python benchmarks/oom_recovery.py --smoke --out /tmp/x
"""

from __future__ import annotations

import json
import os

from common import markdown_table, parser, scratch_folder, write_result

SHORT_ROWS = 39
# --smoke: two steps of 8 rows, one of them the long row's, so the capped run still splits
SMOKE_SHORT_ROWS, SMOKE_STEPS = 15, 2


def rows(short_rows: int) -> list[dict]:
    short = [
        {"instruction": f"Repeat the number {i}.", "input": "", "output": str(i)} for i in range(short_rows)
    ]
    long = {"instruction": "Repeat: " + " ".join(f"w{i}" for i in range(40)), "input": "", "output": "ok"}
    middle = (short_rows + 1) // 2
    return [*short[:middle], long, *short[middle:]]


def train_run(steps: int, micro_batch: int, grad_accum: int, cap: int | None, short_rows: int):
    from qlora_kit import Recipe, train
    from qlora_kit.testing import faults, oom_faults

    faults.install()  # the injector's caps in force through the run's fault seam

    folder = scratch_folder("oom-bench-")
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(short_rows)))
    os.environ[oom_faults.ENV] = "" if cap is None else str(cap)
    oom_faults.INJECTOR.peaks.clear()
    recipe = Recipe.from_dict(
        {
            "data": {"path": str(data), "packing": False, "max_seq_len": 128},
            "memory": {"checkpointing": "none"},
            "optimizer": {"lr": 1.0e-3},
            "train": {
                "max_steps": steps, "logging_steps": 1, "micro_batch_size": micro_batch,
                "grad_accum": grad_accum, "mixed_precision": "bf16", "output_dir": str(folder / "out"),
                "report_to": [], "sample_prompts": 0,
            },
        }
    )  # fmt: skip
    return train(recipe), list(oom_faults.INJECTOR.peaks)


def per_step_tokens(metrics: list[dict]) -> list[int]:
    """Trained tokens of each optimizer step (the log's running count, differenced)."""
    from qlora_kit.registries import metric_keys as keys

    so_far = [int(row[keys.TRAINED_TOKENS]) for row in metrics if keys.TRAINED_TOKENS in row]
    return [b - a for a, b in zip([0, *so_far], so_far, strict=False)]


def main() -> None:
    from qlora_kit.registries import metric_keys as keys

    options = parser(__doc__)
    options.add_argument("--steps", type=int, default=10)
    args = options.parse_args()
    short_rows = SMOKE_SHORT_ROWS if args.smoke else SHORT_ROWS
    if args.smoke:
        args.steps = SMOKE_STEPS
    reference, peaks = train_run(args.steps, 4, 2, 10**15, short_rows)  # armed, never reached: measures
    cap = int(1.5 * max(peaks))
    runs = {
        "micro-batch 4 x accumulation 2": (reference, 8),
        "micro-batch 8, uncapped": (train_run(args.steps, 8, 1, None, short_rows)[0], 8),
        "micro-batch 8, capped (splits)": (train_run(args.steps, 8, 1, cap, short_rows)[0], 8),
    }
    capped = runs["micro-batch 8, capped (splits)"][0]
    k = next((row["step"] for row in capped.metrics if keys.OOM_SPLIT in row), 1)
    uncapped_tokens = per_step_tokens(runs["micro-batch 8, uncapped"][0].metrics)
    table_rows = []
    for name, (result, rows_per_step) in runs.items():
        splits = [row for row in result.metrics if keys.OOM_SPLIT in row]
        diff = max(
            abs(a - b)
            for a, b in zip(result.train_losses[k - 1 :], reference.train_losses[k - 1 :], strict=True)
        )
        lost = sum(row[keys.OOM_SPLIT].get(keys.LOST_SECONDS, 0.0) for row in splits)
        table_rows.append(
            [
                name,
                str(result.steps),
                str(rows_per_step),
                "yes" if per_step_tokens(result.metrics) == uncapped_tokens else "no",
                str(splits[0]["step"]) if splits else "-",
                f"{diff:.4f}",
                f"{result.memory[keys.TRAIN_SECONDS]:.1f}",
                f"{lost:.2f}",
            ]
        )
    header = [
        "run", "optimizer steps", "rows per step", "trained tokens of each step as uncapped", "split at step",
        "max loss difference to micro-batch 4 x 2 from the split on", "train s", "s lost to failed attempts",
    ]  # fmt: skip
    notes = (
        f"{args.steps} optimizer steps, {short_rows + 1} rows ({short_rows} short, one long), bf16 autocast on the CPU, cap {cap:,} "
        "bytes saved for backward. From the split on the capped run computes what micro-batch 4 x 2 does (its "
        "difference there is the bf16 rounding the two runs accumulated before the split, as the uncapped "
        "micro-batch 8 run's is); its steps and the trained tokens of each step are the uncapped run's. The "
        "time lost is the failed attempt, from its start to the error and the release of its memory (a "
        "garbage collection); train seconds run from the first forward pass to the last backward pass."
    )
    import torch

    write_result(
        "oom-recovery-gpu" if torch.cuda.is_available() else "oom-recovery-cpu",
        "Out-of-memory recovery: a capped run against uncapped ones",
        markdown_table(header, table_rows),
        notes,
        args.out,
    )


if __name__ == "__main__":
    main()
