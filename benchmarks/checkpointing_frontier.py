"""The checkpointing frontier on the CPU: bytes saved for backward and step time of each policy, and of auto at budgets between full and none, relative to none.

Two models, random init, NF4 + double quantization, LoRA r=16 on every linear (dropout 0.05), paged
AdamW 8-bit, the chunked loss head, one fixed batch, every position trained:
- ``builtin``: the builtin tiny Llama (4 layers, hidden 128);
- ``realistic``: SmolLM-135M's widths (hidden 576, intermediate 1536, 9 heads, 3 KV heads) with 16
  layers and a 32,000 vocabulary.
Per model: none, every 2nd layer, selective, full, and selective's floor: the same op-level machinery
with a policy that keeps every op's output (``floor_policy``), so its backward recomputes nothing and
pays only the replay of the layer's Python and the dispatch mode in forward and backward: the fastest
any op-level selective policy can step on these layers; then ``auto`` at budgets 1/4, 1/2 and 3/4 of the way
from full's planned peak to none's, each next to the every_n policy the planner finds fitting the same
budget with the fewest recomputed layers (what auto chose before it mixed policies per layer). Each
run is set up by pipeline.build; the settings interleave round by round, the median of the rounds after
a warm-up round is reported, with the planner's figure for what each run keeps.

    python benchmarks/checkpointing_frontier.py [--rounds 2]
    python benchmarks/checkpointing_frontier.py --smoke --out /tmp/x   # the builtin model, one budget, one round, no warm-up
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import budget_between, markdown_table, parser, timed_step, uniform_fitting, write_result
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MIB = 2**20
MODELS = {
    "builtin": ({}, 2, 64),  # shape overrides, batch, sequence
    "realistic": (
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 16,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 32000,
        },
        1,
        128,
    ),
}
SMOKE = {"builtin": ({}, 2, 32)}
FRACTIONS = (0.25, 0.5, 0.75)
FLOOR = "selective floor (saves every op)"
aten = torch.ops.aten
# Ops whose output an in-place op then writes (dropout's mask: empty_like, then bernoulli_ and div_ in
# place): a cached output must not be mutated, so these replay, as in-place ops do.
FILLED_IN_PLACE = {aten.empty_like.default, aten.empty.memory_format, aten.new_empty.default}


def floor_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep every op's output but the in-place ones' (and what they fill): a replay that computes almost nothing."""
    from qlora_kit.memory.accounting import note_saved

    if func._schema.is_mutable or func in FILLED_IN_PLACE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        pytree.tree_map_only(torch.Tensor, note_saved, ctx.op_output)
    return CheckpointPolicy.MUST_SAVE


def use_floor(model) -> None:
    """The selective layers of ``model`` with ``floor_policy`` in place of selective's."""
    from qlora_kit.memory.accounting import decoder_layers

    context_fn = functools.partial(create_selective_checkpoint_contexts, floor_policy)
    for layer in decoder_layers(model):
        func = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = functools.partial(
            func.func, *func.args, **{**func.keywords, "context_fn": context_fn}
        )


SMOKE_FRACTIONS = (0.5,)


def recipe_for(folder: Path, memory_fields: dict, out: Path, batch: int, seq: int):
    from qlora_kit import Recipe

    return Recipe.from_dict(
        {
            "model": {"path": str(folder)},
            "memory": memory_fields,
            "data": {"packing": False, "max_seq_len": seq},
            # eager policies compared: a compile in this process also made the planner's later traces symbolic
            "train": {"output_dir": str(out), "micro_batch_size": batch, "max_steps": 1000, "compile": False},
        }
    )


def settings_for(folder: Path, out: Path, batch: int, seq: int, fractions) -> tuple[dict, dict]:
    """name -> memory fields: the uniform policies, auto at each budget and the every_n fitting it; and
    name -> the budget (GiB) for auto's rows."""
    from qlora_kit.memory.planner import plan

    the_plan = plan(recipe_for(folder, {}, out, batch, seq), device="cpu")
    settings = {
        "none": {"checkpointing": "none"},
        "every_n=2": {"checkpointing": "every_n", "every_n": 2},
        "selective": {"checkpointing": "selective"},
        FLOOR: {"checkpointing": "selective"},
        "full": {"checkpointing": "full"},
    }
    budgets = {}
    for fraction in fractions:
        budget = budget_between(the_plan, fraction)
        settings[f"auto @ {fraction:g}"] = {"checkpointing": "auto", "budget_gb": budget}
        budgets[f"auto @ {fraction:g}"] = budget
        label, fields = uniform_fitting(the_plan, budget)
        settings[f"{label} @ {fraction:g}"] = fields
        budgets[f"{label} @ {fraction:g}"] = budget
    return settings, budgets


