"""Long context: the longest row each way of keeping activations fits, planned for real GPUs, and on the CPU
the bytes each way keeps on the device (measured against the plan) and its step time.

Table 1, from the configs alone (``qlora-kit plan RECIPE --max-seq-len``'s search, ``memory/max_length.py``):
Llama-3.1-8B on 24 and 80 GiB and Llama-3.3-70B on 80 GiB, micro-batch 1, bf16 autocast, LoRA r=16 on every
linear, the chunked loss head, beside the figures unsloth publishes for its QLoRA (where it publishes one).

Table 2, measured on this machine: one forward and backward of a single row of each length under bf16
autocast (the Trainer's GPU path) through the run's own setup (``pipeline.build``), for checkpointing none,
full, full + offloaded checkpoints, full + offload + the tiled MLP (auto): the bytes saved for backward on
the device (``accounting.SavedTensors``) against the plan's, the offloaded host bytes, and the step's time
against full checkpointing's. ``--real-model`` measures SmolLM2-135M (30 layers, hidden 576); the default
is the tiny Llama at a realistic width.

    python benchmarks/long_context.py --real-model --lengths 1024 2048 4096
    python benchmarks/long_context.py --smoke --out /tmp/x
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch
from common import REAL_MODEL, markdown_table, parser, real_model_dir, write_result

# name -> (recipe fields, GPU GiB, what unsloth publishes for that model and GPU, tokens)
SMOKE_CONFIGS = {"tiny Llama, 0.02 GiB": ("builtin:tiny-llama", 0.02, "-")}
CONFIGS = {
    "Llama-3.1-8B, 24 GiB": ("meta-llama/Llama-3.1-8B", 24, "-"),
    "Llama-3.1-8B, 80 GiB": ("meta-llama/Llama-3.1-8B", 80, "342K (unsloth, 80 GB)"),
    "Llama-3.3-70B, 80 GiB": ("meta-llama/Llama-3.3-70B-Instruct", 80, "89K (unsloth, 80 GB)"),
}
WAYS = {  # name -> memory fields (as max_length.WAYS, less selective: the CPU rows compare with full)
    "none": {"checkpointing": "none"},
    "full": {"checkpointing": "full"},
    "full + offload": {"checkpointing": "full", "offload_activations": True},
    "full + offload + tiles": {"checkpointing": "full", "offload_activations": True, "mlp_tiles": "auto"},
}
MIB = 1024**2


def planned_lengths(smoke: bool) -> list[list[str]]:
    from qlora_kit import Recipe
    from qlora_kit.memory.max_length import WAYS as SEARCHED
    from qlora_kit.memory.max_length import longest_fit

    rows = []
    for name, (path, gib, published) in (SMOKE_CONFIGS if smoke else CONFIGS).items():
        recipe = Recipe.from_dict({"model": {"path": path}, "lora": {"rank": 16}, "data": {"packing": False}})
        # --smoke: the way that uses every piece (each searched length costs seconds of tracing)
        for way in list(SEARCHED)[-1:] if smoke else SEARCHED:
            fit = longest_fit(recipe, way, gib)
            host = f"{fit.host / 1024**3:.1f}" if fit.host else "-"
            rows.append([name, way, f"{fit.seq:,}", f"{fit.device_peak / 1024**3:.1f}", host, published])
    return rows


def measure(
    model_path: str, seq: int, fields: dict, out: str, bf16: bool = True
) -> tuple[int, int, int, float]:
    """(device bytes saved for backward, host bytes, planned device bytes, seconds) of one forward and
    backward of one row of ``seq`` tokens."""
    from qlora_kit import Recipe
    from qlora_kit.memory.accounting import SavedTensors
    from qlora_kit.memory.loss_head import chunked_lm_loss
    from qlora_kit.memory.planner import plan
    from qlora_kit.training import pipeline

    recipe = Recipe.from_dict(
        {
            "model": {"path": model_path},
            "lora": {"rank": 16, "dropout": 0.0},
            "data": {"max_seq_len": seq, "packing": False},
            "memory": fields,
            "quant": {"compute_dtype": "bfloat16" if bf16 else "float32"},
            # eager, as the notes say: under compile auto, build timed steps and compiled the layers it then
            # measured (compile.py measures train.compile)
            "train": {
                "output_dir": out,
                "micro_batch_size": 1,
                "mixed_precision": "bf16" if bf16 else "no",
                "compile": False,
            },
        }
    )
    setup = pipeline.build(recipe)
    model = setup.model
    model.train()
    ids = torch.randint(5, 400, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    counter = SavedTensors(model)
    start = time.perf_counter()
    with counter.counting(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        # the run's loss head: chunked by default (at 16K tokens transformers' whole logits take 3 GiB a copy)
        chunk = recipe.memory.loss_chunk_tokens if recipe.memory.chunked_loss else None
        loss = model(**batch).loss if chunk is None else chunked_lm_loss(model, batch, chunk)
    loss.backward()
    seconds = time.perf_counter() - start
    saved = counter.result()
    planned = plan(recipe, batch=1, seq=seq, device="cpu").chosen(recipe).activations
    return saved.total, saved.host, planned, seconds


def measured_rows(model_path: str, lengths: list[int], bf16: bool, skip: set[str]):
    """Each length's rows, a length at a time (the caller writes the table after each)."""
    for seq in lengths:
        rows = []
        figures = {}
        for way, fields in WAYS.items():
            if f"{seq}:{way}" in skip:
                continue
            with tempfile.TemporaryDirectory() as out:
                figures[way] = measure(model_path, seq, fields, out, bf16)
            print(f"{seq:,} tokens, {way}: {figures[way][3]:.1f} s", file=sys.stderr, flush=True)
        full_seconds = figures["full"][3]
        for way, (device, host, planned, seconds) in figures.items():
            error = (planned - device) / device * 100
            rows.append(
                [
                    f"{seq:,}",
                    way,
                    f"{device / MIB:.1f}",
                    f"{planned / MIB:.1f} ({error:+.2f}%)",
                    f"{host / MIB:.1f}" if host else "-",
                    f"{seconds:.2f}",
                    f"{seconds / full_seconds:.2f}x",
                ]
            )
        yield rows


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    args.add_argument(
        "--float32",
        action="store_true",
        help="table 2 in float32 without autocast (CPUs without AVX512-BF16 emulate bf16 matmuls: 11x slower)",
    )
    args.add_argument(
        "--skip",
        nargs="+",
        default=[],
        metavar="LENGTH:WAY",
        help='measurements left out, e.g. "16384:none" (its saved activations outgrow this machine\'s memory)',
    )
    args = args.parse_args()
    if args.smoke:
        lengths, model_path, label = [256], "builtin:tiny-llama", "tiny Llama (4 layers, hidden 128)"
    elif args.real_model:
        lengths, model_path, label = args.lengths, str(real_model_dir()), f"builtin:{REAL_MODEL}"
    else:
        lengths, model_path, label = args.lengths, "builtin:tiny-llama", "tiny Llama (4 layers, hidden 128)"
    planned = markdown_table(
        ["model, GPU", "memory", "longest row (tokens)", "device peak (GiB)", "host (GiB)", "published"],
        planned_lengths(args.smoke),
    )
    name = "long-context-real-cpu" if args.real_model else "long-context-cpu"
    notes = (
        "Table 1 is planned, traced at each length it shows, for a GPU under bf16 autocast (micro-batch 1, one "
        "unpacked row, sdpa, LoRA r=16 on every linear, the chunked loss head). Table 2 is measured on "
        f"{label}, one row per length "
        + ("in float32, no autocast" if args.float32 else "under bf16 autocast")
        + ", LoRA dropout 0, the chunked loss head (the default); one forward and backward each, the ways one "
        "after another in a fresh setup."
    )
    rows: list[list[str]] = []
    header = [
        "tokens",
        "memory",
        "saved on device (MiB)",
        "planned (MiB, error)",
        "host (MiB)",
        "forward + backward (s)",
        "time vs full",
    ]
    for length_rows in measured_rows(model_path, lengths, not args.float32, set(args.skip)):
        rows += length_rows  # written after each length: a longer one that runs out of memory loses no other
        measured = markdown_table(header, rows)
        write_result(
            name,
            "Long context: the longest row that fits, and what each way keeps",
            planned + "\n\n" + measured,
            notes,
            args.out,
        )


if __name__ == "__main__":
    main()
