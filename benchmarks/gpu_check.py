"""The GPU check: qlora_kit's memory figures on a real CUDA device, measured against the planner.

On a ~1B-parameter Llama built from a config (random weights, Llama-3's 128,256-token vocabulary so
the loss head matters), loaded in 4-bit through the ordinary loading code:

1. per checkpointing policy: peak allocated memory of forward, backward (with recompute) and the
   optimizer step, from the run's own MemoryMonitor, next to the planner's predicted peak;
2. the chunked loss head on and off: forward and backward peaks;
3. a long-sequence batch (1 x 8,192 tokens, full checkpointing) showing the recompute spike as the
   backward peak over the forward peak;
4. paged vs non-paged 8-bit AdamW at rank 64 (pageable state), each in a subprocess (CUDA errors in
   paged memory end the process): peak allocated, device memory used, step time.

Prints a table last and writes everything as JSON to $OUT (or ./gpu-check-out). ``--tiny`` runs the
same code on a tiny model, on the CPU when there is no GPU: the test suite uses it so this script
cannot rot between the sessions that have a GPU.

    bash benchmarks/gpu_check.sh          # on the lent machine (it installs carried wheels first)
    python benchmarks/gpu_check.py --tiny # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GIB = 1024**3
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
    from qlora_kit import tiny as builtin

    return builtin.ensure_tiny_model("tiny-llama", **(TINY_SHAPE if tiny else FULL_SHAPE))


def setup(
    folder: Path, memory: dict, optimizer: str = "paged_adamw_8bit", rank: int = 16, out: Path | None = None
):
    from qlora_kit import Recipe, adapters, data, model
    from qlora_kit import memory as policy
    from qlora_kit.trainer_setup import build_trainer

    recipe = Recipe.from_dict(
        {
            "model": {"path": str(folder)},
            "memory": memory,
            "lora": {"rank": rank},
            "optimizer": {"name": optimizer},
            "data": {"packing": False},
            "train": {"output_dir": str(out or tempfile.mkdtemp()), "max_steps": 1000},
        }
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    policy.enable_checkpointing(base, recipe.memory)
    peft_model = adapters.attach_lora(base, recipe.lora)
    tokenizer = model.load_tokenizer(recipe.model)
    prepared = data.prepare_datasets(Recipe().data, tokenizer, 0)
    trainer = build_trainer(
        recipe, peft_model, tokenizer, prepared.train, None, Path(recipe.train.output_dir)
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    return recipe, trainer


def run_steps(trainer, vocab: int, batch: int, seq: int, steps: int) -> list[float]:
    device = trainer.model.device
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.training_step(trainer.model, {"input_ids": ids, "labels": ids.clone()})
        trainer.callback_handler.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)
        trainer.optimizer.step()
        trainer.callback_handler.on_optimizer_step(trainer.args, trainer.state, trainer.control)
        trainer.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def policy_rows(folder: Path, vocab: int, batch: int, seq: int, steps: int) -> list[dict]:
    from qlora_kit.planner import plan, policy_name

    rows = []
    settings = [
        {"checkpointing": "none"},
        {"checkpointing": "every_n", "every_n": 2},
        {"checkpointing": "full"},
        {"checkpointing": "full", "chunked_loss": False},
        {"checkpointing": "full", "offload_activations": True},
    ]
    for memory in settings:
        recipe, trainer = setup(folder, memory)
        times = run_steps(trainer, vocab, batch, seq, steps)
        monitor = trainer.memory_monitor
        predicted = plan(recipe, batch=batch, seq=seq, device="cuda" if torch.cuda.is_available() else "cpu")
        chosen = next(
            p
            for p in predicted.policies
            if p.policy == policy_name(recipe.memory.checkpointing, recipe.memory.every_n)
        )
        measured = max(monitor.peaks.forward, monitor.peaks.backward, monitor.peaks.optimizer)
        label = policy_name(recipe.memory.checkpointing, recipe.memory.every_n)
        label += "" if recipe.memory.chunked_loss else " (full logits)"
        label += " + offload" if recipe.memory.offload_activations else ""
        rows.append(
            {
                "setting": label,
                "forward_gib": monitor.peaks.forward / GIB,
                "backward_gib": monitor.peaks.backward / GIB,
                "optimizer_gib": monitor.peaks.optimizer / GIB,
                "predicted_peak_gib": chosen.peak / GIB,
                "measured_peak_gib": measured / GIB,
                "saved_mib": monitor.largest.total / 2**20,
                "predicted_saved_mib": chosen.activations / 2**20,
                "step_s": statistics.median(times[1:] or times),
            }
        )
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def optimizer_child(folder: str, optimizer: str, vocab: int, batch: int, seq: int, steps: int) -> None:
    """Run in a subprocess: one optimizer's peak and step time, printed as JSON."""
    _, trainer = setup(Path(folder), {"checkpointing": "full"}, optimizer=optimizer, rank=64)
    times = run_steps(trainer, vocab, batch, seq, steps)
    peaks = trainer.memory_monitor.peaks
    print(
        "RESULT "
        + json.dumps(
            {
                "optimizer": optimizer,
                "peak_allocated_gib": max(peaks.forward, peaks.backward, peaks.optimizer) / GIB,
                "device_used_gib": peaks.device_used / GIB,
                "step_s": statistics.median(times[1:] or times),
            }
        )
    )


