"""What checkpointing and the chunked loss head save, and what they cost, on the CPU.

A model small enough for 2 cores but where activations dominate: 8 decoder layers, hidden 512,
batch 4 x 512 tokens, random init, NF4 + double quantization, LoRA r=16 on every linear. For each
setting it measures the bytes saved for backward (``accounting.SavedTensors``) and the step time
(forward + backward + paged 8-bit AdamW step; median of several steps after a warm-up step, the
settings interleaved round by round) next to the planner's prediction.

Part 1 (checkpointing, vocabulary 8,000, transformers' own loss): none / every 2nd / full /
full + offload. Part 2 (the loss head, vocabulary 32,000, full checkpointing): the chunked loss
on and off.

``--real-model``: the same measurements on the pretrained SmolLM2-135M-Instruct (30 layers, hidden
576, vocabulary 49,152, tied head), batch 2 x 256 tokens: each policy with its default loss head
(chunked) and full checkpointing with transformers' loss, in one table.

    python benchmarks/memory.py [--rounds 5]
    python benchmarks/memory.py --real-model [--rounds 3]
    python benchmarks/memory.py --smoke --out /tmp/x   # one round; 2 layers, hidden 64, 2 x 64 tokens
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import (
    REAL_MODEL,
    device_name,
    markdown_table,
    parser,
    profiled_step,
    real_model_dir,
    timed_step,
    write_result,
)

MIB = 2**20


@dataclass(frozen=True)
class Size:
    """The model, the batch (rows of ``seq`` tokens) and the vocabularies of part 1 and part 2."""

    shape: dict = field(
        default_factory=lambda: {
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
        }
    )
    batch: int = 4
    seq: int = 512
    vocab: int = 8000  # part 1
    large_vocab: int = 32000  # part 2
    model_dir: str | None = None  # a pretrained model's folder instead of the random tiny Llama
    compute_dtype: str = "bfloat16"  # float32 on CPUs without AVX512-BF16 (they emulate bf16 matmuls)


SMOKE = Size(
    {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4},
    batch=2,
    seq=64,
    vocab=1000,
    large_vocab=4000,
)  # fmt: skip


def build(name: str, vocab: int, memory_fields: dict, out: Path, size: Size):
    """The policy's run set up by pipeline.build, as `qlora-kit train` sets it up."""
    from qlora_kit import Recipe
    from qlora_kit.model import builtin
    from qlora_kit.training.pipeline import build as build_run

    folder = size.model_dir or builtin.ensure_tiny_model("tiny-llama", **size.shape, vocab_size=vocab)
    recipe = Recipe.from_dict(
        {
            "model": {"path": str(folder)},
            "memory": memory_fields,
            "data": {"packing": False, "max_seq_len": size.seq},
            "quant": {"compute_dtype": size.compute_dtype},
            "train": {
                "output_dir": str(out / name),
                "micro_batch_size": size.batch,
                "max_steps": 1000,
                "compile": False,
            },
        }
    )
    trainer = build_run(recipe).trainer
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    # One fixed batch of seq tokens per row, stepped by hand so the policies interleave.
    ids = torch.randint(0, vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(1))
    return recipe, trainer, {"input_ids": ids, "labels": ids.clone()}


def measure(settings: dict, vocab: int, rounds: int, out: Path, size: Size, keep_runs: bool = False) -> dict:
    from qlora_kit.memory.planner import activation_bytes
    from qlora_kit.memory.shapes import model_shape

    runs = {name: build(name, vocab, fields, out, size) for name, fields in settings.items()}
    times = {name: [] for name in settings}
    for round_index in range(rounds + 1):  # round 0 warms up and is not counted
        for name, (_, trainer, batch) in runs.items():
            _, seconds = timed_step(trainer, batch)
            if round_index:
                times[name].append(seconds)
    results = {}
    for name, (recipe, trainer, _) in runs.items():
        saved = trainer.memory_monitor.largest
        memory_fields = recipe.memory
        predicted = activation_bytes(
            model_shape(recipe),
            recipe,
            memory_fields.checkpointing,
            memory_fields.every_n,
            size.batch,
            size.seq,
            device="cpu",
        )
        results[name] = {
            "saved": saved,
            "time": statistics.median(times[name]),
            "predicted": predicted,
            "recipe": recipe,
        }
    if keep_runs:  # for a profile of the same setups
        results["runs"] = runs
    return results


def measured_cells(r: dict, base_time: float, ratio_digits: int) -> list[str]:
    """Saved MiB, planner MiB (with its error), median step and the step's ratio to a baseline."""
    saved, predicted = r["saved"].total, r["predicted"].total
    return [
        f"{saved / MIB:.1f}",
        f"{predicted / MIB:.1f} ({predicted / saved - 1:+.1%})",
        f"{r['time']:.2f}",
        f"{r['time'] / base_time:.{ratio_digits}f}x",
    ]


