"""The GPU check's ``experts_on_host`` case: a mixture whose resident plan exceeds a memory cap trains under
that cap with its experts in host memory (``memory.experts_on_host``). GPU only (the CPU proofs are
tests/test_experts_on_host.py); ``benchmarks/gpu_check.py`` runs it in a process of its own.

A Qwen3-MoE-shaped model with random weights (12 layers of 64 experts, hidden 1024, expert width 512; the
experts most of its 4-bit bytes), 1 x 1,024 tokens, full checkpointing. Rows:
- resident, uncapped: measured peak and step time;
- experts on host under ``torch.cuda.set_per_process_memory_fraction`` at the midpoint of the two plans'
  peaks (the resident run would not fit it): measured peak against the plan, step time against the
  resident run's;
- the copy: one layer's experts copied from pinned memory to the device, timed alone with CUDA events,
  times the copies a step makes (every layer, forward and backward); the share of it not hidden behind
  compute is (host step - resident step) / copy time, clipped to [0, 1].

    python benchmarks/experts_on_host.py --out DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import parser, scratch_folder  # noqa: E402
from gpu_rows import GIB, recipe_for, text_rows, train  # noqa: E402

SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
}
SEQ, STEPS = 1024, 4


def planned(recipe):
    from qlora_kit.memory import loss_choice
    from qlora_kit.memory.planner import plan

    recipe = loss_choice.resolve_head(recipe)
    return plan(recipe, batch=1, seq=SEQ, device="cuda", padded=False)


def copy_seconds(layer_bytes: int, copies: int) -> float:
    """``copies`` copies of ``layer_bytes`` from pinned host memory to the device, timed alone."""
    host = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        device.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def main() -> None:
    args = parser(__doc__, out=Path(".")).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("experts_on_host: a GPU-only case (no CUDA here)")
    from qlora_kit.model import builtin

    folder = builtin.ensure_tiny_model("tiny-qwen3-moe", **SHAPE)
    data = text_rows(scratch_folder("experts-on-host-"), SEQ, 32)
    memory = {"checkpointing": "full"}
    resident_recipe = recipe_for(folder, data, memory, 1, SEQ, STEPS)
    host_recipe = recipe_for(folder, data, {**memory, "experts_on_host": True}, 1, SEQ, STEPS)
    resident_plan, host_plan = planned(resident_recipe), planned(host_recipe)
    resident_peak = resident_plan.chosen(resident_recipe).peak
    host_peak = host_plan.chosen(host_recipe).peak
    resident = train(resident_recipe)
    cap = (resident_peak + host_peak) / 2
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    on_host = train(host_recipe)
    torch.cuda.set_per_process_memory_fraction(1.0)
    layers = SHAPE["num_hidden_layers"]  # a micro-batch copies every layer twice (forward, backward)
    copy_s = copy_seconds(host_plan.host_experts // layers, 2 * layers)
    step = {name: SEQ / usage["tokens_per_s"] for name, usage in (("resident", resident), ("host", on_host))}
    measured = max(on_host.get(f"peak_{p}_gib", 0.0) for p in ("forward", "backward", "optimizer"))
    row = {
        "cap_gib": cap / GIB,
        "resident_planned_gib": resident_peak / GIB,
        "resident_measured_gib": max(resident.get(f"peak_{p}_gib", 0.0) for p in ("forward", "backward")),
        "host_planned_gib": host_peak / GIB,
        "host_measured_gib": measured,
        "host_vs_plan": measured / (host_peak / GIB) - 1,
        "resident_step_s": step["resident"],
        "host_step_s": step["host"],
        "copied_gib_per_micro_batch": 2 * host_plan.host_experts / GIB,
        "copy_s_per_micro_batch": copy_s,
        "copy_not_overlapped": min(1.0, max(0.0, (step["host"] - step["resident"]) / copy_s)),
    }
    (args.out / "experts-on-host.json").write_text(json.dumps(row, indent=2))
    print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
