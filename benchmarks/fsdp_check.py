"""FSDP-QLoRA end to end on this machine: one process against FSDP2 over P, then killed and resumed.

Four runs of the demo model through the real CLI, on the GPU's path (bf16 autocast, bf16 compute,
4-bit weights stored as bfloat16, the chunked head with LoRA on the output head): one process with the
global batch (the reference), FSDP over P processes with 1/P of it each, the same FSDP run SIGKILLed
after step 4, and that run resumed. The table gives losses, wall time, the largest difference of the
FSDP adapter from the reference, and whether the resumed adapter equals the uninterrupted one bit for
bit. FSDP runs go through ``tests/e2e/fsdp_launch.py`` (accelerate refuses FSDP on CPU processes; on
GPUs the launcher only adds the kill switch).

    python benchmarks/fsdp_check.py                   # here: 2 CPU processes over gloo
    python benchmarks/fsdp_check.py --processes 1     # the GPU check (one GPU)
    python benchmarks/fsdp_check.py --smoke --out /tmp/x   # 4 steps, checkpoint at 2, killed after 3
    python benchmarks/fsdp_check.py --smoke --out /tmp/x --work /tmp/runs --set train.eval_steps=2

tests/e2e/test_fsdp.py runs the last line (sample prompts set too) and checks the runs' folders and logs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from common import markdown_table, parser, scratch_folder, write_result

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE, KILL = 6, 3, 4  # steps, a checkpoint every SAVE steps, the kill after step KILL
SMOKE_STEPS, SMOKE_SAVE, SMOKE_KILL = 4, 2, 3
BATCH = 8
SETTINGS = [
    "train.logging_steps=1", "train.eval_steps=null",
    "train.sample_prompts=0", "lora.dropout=0.0", "train.mixed_precision=bf16",
    "quant.compute_dtype=bfloat16", "quant.quant_storage=bfloat16", "optimizer.name=adamw_torch",
    "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]",
    # named: auto times the layouts in one process (and may pick another) but chooses by padding in several,
    # so the diff against one process would compare two layouts
    "data.packing=true",
]  # fmt: skip


def overrides(*values: str) -> list[str]:
    return [arg for value in (*SETTINGS, *values) for arg in ("--set", value)]


def run(command: list[str], log: Path, env: dict | None = None) -> tuple[int, float, str]:
    """Exit code, wall seconds and stderr of one run; its stdout and stderr are kept in LOG.stdout/.stderr."""
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    log.with_suffix(".stdout").write_text(done.stdout)
    log.with_suffix(".stderr").write_text(done.stderr)
    return done.returncode, time.perf_counter() - start, done.stderr


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def main() -> None:
    import torch
    from safetensors.torch import load_file

    options = parser(__doc__)
    options.add_argument("--processes", type=int, default=2)
    options.add_argument(
        "--work",
        type=Path,
        help="a new or empty folder for the runs' output folders (one, whole, killed) and logs (NAME.stdout, "
        "NAME.stderr: one, whole, killed, resumed); default: a new temporary folder",
    )
    options.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe value for every run, after this script's own (tests/e2e/test_fsdp.py: evaluation, samples)",
    )
    args = options.parse_args()
    steps, save, kill = (SMOKE_STEPS, SMOKE_SAVE, SMOKE_KILL) if args.smoke else (STEPS, SAVE, KILL)
    schedule = [f"train.max_steps={steps}", f"train.save_steps={save}", *args.settings]
    cuda = torch.cuda.is_available()
    work = args.work or scratch_folder("fsdp-check-")  # named by --work: kept
    work.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / "fsdp-qlora.yaml").read_text())
    config.update(use_cpu=not cuda, num_processes=args.processes)
    (work / "accelerate.yaml").write_text(yaml.safe_dump(config))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(work / "accelerate.yaml"),
    ]
    launch += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    launch += [str(ROOT / "tests" / "e2e" / "fsdp_launch.py"), "train", "recipes/demo.yaml"]
    fsdp = overrides(*schedule, "train.fsdp=true", f"train.micro_batch_size={BATCH // args.processes}")
    threads = {"OMP_NUM_THREADS": "1"} if not cuda else {}

    single = [sys.executable, "-m", "qlora_kit", "train", "recipes/demo.yaml"]
    results = {
        "one process": run(
            [
                *single,
                *overrides(*schedule, f"train.micro_batch_size={BATCH}"),
                "--output-dir",
                str(work / "one"),
            ],
            work / "one",
        ),
        f"FSDP x{args.processes}": run(
            [*launch, *fsdp, "--output-dir", str(work / "whole")], work / "whole", threads
        ),
        f"FSDP x{args.processes}, killed after step {kill}": run(
            [*launch, *fsdp, "--output-dir", str(work / "killed")],
            work / "killed",
            threads | {"QLORA_KIT_TEST_KILL_AFTER_STEP": str(kill)},
        ),
        f"FSDP x{args.processes}, resumed": run(
            [*launch, *fsdp, "--output-dir", str(work / "killed"), "--resume"], work / "resumed", threads
        ),
    }
    folders = dict(zip(results, ["one", "whole", None, "killed"], strict=True))
    reference = (
        load_file(work / "one" / "adapter_model.safetensors") if results["one process"][0] == 0 else {}
    )
    whole = work / "whole" / "adapter_model.safetensors"
    rows = []
    for name, (code, seconds, stderr) in results.items():
        folder = folders[name]
        adapter = load_file(work / folder / "adapter_model.safetensors") if folder and code == 0 else None
        shown = losses(work / folder) if adapter is not None else []
        difference = (
            f"{max((adapter[k] - reference[k]).abs().max().item() for k in reference):.2e}"
            if adapter is not None and reference and adapter.keys() == reference.keys()
            else "-"
        )
        identical = "-"
        if folder == "killed" and adapter is not None and whole.exists():
            uninterrupted = load_file(whole)
            identical = (
                "yes" if all(torch.equal(adapter[k], uninterrupted[k]) for k in uninterrupted) else "NO"
            )
        last_line = stderr.strip().splitlines()[-1][:80] if code and stderr.strip() else ""
        if folder is None:  # the run meant to die
            last_line = f"killed after step {kill}" if code else "NOT KILLED"
        rows.append([
            name, code, f"{seconds:.1f}", " ".join(f"{v:.4f}" for v in shown) or last_line, difference, identical,
        ])  # fmt: skip
    header = [
        "run",
        "exit",
        "wall s",
        "losses (or last line)",
        "max abs diff vs one process",
        "resume bit-identical",
    ]
    device = "gpu" if cuda else "cpu"
    write_result(
        f"fsdp-{device}",
        f"FSDP-QLoRA train, save, kill, resume ({device.upper()})",
        markdown_table(header, rows),
        notes=f"Global batch {BATCH} in every run; the killed run's exit is the SIGKILL's (non-zero by design).",
        folder=args.out,
    )


if __name__ == "__main__":
    main()