def measure(
    model: str,
    shape: dict,
    batch: int,
    seq: int,
    rounds: int,
    out: Path,
    fractions=FRACTIONS,
    warm_up: bool = True,
) -> list[list[str]]:
    from qlora_kit.memory import checkpointing
    from qlora_kit.memory.planner import activation_bytes, plan
    from qlora_kit.memory.shapes import model_shape
    from qlora_kit.model import builtin
    from qlora_kit.training.pipeline import build

    folder = builtin.ensure_tiny_model("tiny-llama", **shape)
    settings, budgets = settings_for(folder, out, batch, seq, fractions)
    runs = {}
    for name, fields in settings.items():
        recipe = recipe_for(folder, fields, out / model / name.replace(" ", "_"), batch, seq)
        trainer = build(recipe).trainer
        if name == FLOOR:
            use_floor(trainer.model)
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1
        vocab = trainer.model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        runs[name] = (recipe, trainer, {"input_ids": ids, "labels": ids.clone()})
    times = {name: [] for name in runs}
    cpu_times = {name: [] for name in runs}
    # round 0 warms up and is not counted; --smoke has none (its figures need only be finite)
    for round_index in range(0 if warm_up else 1, rounds + 1):
        for name, (_, trainer, batch_ids) in runs.items():
            # CPU seconds of this process (all its threads) besides wall seconds: on a machine other
            # jobs share, the wall clock measures them too, the process's CPU time only this step's work
            cpu = time.process_time()
            seconds = timed_step(trainer, batch_ids)[1]
            cpu = time.process_time() - cpu
            print(f"{model} round {round_index} {name}: {seconds:.2f} s, {cpu:.2f} CPU s", flush=True)
            if round_index:
                times[name].append(seconds)
                cpu_times[name].append(cpu)
    base_time = statistics.median(times["none"])
    base_cpu = statistics.median(cpu_times["none"])
    base_saved = runs["none"][1].memory_monitor.largest.total
    precision = plan(runs["none"][0], device="cpu").precision
    rows = []
    for name, (recipe, trainer, _) in runs.items():
        layers = checkpointing.applied_policies(trainer.model)
        layers = ["selective"] * len(layers) if name == FLOOR else layers  # op-level, another policy
        saved = trainer.memory_monitor.largest.total
        predicted = activation_bytes(
            model_shape(recipe), recipe, layers, 1, batch, seq, "cpu", precision=precision
        ).total
        step, cpu = statistics.median(times[name]), statistics.median(cpu_times[name])
        mix = "/".join(str(layers.count(p)) for p in ("none", "selective", "full"))
        budget = f"{budgets[name] * 1024:.1f}" if name in budgets else "-"
        # the floor keeps what no policy of the run keeps: the planner has no figure for it
        planned = "-" if name == FLOOR else f"{predicted / MIB:.1f} ({predicted / saved - 1:+.1%})"
        rows.append([
            model, name, budget, mix, f"{saved / MIB:.1f}", f"{saved / base_saved:.3f}",
            planned, f"{step:.2f}", f"{step / base_time:.3f}x",
            f"{cpu:.2f}", f"{cpu / base_cpu:.3f}x",
        ])  # fmt: skip
    return rows


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--rounds", type=int, default=2)
    args = options.parse_args()
    models, rounds = (SMOKE, 1) if args.smoke else (MODELS, args.rounds)
    fractions = SMOKE_FRACTIONS if args.smoke else FRACTIONS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, (shape, batch, seq) in models.items():
            rows += measure(model, shape, batch, seq, rounds, Path(tmp), fractions, not args.smoke)
            print(markdown_table(["model", "setting", "..."], rows), flush=True)  # partial, as it goes
    header = [
        "model", "setting", "budget (MiB)", "layers none/selective/full", "saved for backward (MiB)",
        "vs none", "planner (MiB)", "median step (s)", "time vs none", "CPU s / step", "CPU time vs none",
    ]  # fmt: skip
    sizes = "; ".join(f"{m}: {s or 'the builtin shape'}, batch {b} x {t}" for m, (s, b, t) in models.items())
    write_result(
        "checkpointing-frontier-cpu",
        "Checkpointing frontier: none, every_n, selective, full and auto per layer (CPU)",
        markdown_table(header, rows),
        f"Models: {sizes}. NF4 + double quant, LoRA r=16 all-linear (dropout 0.05), paged AdamW 8-bit, the "
        f"chunked loss head; {rounds} interleaved rounds{'' if args.smoke else ' after a warm-up'}. auto @ f: budget f of the way from "
        "full's planned peak to none's; the every_n row beside it is the planner's uniform choice for the same "
        "budget. The selective floor keeps every op's output (more bytes than none, no planner figure): its "
        "backward recomputes nothing but the in-place ops, so its time over none is selective checkpointing's "
        "machinery alone, the least any op-level policy can add. Step time includes the optimizer step; CPU time is this process's (all threads), the figure "
        "to read on a machine shared with other jobs, whose load the wall clock measures too.",
        args.out,
    )


if __name__ == "__main__":
    main()