def policy_table(results: dict, first_column: str) -> str:
    """Each setting's saved bytes (and against none's), the planner's figure and the step time."""
    base_time, base_saved = results["none"]["time"], results["none"]["saved"].total
    rows = []
    for name, r in results.items():
        saved, planned, step, ratio = measured_cells(r, base_time, ratio_digits=2)
        rows.append([name, saved, f"{r['saved'].total / base_saved:.3f}", planned, step, ratio])
    header = [first_column, "saved for backward (MiB)", "vs none", "planner (MiB)", "median step (s)"]
    return markdown_table([*header, "time vs none"], rows)


def checkpointing_table(results: dict, size: Size) -> tuple[str, str]:
    from qlora_kit.memory.accounting import OUTSIDE

    base_time = results["none"]["time"]
    full = results["full"]["saved"]
    c = 2  # bf16
    layers, hidden = size.shape["num_hidden_layers"], size.shape["hidden_size"]
    batch, seq = size.batch, size.seq
    floor = layers * batch * seq * hidden * c + full.per_layer[OUTSIDE]
    table = policy_table(results, "policy")
    notes = (
        f"Floor for full checkpointing = the decoder layers' inputs ({layers} x {batch}x{seq}x{hidden} bf16 = "
        f"{layers * batch * seq * hidden * c / MIB:.1f} MiB) + what the final norm and the loss keep "
        f"({full.per_layer[OUTSIDE] / MIB:.1f} MiB) = {floor / MIB:.1f} MiB; full keeps {full.total / floor:.3f}x the floor "
        f"(target <= 1.15x). Step time of full: {results['full']['time'] / base_time:.2f}x none (target <= 1.25x). "
        "Offload keeps checkpointed inputs in pinned host memory on a GPU; on the CPU they already are in host "
        "memory, so it is a no-op here and measures the same."
    )
    return table, notes


def loss_head_table(results: dict, vocab: int, size: Size) -> tuple[str, str]:
    plain, chunked = results["full, transformers loss"], results["full, chunked loss"]
    rows = [[name, *measured_cells(r, plain["time"], ratio_digits=3)] for name, r in results.items()]
    layers, hidden, c = size.shape["num_hidden_layers"], size.shape["hidden_size"], 2
    chunk = chunked["recipe"].memory.loss_chunk_tokens
    n = size.batch * size.seq
    reference = layers * n * hidden * c + n * hidden * 4 + chunk * vocab * 4
    table = markdown_table(
        ["setting", "saved for backward (MiB)", "planner (MiB)", "median step (s)", "time vs unchunked"], rows
    )
    notes = (
        f"Vocabulary {vocab:,}, full checkpointing, chunks of {chunk} tokens. Reference = decoder-layer inputs "
        f"({layers * n * hidden * c / MIB:.1f} MiB) + final hidden states ({n * hidden * 4 / MIB:.1f} MiB, fp32 at the "
        f"final norm) + one chunk of fp32 logits ({chunk * vocab * 4 / MIB:.1f} MiB) = {reference / MIB:.1f} MiB; "
        f"with both, saved = {chunked['saved'].total / reference:.3f}x the reference (target <= 1.15x); step time "
        f"{chunked['time'] / plain['time']:.3f}x the unchunked step (target <= 1.05x)."
    )
    return table, notes


def profile_table(runs: dict, top: int) -> tuple[str, str]:
    """Full checkpointing against none, op by op: where full's extra seconds go. The recompute repeats the
    forward pass's ops (more calls of the same ops); checkpoint's machinery is its saved-tensor hooks and
    bookkeeping in Python, outside any op (the step's wall time less all ops' self time)."""
    (none_ops, none_wall), (full_ops, full_wall) = (
        profiled_step(runs[n][1], runs[n][2]) for n in ("none", "full")
    )
    names = set(none_ops) | set(full_ops)
    zero = (0.0, 0)
    extra = sorted(names, key=lambda op: full_ops.get(op, zero)[0] - none_ops.get(op, zero)[0], reverse=True)
    rows = []
    for op in extra[:top]:
        (a, a_calls), (b, b_calls) = none_ops.get(op, zero), full_ops.get(op, zero)
        rows.append([f"`{op}`", f"{a:.3f}", f"{b:.3f}", f"{b - a:+.3f}", f"{a_calls:,}", f"{b_calls:,}"])
    none_total, full_total = (sum(t for t, _ in ops.values()) for ops in (none_ops, full_ops))
    rows.append(
        ["all ops", f"{none_total:.3f}", f"{full_total:.3f}", f"{full_total - none_total:+.3f}", "", ""]
    )
    outside = (none_wall - none_total, full_wall - full_total)
    rows.append(
        [
            "outside ops (Python)",
            f"{outside[0]:.3f}",
            f"{outside[1]:.3f}",
            f"{outside[1] - outside[0]:+.3f}",
            "",
            "",
        ]
    )
    rows.append(
        ["step (wall)", f"{none_wall:.3f}", f"{full_wall:.3f}", f"{full_wall - none_wall:+.3f}", "", ""]
    )
    table = markdown_table(
        ["op", "none (s)", "full (s)", "full - none (s)", "calls, none", "calls, full"], rows
    )
    note = (
        f"Profile: one step each of none and full (chunked head) under torch's profiler (its own overhead "
        f"included), the {top} ops whose self CPU time full adds most first; full's step is "
        f"{full_wall / none_wall:.2f}x none's here, {(full_total - none_total) / max(full_wall - none_wall, 1e-9):.0%} "
        "of the difference in ops (the recompute) and the rest outside them."
    )
    return table, note


