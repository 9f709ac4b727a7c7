"""vs_trl.py --profile: where a compiled step's time goes on each side, per component (torch.profiler, CPU).

Each system trains in its own process exactly as ``vs_trl.py --compiled`` runs it (the same job: model,
data, seed, padded batches, both compiled), with one more callback: the profiler runs from the end of step
FIRST - 1 to the end of step FIRST + STEPS - 1, so its window is whole steps after the compiles (step 1
compiles; step 2, another padded length, recompiles with the length dynamic): the next batch's loading,
the forward, the backward, the optimizer and every callback and log of the step. Inductor's C++ kernels
are profiled by name (``cpp.enable_kernel_profile``), so a fused kernel's time is its own event.

Each event's self CPU time goes to one component, read from the event and the events it runs under:
the optimizer (torch's ``Optimizer.step#...`` range), data loading (the DataLoader's ``__next__``), else
the forward or the backward (autograd's ``evaluate_function`` ranges; under full checkpointing the
backward graph recomputes the layer's forward, so recompute is counted with the backward and shown by
its calls: bitsandbytes' dequantizations and the matmuls, per pass) and, within each, the kind of op:
bitsandbytes' 4-bit dequantization, matmuls by their shapes (a dimension of the LoRA rank: LoRA; of the
vocabulary: the loss head's projection; else the dequantized base weight), attention (sdpa), the loss
head's softmax and cross-entropy, and the rest (norms, rotary, activations, casts, fused elementwise
kernels). What no operator covers (Python: the Trainer's loop, callbacks, module calls, dynamo's guards)
is the window's wall time less its root events' time.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

FIRST, STEPS = 4, 3  # profiled steps 4 to 6: after step 1's compile and step 2's dynamic recompile
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm"}
LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy", "logsumexp", "_softmax", "entropy")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "_efficient_attention")
OTHER = "other ops (norms, rotary, activations, casts, fused elementwise)"


def profile_callback(vocab_size: int, rank: int):
    """A TrainerCallback that profiles steps FIRST..FIRST+STEPS-1 and keeps the events and the window's wall."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class ProfiledSteps(TrainerCallback):
        def __init__(self) -> None:
            self.profiler, self.settings = None, {}
            self.start, self.wall, self.cpu_start, self.cpu = 0.0, 0.0, 0.0, 0.0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.settings = settings_of(model, args)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == FIRST - 1:
                self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                self.profiler.__enter__()
                self.start, self.cpu_start = time.perf_counter(), time.process_time()
            elif state.global_step == FIRST + STEPS - 1 and self.profiler is not None:
                self.wall = time.perf_counter() - self.start
                self.cpu = time.process_time() - self.cpu_start
                self.profiler.__exit__(None, None, None)

        def components(self) -> dict:
            found = components(self.profiler.profiler.function_events, self.wall, vocab_size, rank)
            return {**found, "cpu": self.cpu}

    return ProfiledSteps()


def settings_of(model, args) -> dict:
    """What each side actually runs, read off the model and the Trainer's arguments at train begin."""
    import torch

    names = {name: p for name, p in model.named_parameters()}
    lora = next(p for name, p in names.items() if "lora_A" in name)
    norm = next(p for name, p in names.items() if name.endswith("norm.weight"))
    embed = next(p for name, p in names.items() if "embed_tokens" in name)
    head = next((p for name, p in names.items() if "lm_head" in name), None)
    import bitsandbytes

    quantized = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return {
        "gradient checkpointing": f"{sum(bool(m.gradient_checkpointing) for m in layers)} of "
        f"{len(layers)} layers",
        "autocast": "bf16" if args.bf16 else "fp16" if args.fp16 else "none",
        "4-bit layers' compute dtype": str(quantized[0].compute_dtype).replace("torch.", ""),
        "LoRA weights": str(lora.dtype).replace("torch.", ""),
        "norms / embedding / lm_head": "/".join(
            str(p.dtype).replace("torch.", "") if p is not None else "tied" for p in (norm, embed, head)
        ),
        "torch threads": torch.get_num_threads(),
    }


