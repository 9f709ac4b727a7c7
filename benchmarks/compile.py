"""train.compile (each decoder layer compiled, one graph for all: training/compiled.py) on the CPU with
4-bit layers and LoRA: is it correct, and is it faster?

Two runs of the demo-sized tiny Llama, set up by ``pipeline.build`` with the same seed and batches, one
with ``train.compile: true`` (its decoder layers compiled with inductor), stepped in
turn (forward, backward, paged AdamW 8-bit step) so they see the same machine load. Compared: the
loss of every step (the compiled run must follow the eager one) and the median step time after the
compile steps. Graph breaks are counted with ``torch._dynamo.utils.counters``. Then two fresh runs of
each setting go through ``trainer.train()`` itself, TRAIN_STEPS (--smoke: 2) steps of recipes/demo.yaml (its rows,
packed, its micro-batch and learning rate): the Trainer's loop, on collated batches, with the model
compiled as the pipeline compiles it; their logged losses (in the summary) must agree too.

Whether ``train.compile`` pays is in benchmarks/results/compile-cpu.md.

    python benchmarks/compile.py [--steps 12] [--mixed-precision bf16] [--model builtin:tiny-qwen3-moe]
    python benchmarks/compile.py --smoke --out /tmp/x   # 2 steps of 2 x 32 tokens, the first setting
    python benchmarks/compile.py --smoke --out /tmp/x --mixed-precision bf16   # tests/e2e/test_compile.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import markdown_table, parser, timed_step, write_result

BATCH, SEQ = 8, 128
SMOKE_BATCH, SMOKE_SEQ = 2, 32
TRAIN_STEPS = 3  # through trainer.train(): whether the Trainer's loop trains the compiled model alike
# --smoke (tests/e2e/test_compile.py): step 1 compiles, step 2 runs the compiled graph after an optimizer
# step; the demo's 16 x 64 bfloat16 rows (emulated on CPUs without AVX512-BF16) cost seconds a step
SMOKE_STEPS = 2
DEFAULT_MODEL = "builtin:tiny-llama"
DEMO = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"  # the trainer.train() runs' recipe


SETTINGS = {
    "no checkpointing, transformers' loss": {"checkpointing": "none", "chunked_loss": False},
    "full checkpointing, chunked loss (the defaults)": {"checkpointing": "full", "chunked_loss": True},
}


def build(compiled: bool, memory: dict, out: Path, batch: int, seq: int, precision: str, model: str):
    from qlora_kit import Recipe
    from qlora_kit.training.compiled import decoder_layers_compiled
    from qlora_kit.training.pipeline import build as build_run

    recipe = Recipe.from_dict(
        {
            "model": {"path": model},
            "memory": memory,
            "data": {"packing": False, "max_seq_len": seq},
            "lora": {"dropout": 0.0},
            "train": {
                "output_dir": str(out),
                "micro_batch_size": batch,
                "max_steps": 1000,
                "compile": compiled,
                "mixed_precision": precision,
            },
        }
    )
    trainer = build_run(recipe).trainer
    assert compiled == decoder_layers_compiled(trainer.model), (
        "the decoder layers compiled exactly when asked"
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    # What trainer.train() does first: accelerate prepares the model (the layers are compiled already).
    trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)
    return trainer


def through_train(memory: dict, out: Path, precision: str, steps: int, model: str) -> dict[str, list[float]]:
    """Each run's logged losses when ``trainer.train()`` runs it (its loop, its accelerate prepare, which
    compiles): the demo recipe with the setting, its rows packed (what data.packing auto picks there), in
    the compared runs' compute dtype. Run after ``compare``, whose step 1 times the compile from cold."""
    from qlora_kit import Recipe
    from qlora_kit.training.compiled import decoder_layers_compiled
    from qlora_kit.training.pipeline import build as build_run

    losses = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        overrides = {f"memory.{key}": value for key, value in memory.items()} | {
            "model.path": model,
            "train.compile": compiled,
            "train.mixed_precision": precision,
            "train.output_dir": str(out / name),
            "train.max_steps": steps,
            "train.logging_steps": 1,
            "train.eval_steps": None,
            "train.sample_prompts": 0,
            "data.packing": True,
            # compare's runs' dtype (the default); demo.yaml's float32 is for CPUs that emulate bfloat16
            "quant.compute_dtype": "bfloat16",
        }
        torch.manual_seed(0)
        trainer = build_run(Recipe.from_yaml(DEMO, overrides)).trainer
        assert compiled == decoder_layers_compiled(trainer.model), (
            "the decoder layers compiled exactly when asked"
        )
        trainer.train()
        losses[name] = [row["loss"] for row in trainer.metrics_log.rows if "loss" in row]
    assert len(losses["eager"]) == len(losses["compiled"]) == steps, losses
    return losses


