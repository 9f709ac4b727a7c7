"""qlora_kit against the script users would otherwise write: TRL's SFTTrainer + peft + BitsAndBytesConfig.

Both train the same tiny base model (built from a config, loaded NF4 + double quantization), LoRA r=16
on all linear layers, the same prompt/completion data with completion-only loss, sequences up to 256
tokens, micro-batch 8, paged 8-bit AdamW, gradient checkpointing, lr 2e-4 constant, the same number of
steps. Each run is its own process (peak resident memory is per process; --smoke runs both comparisons
in one process per system), run interleaved — A B A B
... over several rounds, after a warm-up pair, round r with seed r — and reports the median step time,
trained (label) tokens per second (the median of per-step rates), on a CPU the same per second of the
process's CPU time (the work, where other jobs keep a process waiting for a core), peak RSS and the mean
final loss with its span over the seeds.

1. equal settings: qlora_kit with padded batches like TRL's default (its chunked loss head on, as by
   default; it does not change the loss), TRL without its default bf16 autocast and with its LoRA weights
   back in fp32 after SFTTrainer cast them to bf16 (qlora_kit keeps LoRA in fp32 on CPUs), so both compute
   in the same precision;
2. defaults: qlora_kit's defaults (packing into rows, chunked loss) against TRL's defaults (bf16 autocast);
3. with --compiled, instead (its own table, vs-trl-compiled-*.md): equal settings with both compiled,
   qlora_kit's ``train.compile: true`` (its decoder layers) against TRL's ``torch_compile=True`` (the
   Trainer compiles the whole model); each run's first step, which compiles, is left out as every warm-up
   step is, and a recompile later (another padded length) counts in its step's time.

Counting and timing go through public seams only: a TrainerCallback times each step on both sides;
qlora_kit's trained tokens per step come from the ``trained_tokens`` totals the run writes to its
metrics.jsonl (logged every step), TRL's are counted by wrapping the script's own ``trainer.data_collator``.

    python benchmarks/vs_trl.py [--rounds 3] [--steps 24]
    python benchmarks/vs_trl.py --real-model [--rounds 1] [--steps 5]   # SmolLM2-135M-Instruct, 4 x 96
    python benchmarks/vs_trl.py --compiled [--rounds 1] [--steps 12]   # equal settings, both compiled
    python benchmarks/vs_trl.py --profile   # --compiled's runs profiled per component (vs_trl_profile.py)
    python benchmarks/vs_trl.py --smoke --out /tmp/x   # one round of 3 steps on a smaller model, one
                                                       # process per system for both comparisons
    python benchmarks/vs_trl.py --gpu --out $OUT   # CUDA: a 1B Llama (gpu_check.FULL_SHAPE, Llama-3's
        # vocabulary), 512 rows of up to 1,024 tokens, bf16 autocast on both sides, one round of 10 steps,
        # each run its own process; trained tokens/s and peak allocated GPU memory (~2-3 min on an H200)
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
SMOKE_SHAPE = {**SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
BATCH, MAX_LEN, LR, SEED = 8, 256, 2e-4, 0  # SEED: the data; each round trains with its own seed
ROWS = 1024


def make_dataset(folder: Path, rows: int = ROWS, scale: int = 1) -> Path:
    """prompt/completion rows whose lengths vary about 10x (20 to 220 tokens, times ``scale``)."""
    from qlora_kit.model.builtin import corpus_words

    words = corpus_words()
    rng = random.Random(SEED)
    path = folder / "prompt-completion.jsonl"
    with path.open("w") as handle:
        for _ in range(rows):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(4, 40 * scale)))
            completion = " ".join(rng.choice(words) for _ in range(rng.randint(6 * scale, 70 * scale)))
            handle.write(json.dumps({"prompt": prompt + "\n", "completion": completion}) + "\n")
    return path


class Counter:
    """Wraps a data collator: counts trained tokens (labels != -100) of every batch it builds."""

    def __init__(self, collate) -> None:
        self.collate, self.tokens = collate, []

    def __call__(self, features):
        batch = self.collate(features)
        self.tokens.append(int((batch["labels"] != -100).sum()))
        return batch


def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Each step's wall time and its process CPU time: on a CPU shared with other jobs a step's wall
        time counts the time the process waited for a core; its CPU time counts the work."""

        def __init__(self) -> None:
            self.times, self.cpu_times, self.start, self.cpu_start = [], [], 0.0, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)
            self.cpu_times.append(time.process_time() - self.cpu_start)

    return StepTimer()


