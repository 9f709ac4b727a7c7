"""The GPU check's measurements (``gpu_check.py`` runs each case of ``CASES`` in a process of its own).

Every measurement is a real run of ``qlora_kit.training.pipeline.run`` — the code path of ``qlora-kit train``:
accelerate's prepare, the device's mixed precision (bf16 autocast with fp32 output conversion on a
bf16 GPU), the guards, the optimizer the recipe names — on a ~1B-parameter Llama built from a config
(random weights, Llama-3's 128,256-token vocabulary so the loss head matters), loaded in 4-bit, on
rows of exactly ``seq`` tokens (``--tiny``: a tiny model, on the CPU where there is no GPU):

- ``policies``, ``selective``, ``auto``: per checkpointing policy, the peak allocated memory of forward,
  backward (with recompute) and the optimizer step from the run's own MemoryMonitor, beside the
  planner's peak for the same rows, and the step time; ``auto`` half-way between full's and none's
  planned peaks, resolved with its costs timed on the device, beside the every_n fitting that budget;
- ``long``: one row of 8,192 tokens under full checkpointing (the recompute spike: backward peak over
  forward), and the longest row ``plan --max-seq-len`` gives for full + offload + MLP tiles in 8 GiB;
- ``optimizers``: paged vs non-paged 8-bit AdamW at rank 64, each in a subprocess (a CUDA error in
  paged memory ends the process), then resumed;
- ``oom``: a real CUDA out-of-memory error (``train.on_oom: split``) under a per-process memory cap
  half-way between micro-batch 4's and micro-batch 2's peaks, with what the allocator held after each
  failed attempt was dropped (the split's log line); skipped on the CPU and at ``--tiny`` (tests/e2e/test_oom.py
  raises it from the allocation path there).
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
from pathlib import Path

import torch
from common import budget_between, scratch_folder, uniform_fitting

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
# The planner's H200 table (benchmarks/results/planner-h200-2026-12-04.json): the loss head named, as it was
POLICIES = [
    {"checkpointing": "none", "chunked_loss": True},
    {"checkpointing": "every_n", "every_n": 2, "chunked_loss": True},
    {"checkpointing": "full", "chunked_loss": True},
    {"checkpointing": "full", "chunked_loss": False},
    {"checkpointing": "full", "offload_activations": True, "chunked_loss": True},
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
            "output_dir": str(scratch_folder("gpu-check-") / "out"),  # its lock file beside it
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
    from qlora_kit.memory import loss_choice
    from qlora_kit.memory.planner import plan, policy_name

    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, memory in policies:
        recipe = recipe_for(folder, data, memory, batch, seq, steps)
        usage = train(recipe)
        recipe = loss_choice.resolve_head(recipe)  # the head the run chose (chunked_loss auto), planned alike
        chosen = plan(recipe, batch=batch, seq=seq, device=device, padded=False).chosen(
            recipe
        )  # rows of seq tokens
        label = name or policy_name(recipe.memory.checkpointing, recipe.memory.every_n)
        label += " (full logits)" if recipe.memory.chunked_loss is False and not name else ""
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
        check = Path(__file__).with_name("gpu_check.py")  # its --child runs optimizer_row
        command = [sys.executable, str(check), "--child", str(folder), str(data), optimizer]
        child = subprocess.run(
            [*command, str(batch), str(seq), str(steps)], capture_output=True, text=True, timeout=300
        )
        line = next((ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")), None)
        rows.append(json.loads(line[7:]) if line else {"optimizer": optimizer, "error": child.stderr[-500:]})
    return rows


def oom_row(folder: Path, data: Path, batch: int, seq: int, steps: int, peak_gib: float) -> dict:
    """A real out-of-memory error at micro-batch ``batch`` (its peak ``peak_gib`` under checkpointing
    none) and the run finishing with the split, against micro-batch ``batch // 2`` with accumulation 2.
    (--tiny never runs it: gpu_check.TINY_SKIPS.)"""
    if not torch.cuda.is_available():
        return {
            "skipped": "no CUDA device (benchmarks/oom_recovery.py: the fault injector's case on the CPU)"
        }
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
         keys.LOST_SECONDS, "phase", "error", "memory")}}
        for r in metrics[0] if keys.OOM_SPLIT in r
    ]  # fmt: skip
    losses = [[r["loss"] for r in rows if "loss" in r] for rows in metrics]
    row["steps"], row["reference_steps"] = len(losses[0]), len(losses[1])
    if losses[0] and len(losses[0]) == len(losses[1]):
        row["max_loss_rel_difference"] = max(abs(a - b) / abs(b) for a, b in zip(*losses, strict=True))
    return row


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


class Setup:
    """What every case trains on: the model, its rows and the batch (tiny: a CPU-sized copy)."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.folder = model_folder(tiny)
        self.batch, self.seq, self.steps = (2, 64, 3) if tiny else (4, 2048, 4)
        self.long_seq = 256 if tiny else 8192
        self.rows_folder = scratch_folder("gpu-check-data-")
        self.data = text_rows(self.rows_folder, self.seq, 64)

    def policies(self, memories: list[tuple[str | None, dict]]) -> list[dict]:
        return policy_rows(self.folder, self.data, self.batch, self.seq, self.steps, memories)