def optimizer_rows(folder: Path, vocab: int, batch: int, seq: int, steps: int) -> list[dict]:
    rows = []
    for optimizer in ("paged_adamw_8bit", "adamw_8bit"):
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(folder),
                optimizer,
                str(vocab),
                str(batch),
                str(seq),
                str(steps),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        line = next((ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")), None)
        rows.append(json.loads(line[7:]) if line else {"optimizer": optimizer, "error": child.stderr[-500:]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model: a smoke test that runs anywhere")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, optimizer, vocab, batch, seq, steps = args.child
        optimizer_child(folder, optimizer, int(vocab), int(batch), int(seq), int(steps))
        return
    out = Path(os.environ.get("OUT", "gpu-check-out"))
    out.mkdir(parents=True, exist_ok=True)
    report = {"versions": versions()}
    print(json.dumps(report["versions"]), flush=True)
    folder = model_folder(args.tiny)
    vocab = (TINY_SHAPE if args.tiny else FULL_SHAPE)["vocab_size"]
    batch, seq, steps = (2, 64, 2) if args.tiny else (4, 2048, 4)
    report["policies"] = policy_rows(folder, vocab, batch, seq, steps)
    long_seq = 256 if args.tiny else 8192
    report["long_sequence"] = policy_rows_long(folder, vocab, long_seq, steps)
    report["optimizers"] = optimizer_rows(folder, vocab, batch, seq, steps)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    print_table(report, batch, seq, long_seq)


def policy_rows_long(folder: Path, vocab: int, seq: int, steps: int) -> dict:
    _, trainer = setup(folder, {"checkpointing": "full"})
    run_steps(trainer, vocab, 1, seq, steps)
    peaks = trainer.memory_monitor.peaks
    return {"seq": seq, "forward_gib": peaks.forward / GIB, "backward_gib": peaks.backward / GIB}


def print_table(report: dict, batch: int, seq: int, long_seq: int) -> None:
    print(f"\n{report['versions']['device']}: batch {batch} x {seq} tokens")
    print(
        f"{'setting':34} {'fwd':>7} {'bwd':>7} {'optim':>7} {'peak':>7} {'planned':>8} {'saved MiB':>10} {'planned':>8} {'step s':>7}"
    )
    for r in report["policies"]:
        print(
            f"{r['setting']:34} {r['forward_gib']:7.2f} {r['backward_gib']:7.2f} {r['optimizer_gib']:7.2f} "
            f"{r['measured_peak_gib']:7.2f} {r['predicted_peak_gib']:8.2f} {r['saved_mib']:10.1f} "
            f"{r['predicted_saved_mib']:8.1f} {r['step_s']:7.3f}"
        )
    lr = report["long_sequence"]
    print(
        f"long sequence 1 x {long_seq}, full: forward peak {lr['forward_gib']:.2f} GiB, backward {lr['backward_gib']:.2f} GiB"
    )
    for r in report["optimizers"]:
        if "error" in r:
            print(f"{r['optimizer']:18} failed: {r['error'][-200:]}")
        else:
            print(
                f"{r['optimizer']:18} r=64: peak allocated {r['peak_allocated_gib']:.2f} GiB, "
                f"device used {r['device_used_gib']:.2f} GiB, step {r['step_s']:.3f} s"
            )


if __name__ == "__main__":
    main()
