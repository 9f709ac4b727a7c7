"""Step time and bytes saved for backward per attention kernel, packing off and on (CPU).

The kernels that train on a CPU, sdpa and eager, on a tiny Llama where attention matters (4 layers,
hidden 256, 4 x 512 tokens), each run set up by ``pipeline.build`` and stepped by hand (forward,
backward, paged AdamW 8-bit step; median of interleaved rounds after a warm-up). Packing on: the same
tokens as rows of four 128-token examples with restarting position ids (transformers then builds a
block-diagonal mask); off: one 512-token causal sequence a row. flex_attention and the flash kernels
do not train on a CPU (FlexAttention has no CPU backward in torch 2.13; flash kernels are CUDA-only):
``benchmarks/gpu_check.sh`` measures them when a GPU is lent.

    python benchmarks/attention.py [--rounds 5]
    python benchmarks/attention.py --smoke --out /tmp/x   # one round, hidden 64, 2 x 128 tokens
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import markdown_table, parser, timed_step, write_result

KERNELS = ["sdpa", "eager"]
MIB = 2**20


@dataclass(frozen=True)
class Size:
    """The model and the batch: rows of ``seq`` tokens, packed as examples of ``example`` tokens."""

    shape: dict = field(
        default_factory=lambda: {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    )
    batch: int = 4
    seq: int = 512
    example: int = 128


SMOKE = Size({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}, 2, 128, 32)


def build(kernel: str, packing: bool, out: Path, size: Size):
    from qlora_kit import Recipe
    from qlora_kit.model import builtin
    from qlora_kit.training.pipeline import build as build_run

    folder = builtin.ensure_tiny_model("tiny-llama", **size.shape, max_position_embeddings=size.seq)
    recipe = Recipe.from_dict(
        {
            "model": {"path": str(folder), "attn_implementation": kernel},
            "memory": {"checkpointing": "none", "chunked_loss": False},
            "data": {"packing": packing, "max_seq_len": size.seq},
            # eager kernels compared: compile.py measures train.compile (auto would time a compile here)
            "train": {
                "output_dir": str(out),
                "micro_batch_size": size.batch,
                "max_steps": 1000,
                "compile": False,
            },
        }
    )
    trainer = build_run(recipe).trainer
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    ids = torch.randint(5, 600, (size.batch, size.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packing:
        batch["position_ids"] = torch.arange(size.seq).remainder(size.example).repeat(size.batch, 1)
        batch["labels"][:, :: size.example] = -100  # the first token of each example is not predicted
    return recipe, trainer, batch


def main() -> None:
    from qlora_kit.memory.accounting import measure_saved_bytes
    from qlora_kit.memory.planner import activation_bytes
    from qlora_kit.memory.shapes import model_shape

    options = parser(__doc__)
    options.add_argument("--rounds", type=int, default=5)
    args = options.parse_args()
    size, rounds = (SMOKE, 1) if args.smoke else (Size(), args.rounds)
    settings = [(kernel, packing) for kernel in KERNELS for packing in (False, True)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {s: build(*s, Path(tmp) / f"{s[0]}-{s[1]}", size) for s in settings}
        times = {s: [] for s in settings}
        for round_index in range(rounds + 1):  # round 0 warms up
            for s, (_, trainer, batch) in runs.items():
                _, seconds = timed_step(trainer, batch)
                if round_index:
                    times[s].append(seconds)
        rows = []
        base = statistics.median(times["sdpa", False])
        for (kernel, packing), (recipe, trainer, batch) in runs.items():
            saved = measure_saved_bytes(trainer.model, batch).total
            planned = activation_bytes(
                model_shape(recipe), recipe, "none", 1, size.batch, size.seq, "cpu"
            ).total
            median = statistics.median(times[kernel, packing])
            rows.append(
                [
                    kernel,
                    "on" if packing else "off",
                    f"{saved / MIB:.1f}",
                    f"{planned / MIB:.1f} ({planned / saved - 1:+.1%})",
                    f"{median:.3f}",
                    f"{median / base:.2f}x",
                ]
            )
    table = markdown_table(
        [
            "kernel",
            "packing",
            "saved for backward (MiB)",
            "planner (MiB)",
            "median step (s)",
            "vs sdpa unpacked",
        ],
        rows,
    )
    write_result(
        "attention-cpu",
        "Attention kernels: step time and saved bytes, packing off and on (CPU)",
        table,
        f"Tiny Llama {size.shape}, {size.batch} x {size.seq} tokens (packed: rows of {size.seq // size.example} "
        f"{size.example}-token examples), NF4 + double quant, LoRA r=16 all-linear, no checkpointing, "
        f"transformers' loss; {rounds} interleaved rounds after a "
        "warm-up. sdpa on packed rows gets a dense block-diagonal mask, which keeps it off its fused "
        "unmasked path and repeats K/V to every head (native GQA needs no mask); eager keeps the score "
        "matrix either way. flex_attention does not train on a CPU (no CPU backward in torch 2.13).",
        args.out,
    )


if __name__ == "__main__":
    main()