def components(events, wall: float, vocab_size: int, rank: int) -> dict:
    """Self CPU seconds per component, calls of the ops that show recompute, and the positions per forward
    (rows x padded length: the forward's base matmuls' first dimension)."""
    seconds, calls, positions, others = defaultdict(float), Counter(), set(), defaultdict(float)
    roots = 0.0
    for event in events:
        chain = _chain(event)
        if event.cpu_parent is None:
            roots += event.cpu_time_total / 1e6
        component = _component(event, chain, vocab_size, rank)
        if component == "forward: base matmuls (dequantized weights)" and event.name in MATMULS:
            positions.add(event.input_shapes[0][0])
        seconds[component] += event.self_cpu_time_total / 1e6
        if component.endswith(OTHER):
            others[f"{component.split(':')[0]}: {_op_kind(event.name)}"] += event.self_cpu_time_total / 1e6
        if event.name.startswith("bitsandbytes::") or event.name in MATMULS:
            phase = (
                component.split(":")[0].split(" (")[0].split(" and ")[0]
            )  # forward, backward, optimizer step
            calls[f"{event.name} ({phase})"] += 1
    seconds["Python outside any operator (Trainer loop, callbacks, module calls, guards)"] = max(
        wall - roots, 0.0
    )
    largest = dict(sorted(others.items(), key=lambda item: -item[1])[:8])
    return {
        "seconds": seconds,
        "calls": calls,
        "wall": wall,
        "positions": sorted(positions),
        "others": largest,
    }


def _op_kind(name: str) -> str:
    """An op's or C++ kernel's name without what differs between the two sides' graphs: the graph's number,
    the kernel's index, a compiled graph's hash (its code outside the profiled kernels)."""
    if name.startswith("## Call CompiledFxGraph"):
        return "a compiled graph's own code, outside its kernels"
    return re.sub(r"_\d+$", "", re.sub(r"^graph_\d+_", "", name))[:80]


def _chain(event) -> list:
    chain = []
    while event is not None:
        chain.append(event)
        event = event.cpu_parent
    return chain


def _under(chain, text: str) -> bool:
    return any(text in event.name for event in chain)


def _component(event, chain, vocab_size: int, rank: int) -> str:
    if any(e.name.startswith(("Optimizer.step", "Optimizer.zero_grad")) for e in chain):
        return "optimizer step and zero_grad (paged AdamW 8-bit)"
    if _under(chain, "DataLoader"):
        return "data loading and collation"
    phase = "backward (with recompute)" if _under(chain, "evaluate_function") else "forward"
    return f"{phase}: {_kind(chain, vocab_size, rank)}"


def _kind(chain, vocab_size: int, rank: int) -> str:
    """The kind of op of the innermost event that says one (the event itself first)."""
    for event in chain:
        name = event.name
        if name.startswith("bitsandbytes::"):
            return "4-bit dequantization (bitsandbytes)"
        if any(op in name for op in ATTENTION_OPS):
            return "attention (sdpa)"
        if name in MATMULS:
            dims = {d for shape in event.input_shapes for d in shape}
            if vocab_size in dims:
                return "loss head: lm_head matmuls"
            if rank in dims:
                return "LoRA matmuls"
            return "base matmuls (dequantized weights)"
        if any(op in name for op in LOSS_OPS):
            return "loss head: softmax, cross-entropy"
        if name.startswith("autograd::engine::evaluate_function") or name.startswith("Optimizer"):
            break
    return OTHER


def profile_child(job: dict) -> None:
    """One profiled run of ``job`` (vs_trl's job, compiled, padded) in this process: a PROFILE line."""
    import torch._inductor.config
    from transformers import AutoConfig
    from vs_trl import run_qlora_kit, run_trl

    torch._inductor.config.cpp.enable_kernel_profile = True  # each C++ kernel an event of its own
    vocab = AutoConfig.from_pretrained(job["model_dir"]).vocab_size
    callback = profile_callback(vocab, rank=16)
    with tempfile.TemporaryDirectory() as out:
        run = run_trl if job["system"] == "trl" else run_qlora_kit
        result = run(job, str(Path(out) / "run"), callbacks=[callback])
    from torch._dynamo.utils import counters

    profile = callback.components()
    profile["settings"] = callback.settings
    profile["graph breaks"] = sum(counters["graph_break"].values())
    profile["unique graphs"] = counters["stats"]["unique_graphs"]
    profile["step times"] = result["times"]
    profile["trained tokens"] = result["tokens"][FIRST - 1 : FIRST - 1 + STEPS]
    print("PROFILE " + json.dumps(profile), flush=True)