def compare(
    memory: dict, steps: int, out: Path, batch: int, seq: int, precision: str, train_steps: int, model: str
) -> tuple[list[list[str]], str]:
    from torch._dynamo.utils import counters

    counters.clear()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(5, 600, (batch, seq), generator=generator) for _ in range(steps)]
    torch.manual_seed(0)
    eager = build(False, memory, out / "eager", batch, seq, precision, model)
    torch.manual_seed(0)
    compiled = build(True, memory, out / "compiled", batch, seq, precision, model)
    results = {"eager": [], "compiled": []}
    for ids in batches:
        for name, trainer in (("eager", eager), ("compiled", compiled)):
            cpu = time.process_time()  # beside the wall: on shared cores a wall time counts the waits too
            loss, wall = timed_step(trainer, {"input_ids": ids, "labels": ids}, trainer.model_wrapped)
            results[name].append((loss, wall, time.process_time() - cpu))
    autocast = compiled.accelerator.mixed_precision  # what accelerate autocasts the forward to (or "no")
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]  # compiled graphs (forward and backward of one layer class)
    reasons = sorted(counters["graph_break"], key=lambda r: -counters["graph_break"][r])[:5]
    warm = min(2, steps - 1)  # the compiled run's first steps compile
    rows = []
    for i, (eager_step, comp_step) in enumerate(zip(*results.values(), strict=True)):
        rows.append(
            [str(i + 1), f"{eager_step[0]:.5f}", f"{comp_step[0]:.5f}"]
            + [f"{value:.3f}" for value in (eager_step[1], comp_step[1], eager_step[2], comp_step[2])]
        )
    eager_median = statistics.median(s for _, s, _ in results["eager"][warm:])
    comp_median = statistics.median(s for _, s, _ in results["compiled"][warm:])
    eager_cpu = statistics.median(c for _, _, c in results["eager"][warm:])
    comp_cpu = statistics.median(c for _, _, c in results["compiled"][warm:])
    worst = max(abs(a[0] - b[0]) for a, b in zip(results["eager"], results["compiled"], strict=True))
    summary = (
        f"Largest loss difference {worst:.2e}; median step after {warm} warm-up steps: eager {eager_median:.3f} s, "
        f"compiled {comp_median:.3f} s ({comp_median / eager_median:.2f}x); by the process's CPU time: eager "
        f"{eager_cpu:.3f} s, compiled {comp_cpu:.3f} s ({comp_cpu / eager_cpu:.2f}x); compile time in step 1: "
        f"{results['compiled'][0][1]:.1f} s; graph breaks: {breaks}; graphs compiled: {graphs}; autocast: {autocast}."
    )
    if reasons:
        summary += "\n\nMost frequent graph-break reasons:\n\n" + "\n".join(f"- {r}" for r in reasons)
    trained = through_train(memory, out / "train", precision, train_steps, model)
    worst = max(abs(a - b) for a, b in zip(trained["eager"], trained["compiled"], strict=True))
    summary += (
        f"\n\nThrough trainer.train(), {train_steps} steps of recipes/demo.yaml, packed: eager losses "
        + " ".join(f"{v:.5f}" for v in trained["eager"])
        + ", compiled losses "
        + " ".join(f"{v:.5f}" for v in trained["compiled"])
        + f" (largest difference {worst:.2e})."
    )
    return rows, summary


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--steps", type=int, default=12)
    options.add_argument(
        "--mixed-precision",
        default="auto",
        choices=["auto", "no", "bf16"],
        help="train.mixed_precision of every run (bf16: accelerate's autocast around the compiled forward)",
    )
    options.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model.path of every run (a mixture: its layers compile but for their routed experts)",
    )
    args = options.parse_args()
    # --smoke: the first setting only, one step after the warm-up (compiling is most of the time, and
    # checkpointing with the chunked head takes several times longer to compile)
    settings = dict(list(SETTINGS.items())[:1]) if args.smoke else SETTINGS
    steps, batch, seq = (SMOKE_STEPS, SMOKE_BATCH, SMOKE_SEQ) if args.smoke else (args.steps, BATCH, SEQ)
    train_steps = SMOKE_STEPS if args.smoke else TRAIN_STEPS
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, memory) in enumerate(settings.items()):
            rows, summary = compare(
                memory,
                steps,
                Path(tmp) / str(index),
                batch,
                seq,
                args.mixed_precision,
                train_steps,
                args.model,
            )
            header = [
                "step",
                "eager loss",
                "compiled loss",
                "eager s",
                "compiled s",
                "eager CPU s",
                "compiled CPU s",
            ]
            table = markdown_table(header, rows)
            sections.append(f"## {name}\n\n{table}\n\n{summary}")
            print(sections[-1], flush=True)
    name = args.model.removeprefix("builtin:").replace("/", "-")
    write_result(
        "compile-cpu" if args.model == DEFAULT_MODEL else f"compile-{name}-cpu",
        "torch.compile with 4-bit layers and LoRA (CPU)",
        "\n\n".join(sections),
        f"{args.model}, batch {batch} x {seq}, NF4 + double quant, LoRA r=16 all-linear, paged AdamW 8-bit, "
        f"mixed precision {args.mixed_precision}; the two runs of each setting stepped in turn on the same batches.",
        args.out,
    )


if __name__ == "__main__":
    main()
