"""Trained-token throughput of padding vs packing vs group_by_length on a variable-length dataset.

Lengths vary 10x (24 to 240 tokens). All three modes train the same tiny 4-bit Llama with LoRA and
the Trainer's own training step, interleaved round by round (A B C A B C ...) after a warm-up round, so
drift of the machine hits all three alike. "Real tokens" are the non-padding tokens a step processes.

    python benchmarks/data_throughput.py [--rounds 4] [--steps 6]
    python benchmarks/data_throughput.py --real-model   # SmolLM2-135M-Instruct and its tokenizer, 128 tokens
    python benchmarks/data_throughput.py --smoke --out /tmp/x   # one round of one step, micro-batch 2, no warm-up
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import REAL_MODEL, device_name, markdown_table, parser, profiled_step, write_result

MODES = {
    "padding": {"data.packing": False},
    "group_by_length": {"data.packing": False, "data.group_by_length": True},
    "packing": {"data.packing": True},
}


def make_dataset(folder: Path, rows: int = 512, seed: int = 0) -> Path:
    """Text rows whose token counts spread from ~24 to ~240."""
    from qlora_kit.model.builtin import corpus_words

    words = corpus_words()
    rng = random.Random(seed)
    path = folder / "variable.jsonl"
    with path.open("w") as handle:
        for _ in range(rows):
            n = rng.randint(12, 120)  # ~2 tokens a word
            handle.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return path


def setup_for(
    name: str,
    fields: dict,
    data_path: Path,
    out: Path,
    batch: int,
    model_path: str | None,
    max_len: int,
    compute_dtype: str,
):
    """A run with these data ``fields`` set up by pipeline.build, as `qlora-kit train` sets it up."""
    from qlora_kit import Recipe
    from qlora_kit.training.pipeline import build as build_run

    overrides = {
        "data.path": str(data_path),
        "data.format": "text",
        "data.max_seq_len": max_len,
        **({"model.path": model_path} if model_path else {}),
        "train.micro_batch_size": batch,
        "train.output_dir": str(out / name),
        "train.max_steps": 10_000,
        "train.compile": False,
        "quant.compute_dtype": compute_dtype,
        **fields,
    }
    return build_run(Recipe.from_dict({}, overrides))


def build(mode: str, *where):
    """The mode's Trainer and its endless batches (``where``: ``setup_for``'s arguments after the fields)."""
    trainer = setup_for(mode, MODES[mode], *where).trainer
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); read by training_step
    # Steps are driven one at a time so the modes interleave (machine noise hits all alike).
    return trainer, endless(trainer.get_train_dataloader())


def auto_choice(*where) -> str:
    """What ``data.packing: auto`` picks on this data (pipeline.build times the layouts), with its figures."""
    setup = setup_for("auto", {"data.packing": "auto"}, *where)
    data, costs = setup.recipe.data, setup.run.layout_costs
    picked = "packing" if data.packing is True else "group_by_length" if data.group_by_length else "padding"
    figures = f"real tokens/s as it timed them: {costs.summary()}; {costs.source}" if costs else "by padding"
    return f"{picked} ({figures})"


def endless(loader):
    while True:
        yield from loader


def real_tokens(batch, pad_token_id: int) -> int:
    # Both collators pad with the pad token, which the text itself never contains.
    return int((batch["input_ids"] != pad_token_id).sum())


def run_steps(trainer, batches, steps: int) -> tuple[float, int, int]:
    """Seconds, real tokens and padded slots for ``steps`` optimizer steps."""
    seconds = real = slots = 0
    for _ in range(steps):
        batch = next(batches)
        start = time.perf_counter()
        trainer.training_step(trainer.model, batch)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        seconds += time.perf_counter() - start
        real += real_tokens(batch, trainer.processing_class.pad_token_id)
        slots += batch["input_ids"].numel()
    return seconds, real, slots


def profile_table(runs: dict, top: int) -> tuple[str, str]:
    """Padding against packing, op by op: each op's self seconds per 1,000 positions (padded slots
    included: what the step computes on), the ops that differ most first."""
    per_k, positions = {}, {}
    for mode in ("padding", "packing"):
        trainer, batches = runs[mode]
        batch = next(batches)
        ops, _ = profiled_step(trainer, batch)
        positions[mode] = batch["input_ids"].numel()
        per_k[mode] = {op: seconds * 1000 / positions[mode] for op, (seconds, _) in ops.items()}
    names = set(per_k["padding"]) | set(per_k["packing"])
    gap = {op: per_k["packing"].get(op, 0.0) - per_k["padding"].get(op, 0.0) for op in names}
    rows = []
    for op in sorted(names, key=lambda op: -abs(gap[op]))[:top]:
        a, b = per_k["padding"].get(op, 0.0), per_k["packing"].get(op, 0.0)
        rows.append([f"`{op}`", f"{a:.4f}", f"{b:.4f}", f"{gap[op]:+.4f}"])
    total = [sum(per_k[mode].values()) for mode in ("padding", "packing")]
    rows.append(["all ops", f"{total[0]:.4f}", f"{total[1]:.4f}", f"{total[1] - total[0]:+.4f}"])
    header = [
        "op (self CPU time)",
        "padding s / 1k positions",
        "packing s / 1k positions",
        "packing - padding",
    ]
    note = (
        f"Profiled: one step of each after the timed rounds ({positions['padding']} positions padded, "
        f"{positions['packing']} packed; a position is a token slot the step computes on, padding included)."
    )
    return markdown_table(header, rows), note


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--rounds", type=int, default=None, help="default: 4, or 2 with --real-model")
    options.add_argument("--steps", type=int, default=None, help="optimizer steps per mode per round (6; 3)")
    options.add_argument("--batch", type=int, default=8)
    options.add_argument("--top", type=int, default=12, help="ops in the profile table (the most different)")
    options.add_argument(
        "--compute-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="float32 on CPUs without AVX512-BF16 (they emulate bf16 matmuls: 11x slower, ops in other shares)",
    )
    args = options.parse_args()
    args.rounds = args.rounds or (2 if args.real_model else 4)
    args.steps = args.steps or (3 if args.real_model else 6)
    if args.smoke:
        args.rounds, args.steps, args.batch = 1, 1, 2
    # The real model's tokenizer makes about 1.3 tokens of a corpus word (the tiny one's about 2): rows of
    # 16-160 tokens, cut at 128.
    model_path, max_len = (f"builtin:{REAL_MODEL}", 128) if args.real_model else (None, 256)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data_path = make_dataset(folder, rows=64 if args.smoke else 512)
        runs = {
            mode: build(mode, data_path, folder, args.batch, model_path, max_len, args.compute_dtype)
            for mode in MODES
        }
        totals = {mode: [0.0, 0, 0] for mode in MODES}
        step_times = {mode: [] for mode in MODES}
        # Round 0 warms up and is not counted; --smoke has none (its figures need only be finite, and the
        # warm-up round would be half its steps).
        for round_index in range(1 if args.smoke else 0, args.rounds + 1):
            for mode, (trainer, batches) in runs.items():
                seconds, real, slots = run_steps(trainer, batches, args.steps)
                if round_index == 0:
                    continue
                totals[mode][0] += seconds
                totals[mode][1] += real
                totals[mode][2] += slots
                step_times[mode].append(seconds / args.steps)
        profile, profile_note = profile_table(runs, args.top)
        del runs  # their models' memory, before auto's run is built
        auto = auto_choice(data_path, folder, args.batch, model_path, max_len, args.compute_dtype)

    padded_rate = totals["padding"][1] / totals["padding"][0]
    rows = []
    for mode, (seconds, real, slots) in totals.items():
        rate = real / seconds
        rows.append(
            [
                mode,
                f"{1 - real / slots:.1%}",
                f"{statistics.median(step_times[mode]):.3f}",
                f"{rate:,.0f}",
                f"{rate / padded_rate:.2f}x",
            ]
        )
    table = markdown_table(["mode", "pad share", "median step (s)", "real tokens/s", "vs padding"], rows)
    fastest = max(totals, key=lambda mode: totals[mode][1] / totals[mode][0])
    table += f"\n\ndata.packing auto picks {auto}; the fastest measured above: {fastest}.\n\n" + profile
    model = (
        f"SmolLM2-135M-Instruct (builtin:{REAL_MODEL}, pretrained, its tokenizer)"
        if args.real_model
        else "Tiny Llama (4 layers, hidden 128)"
    )
    notes = (
        f"{model}, max_seq_len {max_len}, NF4 + double quant ({args.compute_dtype} compute), LoRA r=16 "
        "all-linear, full checkpointing, "
        f"paged AdamW 8-bit, micro-batch {args.batch}, text rows of 12-120 corpus words (24-240 tokens with the tiny tokenizer, cut at max_seq_len); {args.rounds} interleaved "
        f"rounds of {args.steps} steps per mode{'' if args.smoke else ' after a warm-up round'}. Target: packing >= 1.5x padding.\n\n"
        f"{profile_note}"
    )
    real = "-real" if args.real_model else ""
    real += "-float32" if args.compute_dtype == "float32" else ""  # beside the bf16 table, not over it
    title = f"Padding vs packing vs group_by_length{' on a real model' if args.real_model else ''} ({device_name().upper()})"
    write_result(f"data-throughput{real}-{device_name()}", title, table, notes, args.out)


if __name__ == "__main__":
    main()