def profile_both(setup: dict, seed: int = 0) -> dict:
    """Each system's profile, each in its own process (qlora_kit first, then TRL), as vs_trl.spawn runs them."""
    import subprocess
    import sys

    import vs_trl

    profiles = {}
    for system in ("qlora_kit", "trl"):
        job = {**setup, "system": system, "steps": FIRST + STEPS - 1, "packing": False, "compile": True}
        job.update(seed=seed, profile=True)
        done = subprocess.run(
            [sys.executable, vs_trl.__file__, "--child", json.dumps([job])],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PROFILE ")]
        if not lines:
            raise RuntimeError(f"{system} failed:\n{done.stderr[-3000:]}")
        profiles[system] = json.loads(lines[0][8:])
    return profiles


def tables(profiles: dict) -> tuple[str, str]:
    """The component table (CPU s/step each side, the difference), the settings-and-calls table and the
    largest ops of the 'other ops' rows. A component's seconds are its share of the profiled window's wall
    time times the process's CPU time over the window: a process the machine's other jobs kept waiting
    has longer ops by the wall clock, not more work."""
    from common import markdown_table

    ours, theirs = profiles["qlora_kit"], profiles["trl"]

    def per_step(profile: dict, seconds: float) -> float:
        return seconds * profile["cpu"] / profile["wall"] / STEPS

    def rows_of(key: str, least: float) -> list[list[str]]:
        names = set(ours[key]) | set(theirs[key])
        found = {
            n: (per_step(ours, ours[key].get(n, 0.0)), per_step(theirs, theirs[key].get(n, 0.0)))
            for n in names
        }
        ordered = sorted(found.items(), key=lambda item: -max(item[1]))
        return [[n, f"{a:.3f}", f"{b:.3f}", f"{a - b:+.3f}"] for n, (a, b) in ordered if max(a, b) >= least]

    rows = rows_of("seconds", 0.0005)
    wall_a, wall_b = ours["wall"] / STEPS, theirs["wall"] / STEPS
    cpu_a, cpu_b = ours["cpu"] / STEPS, theirs["cpu"] / STEPS
    rows.append(["**the step: process CPU time**", f"{cpu_a:.3f}", f"{cpu_b:.3f}", f"{cpu_a - cpu_b:+.3f}"])
    rows.append(["the step: wall time (load)", f"{wall_a:.3f}", f"{wall_b:.3f}", f"{wall_a - wall_b:+.3f}"])
    header = ["component", "qlora_kit CPU s/step", "TRL CPU s/step", "difference"]
    largest = ["the largest of the other ops (phase: op or C++ kernel)", *header[1:]]
    seconds = markdown_table(header, rows) + "\n\n" + markdown_table(largest, rows_of("others", 0.002))
    facts = [
        [name, str(ours["settings"].get(name)), str(theirs["settings"].get(name))]
        for name in ours["settings"]
    ]
    for name, key in (
        ("positions per forward (rows x padded length), profiled steps", "positions"),
        ("trained tokens (profiled steps)", "trained tokens"),
        ("graph breaks / unique graphs (whole run)", None),
    ):
        if key is None:
            facts.append([name, *(f"{p['graph breaks']} / {p['unique graphs']}" for p in (ours, theirs))])
        else:
            facts.append([name, *(str(p[key]) for p in (ours, theirs))])
    calls = sorted(set(ours["calls"]) | set(theirs["calls"]))
    facts += [[f"calls of {name}, per step", *(f"{p['calls'].get(name, 0) / STEPS:g}" for p in (ours, theirs))]
              for name in calls]  # fmt: skip
    facts.append(
        [
            "step times, every step (s)",
            *(", ".join(f"{t:.2f}" for t in p["step times"]) for p in (ours, theirs)),
        ]
    )
    return seconds, markdown_table(["setting or count", "qlora_kit", "TRL"], facts)


def write_profile(setup: dict, model_text: str, out: Path) -> None:
    """Profile both sides and write vs-trl-compiled-profile-DEVICE.md (with the load average around it)."""
    import os

    from common import device_name, write_result

    load_before = os.getloadavg()[0]
    profiles = profile_both(setup)
    load_after = os.getloadavg()[0]
    seconds, facts = tables(profiles)
    notes = (
        f"{model_text}; both compiled at equal settings (vs_trl.py --compiled's job: padded batches, seed 0), "
        f"each in its own process; steps {FIRST} to {FIRST + STEPS - 1} profiled (torch.profiler, CPU, "
        "record_shapes, inductor's C++ kernels as events). A component's seconds a step: its self CPU time "
        "over the window's wall time (its share of the window) times the process's CPU time a step (its "
        f"work, whatever the machine's load kept it waiting). Load average (1 min) {load_before:.1f} before, "
        f"{load_after:.1f} after. The profiler's own cost is in both sides' figures; shares within one "
        "process move less with the machine's load than wall times do."
    )
    write_result(
        f"vs-trl-compiled-profile-{device_name()}",
        "Where a compiled step's time goes: qlora_kit vs TRL, per component",
        seconds + "\n\n" + facts,
        notes,
        out,
    )
