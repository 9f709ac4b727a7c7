"""What qlora_kit adds to the Trainer's step costs, per component: a profile of training steps.

A run of the demo recipe (packed rows, the defaults) is built by ``pipeline.build`` and trained STEPS
optimizer steps by ``trainer.train()`` under cProfile; each component's share of the step is the
cumulative time of its entry points (the functions the step calls into it) over the time of the steps.
cProfile adds a fixed cost per Python call, so the shares of Python-heavy components are upper bounds.

Components: the training guard (loss flag, the flags read before the optimizer), the memory monitor
(its phases and peaks), the throughput counter (tokens and FLOPs of each micro-batch), the out-of-memory
recovery (the kept micro-batches, the wrapper around each part, the peers' agreement), the saved-tensor
accounting (autograd's pack hook on every saved tensor, and its sum), the autocast bookkeeping of the
out-of-memory redo, and the interrupt check at each step's end.

    python benchmarks/step_overhead.py [--steps 20]
    python benchmarks/step_overhead.py --smoke --out /tmp/x
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
import time
from pathlib import Path

from common import markdown_table, parser, write_result

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"

# component -> (module path suffix, function names): the entry points the step calls
COMPONENTS = {
    "training guard": ("training/step/guards.py", {"record_loss", "on_pre_optimizer_step"}),
    "memory monitor": (
        "memory/monitor.py",
        {
            "phase_started",
            "forward_started",
            "forward_done",
            "backward_done",
            "on_pre_optimizer_step",
            "on_optimizer_step",
        },
    ),
    "throughput counter": ("training/watch/throughput.py", {"count"}),
    "out-of-memory recovery: kept batches": ("training/step/oom_recovery.py", {"step_started"}),
    "out-of-memory recovery: peers' agreement": (
        "training/step/oom_recovery.py",
        {"forward_done", "_model_forward_done"},
    ),
    "saved-tensor accounting": ("memory/accounting.py", {"__init__", "_pack", "result"}),
    "autocast bookkeeping": ("training/step/oom_split.py", {"now", "restore"}),
    "interrupt check (step end)": ("training/step/interrupts.py", {"on_step_end"}),
}


def profile(steps: int, out: Path) -> tuple[pstats.Stats, float]:
    from qlora_kit import Recipe
    from qlora_kit.training.pipeline import build

    overrides = {
        "train.output_dir": str(out),
        "train.max_steps": steps,
        "train.logging_steps": steps,
        "train.eval_steps": None,
        "train.sample_prompts": 0,
        "train.compile": False,
        "data.packing": True,
    }
    trainer = build(Recipe.from_yaml(DEMO, overrides)).trainer
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    trainer.train()
    profiler.disable()
    return pstats.Stats(profiler), time.perf_counter() - start


def shares(stats: pstats.Stats, steps: int, seconds: float) -> list[list[str]]:
    rows = []
    for name, (suffix, functions) in COMPONENTS.items():
        total = sum(
            cumulative
            for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items()
            if filename.endswith(suffix) and function in functions
        )
        rows.append([name, f"{1000 * total / steps:.2f}", f"{100 * total / seconds:.2f}%"])
    return rows


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--steps", type=int, default=20)
    args = options.parse_args()
    steps = 3 if args.smoke else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        stats, seconds = profile(steps, Path(tmp) / "run")
    rows = shares(stats, steps, seconds)
    table = markdown_table(["component", "ms / step", "share of the step"], rows)
    summary = (
        f"{steps} optimizer steps in {seconds:.2f} s under cProfile ({1000 * seconds / steps:.1f} ms a step)."
    )
    print(table + "\n\n" + summary, flush=True)
    write_result(
        "step-overhead-cpu",
        "What qlora_kit adds to the Trainer's step, per component (CPU)",
        table + "\n\n" + summary,
        "recipes/demo.yaml (tiny Llama, 16 packed rows of 64 tokens a step, float32 compute, full checkpointing), "
        "eager; shares are of the whole trainer.train() time, set-up included.",
        args.out,
    )


if __name__ == "__main__":
    main()
