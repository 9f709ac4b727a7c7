"""The GPU check: qlora_kit's memory figures on a real CUDA device, through ``trainer.train()``.

Every measurement is a real run of ``qlora_kit.training.pipeline.run`` — the code path of ``qlora-kit train``:
accelerate's prepare, the device's mixed precision (bf16 autocast with fp32 output conversion on a
bf16 GPU), the guards, the optimizer the recipe names — on a ~1B-parameter Llama built from a config
(random weights, Llama-3's 128,256-token vocabulary so the loss head matters), loaded in 4-bit, on
rows of exactly ``seq`` tokens:

1. per checkpointing policy (none, every 2nd layer, selective, full; and ``auto`` half-way between
   full's and none's planned peaks, resolved with its costs timed on the device, beside the every_n
   fitting the same budget): peak allocated memory of forward, backward (with recompute) and the
   optimizer step, from the run's own MemoryMonitor, next to the planner's predicted peak, and the step time;
2. the chunked loss head on and off;
3. a long-sequence batch (1 x 8,192 tokens, full checkpointing): the recompute spike is the backward
   peak over the forward peak;
4. the longest row ``plan --max-seq-len`` gives for full checkpointing + offload + MLP tiles in 8 GiB,
   trained for two steps: measured peak against the plan's;
5. paged vs non-paged 8-bit AdamW at rank 64 (pageable state), each in a subprocess on CUDA (CUDA errors
   in paged memory end the process; on the CPU, in this process): peak allocated, device memory used,
   step time; the paged one is then resumed from its checkpoint and reports how many state tensors went
   back to paged memory;
6. a real CUDA out-of-memory error (``train.on_oom: split``): ``torch.cuda.set_per_process_memory_fraction``
   lets the process hold half-way between micro-batch 4's measured peak (checkpointing none, from 1.)
   and micro-batch 2's (a reference run, accumulation 2): the capped run at micro-batch 4 must split in
   step 1 and finish as the reference does (steps, losses). The fraction is put back afterwards. On
   the CPU, or with ``--tiny`` (its activations are below the allocator's block sizes), it is skipped:
   benchmarks/oom_recovery.py makes the same case there with the fault injector.

Prints a table last and writes everything as JSON to --out (default: $OUT, else ./gpu-check-out).
``--tiny`` (or ``--smoke``) runs the same code on a tiny model, on the CPU when there is no GPU: the
test suite uses it so this script cannot rot between the sessions that have a GPU.

    bash benchmarks/gpu_check.sh          # on the lent machine (doctor first, then this)
    python benchmarks/gpu_check.py --tiny # anywhere
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import budget_between, parser, uniform_fitting

GIB = 1024**3
LONG_CONTEXT_GIB = 8.0  # the long-context row's budget: its longest row trains in seconds on an H100/H200
TINY_LONG_CONTEXT = 2048  # --tiny: the tokens whose planned peak is the budget
FULL_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}
TINY_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "vocab_size": 4096}
POLICIES = [
    {"checkpointing": "none"},
    {"checkpointing": "every_n", "every_n": 2},
    {"checkpointing": "selective"},
    {"checkpointing": "full"},
    {"checkpointing": "full", "chunked_loss": False},
    {"checkpointing": "full", "offload_activations": True},
]


def versions() -> dict[str, str]:
    from importlib import metadata

    names = ["torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "qlora-kit"]
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    found["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return found


def model_folder(tiny: bool) -> Path:
    from qlora_kit.model import builtin

    return builtin.ensure_tiny_model("tiny-llama", **(TINY_SHAPE if tiny else FULL_SHAPE))


def text_rows(folder: Path, seq: int, rows: int) -> Path:
    """Rows of plain text longer than ``seq`` tokens: truncated, each is exactly ``seq`` tokens."""
    from qlora_kit.model.builtin import corpus_words

    words, rng = corpus_words(), random.Random(0)
    path = folder / f"text-{seq}.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq))}) + "\n")
    return path


def recipe_for(folder: Path, data: Path, memory: dict, batch: int, seq: int, steps: int, **more):
    from qlora_kit import Recipe

    values = {
        "model": {"path": str(folder)},
        "memory": memory,
        "data": {"path": str(data), "format": "text", "max_seq_len": seq, "packing": False},
        "train": {
            "output_dir": tempfile.mkdtemp(prefix="gpu-check-"),
            "max_steps": steps,
            "micro_batch_size": batch,
            "logging_steps": 1,
        },
    }
    for key, value in more.items():
        section, _, field = key.partition("__")
        values.setdefault(section, {})[field] = value
    return Recipe.from_dict(values)


def train(recipe, resume: str | None = None) -> dict:
    """One real run (``qlora-kit train``'s code path); its memory summary and tokens/s."""
    from qlora_kit.training.pipeline import run

    result = run(recipe, resume=resume or False, overwrite=resume is None)
    usage = dict(result.memory)
    del result
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return usage


def frontier_policies(folder: Path, data: Path, batch: int, seq: int, steps: int) -> list[tuple[str, dict]]:
    """``checkpointing: auto`` half-way (in planned peak) between full and none, resolved as a run resolves
    it (its recompute costs timed on this device), and the every_n the planner finds fitting the same
    budget with the fewest recomputed layers: (label, memory fields) for ``policy_rows``."""
    from qlora_kit.memory.auto import resolve_auto
    from qlora_kit.memory.planner import plan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    the_plan = plan(recipe_for(folder, data, {}, batch, seq, steps), batch=batch, seq=seq, device=device)
    budget = budget_between(the_plan, 0.5)
    memory, costs = resolve_auto(
        recipe_for(folder, data, {"checkpointing": "auto", "budget_gb": budget}, batch, seq, steps)
    )
    layers = memory.layer_policies or [memory.checkpointing]
    mix = (
        "/".join(str(layers.count(p)) for p in ("none", "selective", "full"))
        if memory.layer_policies
        else memory.checkpointing
    )
    fields = {
        "checkpointing": memory.checkpointing,
        "every_n": memory.every_n,
        "layer_policies": memory.layer_policies,
    }
    label, every = uniform_fitting(the_plan, budget)
    source = costs.source if costs is not None else "counted FLOPs"
    return [(f"auto @ 0.5 ({mix}; {source})", fields), (f"{label} @ 0.5", every)]


def policy_rows(
    folder: Path, data: Path, batch: int, seq: int, steps: int, policies: list[tuple[str | None, dict]]
) -> list[dict]:
    """One run per (label, memory fields); a label of None is the policy's own name."""
    from qlora_kit.memory.planner import plan, policy_name

    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, memory in policies:
        recipe = recipe_for(folder, data, memory, batch, seq, steps)
        usage = train(recipe)
        chosen = plan(recipe, batch=batch, seq=seq, device=device, padded=False).chosen(
            recipe
        )  # rows of seq tokens
        label = name or policy_name(recipe.memory.checkpointing, recipe.memory.every_n)
        label += "" if recipe.memory.chunked_loss else " (full logits)"
        label += " + offload" if recipe.memory.offload_activations else ""
        peaks = [usage.get(f"peak_{phase}_gib", 0.0) for phase in ("forward", "backward", "optimizer")]
        rows.append(
            {
                "setting": label,
                "forward_gib": peaks[0],
                "backward_gib": peaks[1],
                "optimizer_gib": peaks[2],
                "measured_peak_gib": max(peaks),
                "predicted_peak_gib": chosen.peak / GIB,
                "saved_mib": usage["saved_mib"],
                "predicted_saved_mib": chosen.activations / 2**20,
                "step_s": batch * seq / usage["tokens_per_s"],
            }
        )
    return rows


def optimizer_row(folder: Path, data: Path, optimizer: str, batch: int, seq: int, steps: int) -> dict:
    """One optimizer's peak, step time and, resumed, how many tensors page again."""
    settings = {"optimizer__name": optimizer, "lora__rank": 64, "train__save_steps": steps}
    recipe = recipe_for(folder, data, {"checkpointing": "full"}, batch, seq, steps, **settings)
    usage = train(recipe)
    checkpoint = Path(recipe.train.output_dir) / f"checkpoint-{steps}"
    resumed = train(recipe.with_overrides({"train.max_steps": steps + 1}), resume=str(checkpoint))
    return {
        "optimizer": optimizer,
        "peak_allocated_gib": max(
            usage.get(f"peak_{p}_gib", 0.0) for p in ("forward", "backward", "optimizer")
        ),
        "device_used_gib": usage.get("device_used_gib", 0.0),
        "step_s": batch * seq / usage["tokens_per_s"],
        "repaged_after_resume": resumed.get("repaged_optimizer_tensors", 0),
    }


def optimizer_rows(folder: Path, data: Path, batch: int, seq: int, steps: int) -> list[dict]:
    rows = []
    for optimizer in ("paged_adamw_8bit", "adamw_8bit"):
        if not torch.cuda.is_available():
            # Nothing pages on a CPU and no CUDA error can end the process: run here, which spares the
            # test suite (gpu_check.py --tiny) two process starts. An error is the row's, as a child's is.
            try:
                rows.append(optimizer_row(folder, data, optimizer, batch, seq, steps))
            except Exception as error:
                rows.append({"optimizer": optimizer, "error": f"{type(error).__name__}: {error}"[-500:]})
            continue
        command = [sys.executable, __file__, "--child", str(folder), str(data), optimizer]
        child = subprocess.run(
            [*command, str(batch), str(seq), str(steps)], capture_output=True, text=True, timeout=300
        )
        line = next((ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")), None)
        rows.append(json.loads(line[7:]) if line else {"optimizer": optimizer, "error": child.stderr[-500:]})
    return rows


def oom_row(folder: Path, data: Path, batch: int, seq: int, steps: int, peak_gib: float, tiny: bool) -> dict:
    """A real out-of-memory error at micro-batch ``batch`` (its peak ``peak_gib`` under checkpointing
    none) and the run finishing with the split, against micro-batch ``batch // 2`` with accumulation 2."""
    if not torch.cuda.is_available() or tiny:
        why = (
            "no CUDA device"
            if not torch.cuda.is_available()
            else "--tiny: activations below the allocator's blocks"
        )
        return {"skipped": f"{why} (benchmarks/oom_recovery.py: the fault injector's case on the CPU)"}
    from qlora_kit.registries import metric_keys as keys

    memory = {"checkpointing": "none"}  # activations dominate: half the micro-batch, about half the peak
    # No worst-batch probe (on by default on CUDA): the error is met inside step 1, the step then redone
    settings = {"train__probe_worst_batch": False}
    reference = recipe_for(folder, data, memory, batch // 2, seq, steps, train__grad_accum=2, **settings)
    usage = train(reference)
    half_gib = max(usage.get(f"peak_{p}_gib", 0.0) for p in ("forward", "backward", "optimizer"))
    limit_gib = (half_gib + peak_gib) / 2
    device = torch.cuda.current_device()
    fraction = min(limit_gib * GIB / torch.cuda.get_device_properties(device).total_memory, 1.0)
    capped = recipe_for(folder, data, memory, batch, seq, steps, **settings)
    row = {"micro_batch": batch, "peak_gib": peak_gib, "half_peak_gib": half_gib, "limit_gib": limit_gib}
    gc.collect()  # the fraction caps what the allocator reserves: start from nothing cached
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        usage = train(capped)
        row["capped_peak_gib"] = max(usage.get(f"peak_{p}_gib", 0.0) for p in ("forward", "backward"))
    except Exception as error:  # a stop (TrainingGuardError) or a crash: recorded, the check goes on
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    finally:  # the checks after this one (and a rerun) get the whole device back
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    runs = [Path(r.train.output_dir) / "metrics.jsonl" for r in (capped, reference)]
    metrics = [[json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else [] for p in runs]
    row["splits"] = [
        {"step": r["step"], **{k: r[keys.OOM_SPLIT][k] for k in (keys.MICRO_BATCH_BEFORE, keys.MICRO_BATCH,
         keys.LOST_SECONDS, "phase", "error")}}
        for r in metrics[0] if keys.OOM_SPLIT in r
    ]  # fmt: skip
    losses = [[r["loss"] for r in rows if "loss" in r] for rows in metrics]
    row["steps"], row["reference_steps"] = len(losses[0]), len(losses[1])
    if losses[0] and len(losses[0]) == len(losses[1]):
        row["max_loss_rel_difference"] = max(abs(a - b) / abs(b) for a, b in zip(*losses, strict=True))
    return row


def main() -> None:
    options = parser(__doc__, out=Path(os.environ.get("OUT", "gpu-check-out")))
    options.add_argument("--tiny", action="store_true", help="a tiny model: a smoke test that runs anywhere")
    options.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = options.parse_args()
    if args.child:
        folder, data, optimizer, batch, seq, steps = args.child
        row = optimizer_row(Path(folder), Path(data), optimizer, int(batch), int(seq), int(steps))
        print("RESULT " + json.dumps(row))
        return
    tiny, out = args.tiny or args.smoke, args.out
    out.mkdir(parents=True, exist_ok=True)
    report = {"versions": versions()}
    print(json.dumps(report["versions"]), flush=True)
    folder = model_folder(tiny)
    batch, seq, steps = (2, 64, 3) if tiny else (4, 2048, 4)
    long_seq = 256 if tiny else 8192
    rows_folder = Path(tempfile.mkdtemp(prefix="gpu-check-data-"))
    data, long_data = text_rows(rows_folder, seq, 64), text_rows(rows_folder, long_seq, 8)
    policies = [(None, memory) for memory in POLICIES] + frontier_policies(folder, data, batch, seq, steps)
    report["policies"] = policy_rows(folder, data, batch, seq, steps, policies)
    long_usage = train(recipe_for(folder, long_data, {"checkpointing": "full"}, 1, long_seq, steps))
    report["long_sequence"] = {
        "seq": long_seq,
        "forward_gib": long_usage.get("peak_forward_gib", 0.0),
        "backward_gib": long_usage.get("peak_backward_gib", 0.0),
    }
    report["long_context"] = long_context_row(folder, rows_folder, tiny)
    report["optimizers"] = optimizer_rows(folder, data, batch, seq, steps)
    (out / "gpu-check.json").write_text(
        json.dumps(report, indent=2)
    )  # kept if the last case runs out of time
    none = next(r for r in report["policies"] if r["setting"] == "none")
    report["oom"] = oom_row(folder, data, batch, seq, steps, none["measured_peak_gib"], tiny)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    print_table(report, batch, seq, long_seq)


def long_context_row(folder: Path, rows_folder: Path, tiny: bool) -> dict:
    """The longest row ``qlora-kit plan --max-seq-len`` gives for full checkpointing + offload + MLP tiles
    in a budget (``LONG_CONTEXT_GIB``; tiny: a few MiB, so it stays short on a CPU), trained for two steps:
    the measured peak against the plan's."""
    from qlora_kit.memory.max_length import WAYS, longest_fit, planned_at

    way, device = "full + offload + tiles", "cuda" if torch.cuda.is_available() else "cpu"
    probe = recipe_for(folder, text_rows(rows_folder, 64, 2), dict(WAYS[way]), 1, 64, 1)
    # tiny: the budget that 2,048 tokens plan to, so the row stays short on a CPU (a few MiB)
    budget = planned_at(probe, WAYS[way], TINY_LONG_CONTEXT, device).peak / GIB if tiny else LONG_CONTEXT_GIB
    memory = {**WAYS[way], "budget_gb": budget}
    fit = longest_fit(probe, way, budget, device)
    usage = train(recipe_for(folder, text_rows(rows_folder, fit.seq, 4), memory, 1, fit.seq, 2))
    peaks = [usage.get(f"peak_{phase}_gib", 0.0) for phase in ("forward", "backward", "optimizer")]
    return {
        "budget_gib": budget,
        "seq": fit.seq,
        "planned_peak_gib": fit.device_peak / GIB,
        "host_gib": fit.host / GIB,
        "measured_peak_gib": max(peaks),
    }


def print_table(report: dict, batch: int, seq: int, long_seq: int) -> None:
    print(f"\n{report['versions']['device']}: batch {batch} x {seq} tokens, through trainer.train()")
    print(
        f"{'setting':50} {'fwd':>7} {'bwd':>7} {'optim':>7} {'peak':>7} {'planned':>8} {'saved MiB':>10} {'planned':>8} {'step s':>7}"
    )
    for r in report["policies"]:
        print(
            f"{r['setting']:50} {r['forward_gib']:7.2f} {r['backward_gib']:7.2f} {r['optimizer_gib']:7.2f} "
            f"{r['measured_peak_gib']:7.2f} {r['predicted_peak_gib']:8.2f} {r['saved_mib']:10.1f} "
            f"{r['predicted_saved_mib']:8.1f} {r['step_s']:7.3f}"
        )
    lr = report["long_sequence"]
    print(
        f"long sequence 1 x {long_seq}, full: forward peak {lr['forward_gib']:.2f} GiB, backward {lr['backward_gib']:.2f} GiB"
    )
    lc = report["long_context"]
    print(
        f"long context in {lc['budget_gib']:.3g} GiB (full + offload + tiles): {lc['seq']:,} tokens, peak "
        f"{lc['measured_peak_gib']:.2f} GiB (planned {lc['planned_peak_gib']:.2f}), host {lc['host_gib']:.2f} GiB"
    )
    for r in report["optimizers"]:
        if "error" in r:
            print(f"{r['optimizer']:18} failed: {r['error'][-200:]}")
        else:
            print(
                f"{r['optimizer']:18} r=64: peak allocated {r['peak_allocated_gib']:.2f} GiB, "
                f"device used {r['device_used_gib']:.2f} GiB, step {r['step_s']:.3f} s, "
                f"re-paged after resume: {r['repaged_after_resume']} tensors"
            )
    oom = report["oom"]
    if "skipped" in oom:
        print(f"out of memory (real): skipped, {oom['skipped']}")
        return
    split = oom["splits"][0] if oom["splits"] else None
    what = (
        f"micro-batch {split['micro_batch_before']} -> {split['micro_batch_after']} at step {split['step']} "
        f"({split['lost_s']:.2f} s lost)"
        if split
        else "no split"
    )
    print(
        f"out of memory (real, {oom['limit_gib']:.2f} GiB allowed: micro-batch {oom['micro_batch']} peaks "
        f"{oom['peak_gib']:.2f}, half of it {oom['half_peak_gib']:.2f}): {what}; {oom['steps']} of "
        f"{oom['reference_steps']} steps, losses within {oom.get('max_loss_rel_difference', float('nan')):.2e} "
        f"of the reference{'; ' + oom['error'] if 'error' in oom else ''}"
    )


if __name__ == "__main__":
    main()
