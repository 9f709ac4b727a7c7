"""What the training guards cost: step time with and without them, through ``qlora-kit train``'s path.

The guards (qlora_kit/training/step/guards.py) read the device once per optimizer step: the folded loss flag and the
finiteness of the LoRA gradients' total norm, plus, until every LoRA tensor is checked, one batched
read for dead gradients. The loss of each micro-batch is folded into a device flag without a read.
Runs alternate guards on / off, each round a fresh process-local run of the same recipe and seed;
the step time is the run's tokens over its tokens/s (first forward to last backward).

    python benchmarks/guards.py                 # tiny Llama on this machine
    python benchmarks/guards.py --rounds 5 --steps 40 --grad-accum 4
    python benchmarks/guards.py --smoke --out /tmp/x   # one round of one step of one micro-batch of 2 rows
"""

from __future__ import annotations

import statistics

from common import markdown_table, parser, scratch_folder, write_result


def step_seconds(guards: bool, steps: int, grad_accum: int, precision: str, micro_batch: int) -> float:
    from qlora_kit import Recipe
    from qlora_kit.training.pipeline import run

    recipe = Recipe.from_dict(
        {},
        {
            "data.max_seq_len": 128,
            "train.output_dir": str(scratch_folder("guards-bench-") / "out"),  # its lock file beside it
            "train.max_steps": steps,
            "train.micro_batch_size": micro_batch,
            "train.grad_accum": grad_accum,
            "train.logging_steps": steps,
            "train.mixed_precision": precision,
            # named: auto times the layouts in each run and may lay the on and off runs out differently
            "data.packing": True,
        },
    )
    usage = run(recipe, guards=guards).memory
    # first training forward to last backward
    return usage["train_seconds"] / steps


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--rounds", type=int, default=3)
    options.add_argument("--steps", type=int, default=30)
    options.add_argument("--grad-accum", type=int, default=2)
    options.add_argument("--precision", default="auto", help="train.mixed_precision of the runs")
    options.add_argument("--micro-batch", type=int, default=8, help="rows of up to 128 tokens a micro-batch")
    args = options.parse_args()
    if args.smoke:  # the table's form and finite figures: each run's one step times the guards' path
        args.rounds, args.steps, args.grad_accum, args.micro_batch = 1, 1, 1, 2
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for guards in (True, False):
            times[guards].append(
                step_seconds(guards, args.steps, args.grad_accum, args.precision, args.micro_batch)
            )
    on, off = statistics.median(times[True]), statistics.median(times[False])
    rows = [
        ["guards on", f"{on * 1000:.1f}", " ".join(f"{t * 1000:.1f}" for t in times[True])],
        ["guards off", f"{off * 1000:.1f}", " ".join(f"{t * 1000:.1f}" for t in times[False])],
        ["overhead", f"{(on / off - 1) * 100:+.1f}%", ""],
    ]
    table = markdown_table(["run", "median ms / optimizer step", "each round (ms)"], rows)
    notes = (
        f"{args.steps} optimizer steps of {args.grad_accum} micro-batches ({args.micro_batch} rows x up to 128 "
        "tokens, packed), "
        f"mixed precision {args.precision}. On a CPU a device read costs nothing extra, so this measures the "
        "guards' own arithmetic; on a GPU the difference also holds the one host sync per step."
    )
    import torch

    write_result(
        "guards-gpu" if torch.cuda.is_available() else "guards-cpu",
        "Training guards: step time with and without",
        table,
        notes,
        args.out,
    )


if __name__ == "__main__":
    main()