def main_real_model(args) -> None:
    """Every policy on the pretrained model, its vocabulary 49,152 (the chunked head on by default)."""
    from transformers import AutoConfig

    folder = real_model_dir()
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    batch, seq = (1, 32) if args.smoke else (2, 256)
    size = Size(
        {}, batch, seq, vocab, large_vocab=vocab, model_dir=str(folder), compute_dtype=args.compute_dtype
    )
    rounds = 1 if args.smoke else (args.rounds or 3)
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(
            {
                "none": {"checkpointing": "none"},
                "every_2": {"checkpointing": "every_n", "every_n": 2},
                "full": {"checkpointing": "full"},
                "none, transformers loss": {"checkpointing": "none", "chunked_loss": False},
                "full, transformers loss": {"checkpointing": "full", "chunked_loss": False},
            },
            vocab=vocab,
            rounds=rounds,
            out=Path(tmp),
            size=size,
            keep_runs=True,
        )
        profile, profile_note = profile_table(results.pop("runs"), args.top)
    chunked, plain = results["full"], results["full, transformers loss"]
    notes = (
        f"SmolLM2-135M-Instruct (builtin:{REAL_MODEL}: 30 layers, hidden 576, vocabulary {vocab:,}, tied head), "
        f"pretrained weights; batch {size.batch} x {size.seq} tokens, every position trained; NF4 + double quant "
        f"({size.compute_dtype} compute), "
        "LoRA r=16 all-linear (dropout 0.05), paged AdamW 8-bit; the chunked loss head on (the default) unless "
        f"named; {rounds} interleaved rounds after a warm-up. Under full checkpointing the chunked head keeps "
        f"{chunked['saved'].total / plain['saved'].total:.2f}x what transformers' loss keeps, at "
        f"{chunked['time'] / plain['time']:.2f}x its step time (its head runs again in backward, chunk by "
        f"chunk; without it full costs {plain['time'] / results['none, transformers loss']['time']:.2f}x none).\n\n"
        + profile_note
    )
    write_result(
        f"memory-real{'-float32' if size.compute_dtype == 'float32' else ''}-{device_name()}",
        "Memory on a real model: checkpointing policies and the loss head",
        policy_table(results, "setting") + "\n\n" + profile,
        notes,
        args.out,
    )


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--rounds", type=int, default=None, help="default: 5, or 3 with --real-model")
    options.add_argument(
        "--compute-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="float32 on CPUs without AVX512-BF16 (they emulate bf16 matmuls: 11x slower, ops in other shares)",
    )
    options.add_argument("--top", type=int, default=12, help="--real-model: ops in the profile table")
    args = options.parse_args()
    if args.real_model:
        main_real_model(args)
        return
    args.rounds = args.rounds or 5
    size, rounds = (SMOKE, 1) if args.smoke else (Size(), args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        part1 = measure(
            {
                "none": {"checkpointing": "none", "chunked_loss": False},
                "every_2": {"checkpointing": "every_n", "every_n": 2, "chunked_loss": False},
                "full": {"checkpointing": "full", "chunked_loss": False},
                "full + offload": {
                    "checkpointing": "full",
                    "offload_activations": True,
                    "chunked_loss": False,
                },
            },
            vocab=size.vocab,
            rounds=rounds,
            out=out,
            size=size,
        )
        part2 = measure(
            {
                "full, transformers loss": {"checkpointing": "full", "chunked_loss": False},
                "full, chunked loss": {"checkpointing": "full", "chunked_loss": True},
            },
            vocab=size.large_vocab,
            rounds=rounds,
            out=out,
            size=size,
        )
    table1, notes1 = checkpointing_table(part1, size)
    table2, notes2 = loss_head_table(part2, size.large_vocab, size)
    shape = ", ".join(f"{k}={v}" for k, v in size.shape.items())
    write_result(
        "memory-cpu",
        "Memory: checkpointing policies and the chunked loss head (CPU)",
        f"## Checkpointing (vocabulary {size.vocab:,})\n\n{table1}\n\n{notes1}\n\n"
        f"## Loss head (vocabulary {size.large_vocab:,})\n\n{table2}\n\n{notes2}",
        f"Model: tiny Llama {shape}; batch {size.batch} x {size.seq} tokens, every position trained; NF4 + double "
        f"quant, LoRA r=16 all-linear (dropout 0.05), paged AdamW 8-bit; {rounds} interleaved rounds after a warm-up.",
        args.out,
    )


if __name__ == "__main__":
    main()