def run_qlora_kit(job: dict, out: str, callbacks=()) -> dict:
    from qlora_kit import Recipe, train

    recipe = Recipe.from_dict(
        {
            "model": {"path": job["model_dir"]},
            "data": {
                "path": job["data"],
                "format": "completion",
                "max_seq_len": job["max_len"],
                "packing": job["packing"],
            },
            "optimizer": {"lr": LR, "warmup_ratio": 0.0},
            "train": {
                "output_dir": out,
                "max_steps": job["steps"],
                "micro_batch_size": job["batch"],
                "logging_steps": 1,
                "seed": job["seed"],
                # unset, train.compile auto: runs under its 50 steps stay eager, unmeasured
                **({"compile": True} if job["compile"] else {}),
            },
        }
    )
    timer = step_timer()
    result = train(recipe, callbacks=[timer, *callbacks])
    # The run's own count (metrics.jsonl): trained_tokens is the running total of label tokens at each log.
    totals = [row["trained_tokens"] for row in result.metrics if "trained_tokens" in row]
    tokens = [now - before for before, now in zip([0, *totals], totals, strict=False)]
    return {
        "times": timer.times,
        "cpu_times": timer.cpu_times,
        "losses": result.train_losses,
        "tokens": tokens,
    }


def run_trl(job: dict, out: str, callbacks=()) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    # The way TRL's documentation sets up QLoRA.
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        job["model_dir"], quantization_config=quantization, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    dataset = load_dataset("json", data_files=job["data"], split="train")
    peft_config = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    args = SFTConfig(
        output_dir=out,
        max_steps=job["steps"],
        per_device_train_batch_size=job["batch"],
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="paged_adamw_8bit",
        max_grad_norm=0.3,
        gradient_checkpointing=True,
        max_length=job["max_len"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=job["seed"],
        use_cpu=not torch.cuda.is_available(),
        torch_compile=job["compile"],
        # TRL turns bf16 autocast on by default; qlora_kit computes the 4-bit layers in bf16 and the LoRA
        # matrices in fp32 without autocast on CPUs, under bf16 autocast on a GPU (as TRL). Equal settings
        # means the same precision: TRL's bf16 off on a CPU only.
        **({} if job["packing"] or torch.cuda.is_available() else {"bf16": False}),
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, peft_config=peft_config, processing_class=tokenizer
    )
    if not job["packing"] and not torch.cuda.is_available():
        # Equal settings, equal precision: SFTTrainer casts a quantized model's LoRA weights to bf16 (the
        # QLoRA paper's choice; trl/trainer/sft_trainer.py, "_is_quantized_model"), where qlora_kit keeps
        # peft's fp32 adapters and runs them in fp32 on a CPU. Before train() builds the optimizer.
        for parameter in trainer.model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()
    trainer.data_collator = counter = Counter(trainer.data_collator)
    timer = step_timer()
    for callback in [timer, *callbacks]:
        trainer.add_callback(callback)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    # accelerate's loader builds one batch ahead (to know the last one): keep the batches trained on
    tokens = counter.tokens[: len(timer.times)]
    return {"times": timer.times, "cpu_times": timer.cpu_times, "losses": losses, "tokens": tokens}


def child(jobs: list[dict]) -> None:
    """Each job in turn, in this process; a RESULT line each, its peak RSS this process's so far."""
    import torch

    for job in jobs:
        if job.get("profile"):
            from vs_trl_profile import profile_child

            profile_child(job)
            continue
        if torch.cuda.is_available():  # each run's own peak
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory() as out:
            run = run_trl if job["system"] == "trl" else run_qlora_kit
            result = run(job, str(Path(out) / "run"))
        if not len(result["times"]) == len(result["tokens"]) == job["steps"]:
            raise RuntimeError(
                f"{job['system']}: {len(result['times'])} step times and {len(result['tokens'])} token counts "
                f"for {job['steps']} steps"
            )
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["peak_allocated_gib"] = (
            torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0
        )
        print("RESULT " + json.dumps(result), flush=True)


def spawn(
    system: str, setup: dict, steps: int, settings: list[tuple[bool, bool]], seed: int = SEED
) -> list[dict]:
    """One process of ``system`` training once per (packing, compile) setting, in order: the runs' results."""
    jobs = [
        {**setup, "system": system, "steps": steps, "packing": p, "compile": c, "seed": seed}
        for p, c in settings
    ]
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(jobs)], capture_output=True, text=True, timeout=3600
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if len(lines) != len(jobs):
        raise RuntimeError(f"{system} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line[7:]) for line in lines]


def summarise(runs: list[dict]) -> dict:
    # Each run's first step warms up. Throughput is the median of per-step rates, so one stalled step
    # (a page-cache miss, the other process of the machine) does not decide the comparison.
    steps = [(n, t) for run in runs for n, t in zip(run["tokens"][1:], run["times"][1:], strict=True)]
    cpu = [(n, t) for run in runs for n, t in zip(run["tokens"][1:], run["cpu_times"][1:], strict=True)]
    return {
        "step": statistics.median(t for _, t in steps),
        "tokens_per_s": statistics.median(n / t for n, t in steps),
        "cpu_step": statistics.median(t for _, t in cpu),
        "tokens_per_cpu_s": statistics.median(n / t for n, t in cpu),
        "rss": max(run["peak_rss_mib"] for run in runs),
        "allocated": max(run.get("peak_allocated_gib", 0.0) for run in runs),
        "loss": statistics.mean(run["losses"][-1] for run in runs),
        "loss_spread": max(run["losses"][-1] for run in runs) - min(run["losses"][-1] for run in runs),
    }


def main() -> None:
    from common import (
        REAL_MODEL,
        device_name,
        markdown_table,
        parser,
        real_model_dir,
        scratch_folder,
        write_result,
    )

    options = parser(__doc__)
    options.add_argument("--rounds", type=int, default=None, help="default: 3, or 1 with --real-model")
    options.add_argument("--steps", type=int, default=None, help="default: 24, or 5 with --real-model")
    options.add_argument("--child", help=argparse.SUPPRESS)
    options.add_argument(
        "--compiled", action="store_true", help="equal settings with both compiled, in a table of its own"
    )
    options.add_argument(
        "--profile",
        action="store_true",
        help="--compiled's runs under torch.profiler: each side's step per component (its own table)",
    )
    options.add_argument(
        "--gpu", action="store_true", help="CUDA: a 1B Llama, rows up to 1,024 tokens, bf16 on both sides"
    )
    args = options.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    from qlora_kit.model import builtin

    # --smoke: a smaller model, shorter rows, one round of 3 steps (the first is a warm-up), no warm-up pair
    shape, batch, max_len, examples = (
        (SMOKE_SHAPE, 2, 64, 64) if args.smoke else (SHAPE, BATCH, MAX_LEN, ROWS)
    )
    rounds, steps = (1, 3) if args.smoke else (args.rounds or 3, args.steps or 24)
    scale = 1
    if args.gpu:  # the H200 note's settings (../shared/notes/gpu-h200-2026-12-04.md)
        import torch
        from gpu_rows import FULL_SHAPE, TINY_SHAPE

        if not torch.cuda.is_available():
            sys.exit("vs_trl.py --gpu: no CUDA device here")
        shape = TINY_SHAPE if args.smoke else FULL_SHAPE
        batch, max_len, examples, scale = (2, 128, 64, 1) if args.smoke else (8, 1024, 512, 6)
        rounds, steps = (1, 3) if args.smoke else (args.rounds or 1, args.steps or 10)
    if args.real_model:  # 30 layers of hidden 576: shorter rows, fewer steps
        batch, max_len, examples = (2, 64, 64) if args.smoke else (4, 96, 256)
        rounds, steps = (1, 3) if args.smoke else (args.rounds or 1, args.steps or 5)
        model_dir, model_text = (
            str(real_model_dir()),
            f"SmolLM2-135M-Instruct (builtin:{REAL_MODEL}, pretrained)",
        )
    else:
        model_dir, model_text = str(builtin.ensure_tiny_model("tiny-llama", **shape)), f"Tiny Llama {shape}"
    folder = scratch_folder("vs-trl-")
    data = str(make_dataset(folder, examples, scale))
    setup = {"model_dir": model_dir, "data": data, "batch": batch, "max_len": max_len}
    if args.profile:  # --compiled's job, profiled per component (vs_trl_profile.py)
        from vs_trl_profile import write_profile

        write_profile(setup, f"{model_text}, micro-batch {batch}, max length {max_len}", args.out)
        return
    # each comparison's (packing, compile) on both sides
    comparisons = {
        "equal settings (padded batches)": (False, False),
        "defaults (qlora_kit packs)": (True, False),
    }
    if args.compiled:
        comparisons = {"equal settings, both compiled (padded batches)": (False, True)}
    # Every run its own process, but at --smoke: there one process per system and round trains both
    # comparisons (process starts were most of its time), so the second run's peak RSS is its process's.
    groups = [list(comparisons)] if args.smoke else [[name] for name in comparisons]
    # the real model's rows: each run's first step only; compiled runs: each compiles in its first step,
    # which the summary leaves out
    warm_up = not (args.smoke or args.real_model or args.gpu or args.compiled)
    runs = {name: {"qlora_kit": [], "trl": []} for name in comparisons}
    for names in groups:
        settings = [comparisons[name] for name in names]
        if warm_up:
            spawn("qlora_kit", setup, 4, settings)  # warm-up pair: caches, page cache
            spawn("trl", setup, 4, settings)
        for seed in range(rounds):
            for system in ("qlora_kit", "trl"):
                for name, result in zip(names, spawn(system, setup, steps, settings, seed), strict=True):
                    runs[name][system].append(result)
    rows, verdicts = [], []
    for name in comparisons:
        a, b = summarise(runs[name]["qlora_kit"]), summarise(runs[name]["trl"])
        for system, r in (("qlora_kit", a), ("TRL SFTTrainer", b)):
            rows.append(
                [
                    name,
                    system,
                    f"{r['step']:.3f}",
                    f"{r['tokens_per_s']:,.0f}",
                    *([] if args.gpu else [f"{r['cpu_step']:.3f}", f"{r['tokens_per_cpu_s']:,.0f}"]),
                    f"{r['rss']:,.0f}",
                    *([f"{r['allocated']:.2f}"] if args.gpu else []),
                    f"{r['loss']:.3f} (seeds span {r['loss_spread']:.3f})",
                ]
            )
        verdicts.append(
            f"{name}: throughput {a['tokens_per_s'] / b['tokens_per_s']:.2f}x TRL's"
            + ("" if args.gpu else f" ({a['tokens_per_cpu_s'] / b['tokens_per_cpu_s']:.2f}x per CPU second)")
            + f", peak RSS {a['rss'] / b['rss']:.2f}x"
            + (f", peak allocated {a['allocated'] / b['allocated']:.2f}x" if args.gpu else "")
        )
    table = markdown_table(
        [
            "comparison",
            "system",
            "median step (s)",
            "trained tokens/s",
            *([] if args.gpu else ["median step CPU (s)", "trained tokens per CPU s"]),
            "peak RSS (MiB)",
            *(["peak allocated (GiB)"] if args.gpu else []),
            "final loss",
        ],
        rows,
    )
    notes = (
        "; ".join(verdicts)
        + f". {model_text}, NF4 + double quant, LoRA r=16 all-linear, paged AdamW 8-bit, lr {LR} constant, "
        f"micro-batch {batch}, max length {max_len}, completion-only loss on {examples:,} prompt/completion rows of "
        f"{20 * scale}-{220 * scale} tokens; {rounds} interleaved rounds of {steps} steps per system"
        f"{' after a warm-up pair' if warm_up else ''}; "
        + (
            "one process per system for both comparisons (--smoke: the second's peak RSS includes the first's)"
            if args.smoke
            else "every run its own process"
        )
        + ", round r with seed r (LoRA init, dropout and data order). "
        + (
            "bf16 autocast on both sides. Targets (issue 69): equal settings >= 1.3x TRL's throughput at <= 0.6x "
            "its peak allocated memory; defaults >= 2x."
            if args.gpu
            else "Targets: equal settings >= 1.0x throughput and <= 1.0x memory with the same loss; defaults >= "
            "1.5x trained tokens/s."
        )
    )
    device, real = device_name(), "-real" if args.real_model else ""
    both = "-compiled" if args.compiled else ""
    title = (
        f"qlora_kit vs a TRL + PEFT script{' on a real model' if real else ''}"
        f"{', both compiled' if both else ''} ({device.upper()})"
    )
    write_result(f"vs-trl{real}{both}-{device}", title, table, notes, args.out)


if __name__ == "__main__":
    main()