def policies_case(setup: Setup) -> dict:
    return {"policies": setup.policies([(None, memory) for memory in POLICIES])}


def defaults_case(setup: Setup) -> dict:
    """none and full at the default loss head (memory.chunked_loss auto): full's step over none's is the
    cost of checkpointing as a user meets it."""
    memories = [(f"{policy} (defaults)", {"checkpointing": policy}) for policy in ("none", "full")]
    return {"policies": setup.policies(memories)}


def selective_case(setup: Setup) -> dict:
    return {"policies": setup.policies([(None, {"checkpointing": "selective"})])}


def auto_case(setup: Setup) -> dict:
    frontier = frontier_policies(setup.folder, setup.data, setup.batch, setup.seq, setup.steps)
    return {"policies": setup.policies(frontier)}


def long_case(setup: Setup) -> dict:
    long_data = text_rows(setup.rows_folder, setup.long_seq, 8)
    usage = train(
        recipe_for(setup.folder, long_data, {"checkpointing": "full"}, 1, setup.long_seq, setup.steps)
    )
    sequence = {
        "seq": setup.long_seq,
        "forward_gib": usage.get("peak_forward_gib", 0.0),
        "backward_gib": usage.get("peak_backward_gib", 0.0),
    }
    return {
        "long_sequence": sequence,
        "long_context": long_context_row(setup.folder, setup.rows_folder, setup.tiny),
    }


def optimizers_case(setup: Setup) -> dict:
    return {"optimizers": optimizer_rows(setup.folder, setup.data, setup.batch, setup.seq, setup.steps)}


def oom_case(setup: Setup) -> dict:
    """The micro-batch's peak under checkpointing none first (the cap sits below it), then the split."""
    if not torch.cuda.is_available():
        return {"oom": oom_row(setup.folder, setup.data, setup.batch, setup.seq, setup.steps, 0.0)}
    (none,) = setup.policies([(None, {"checkpointing": "none"})])
    peak = none["measured_peak_gib"]
    return {"oom": oom_row(setup.folder, setup.data, setup.batch, setup.seq, setup.steps, peak)}


# Each case's rows, in the order gpu_check.py runs them (the fixes a GPU must confirm first)
CASES = {
    "prepare": lambda setup: {"model": str(setup.folder)},
    "selective": selective_case,
    "auto": auto_case,
    "oom": oom_case,
    "policies": policies_case,
    "defaults": defaults_case,
    "long": long_case,
    "optimizers": optimizers_case,
}
