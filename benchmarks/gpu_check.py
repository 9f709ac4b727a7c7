"""The GPU check: every case in a process of its own, with its own time limit, its rows printed and
written as soon as it ends, so one failing or hanging case loses only its own rows.

The cases: ``gpu_rows.CASES`` (checkpointing policies against the planner, selective, auto, a real
out-of-memory error split, long context, paged optimizers, the default loss head's cost), then
``qlora-kit doctor``, ``moe.py --expert-counts`` (a mixture layer's step at 8, 64 and 128 experts,
CUDA-synchronised), ``vs_trl.py --gpu`` (against a TRL SFTTrainer script on the 1B model) and
``experts_on_host.py`` (GPU only: a mixture under a memory cap with its experts in host memory). Each
case's JSON lands in ``--out`` as ``gpu-check.json`` (rewritten after every case) and its log beside it.

    bash benchmarks/gpu_check.sh                        # on the lent machine (installs the carried wheels)
    python benchmarks/gpu_check.py --tiny               # anywhere: the same cases on a tiny model
    python benchmarks/gpu_check.py --tiny --cases oom selective --break selective   # one case broken
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BREAK_ENV = "GPU_CHECK_BREAK"  # a case named here raises at its start (tests/e2e/test_gpu_check.py)
ROW = "ROW "
# Seconds each case may take on the H200 (the case's own process start included)
LIMITS = {
    "prepare": 150,  # the 1B model built and saved once (random weights): not the first case's time
    "selective": 50,
    "auto": 70,
    "oom": 80,
    "policies": 75,
    "defaults": 40,
    "long": 50,
    "optimizers": 60,
    "doctor": 40,
    "moe": 60,
    "vs_trl": 90,
    "experts_on_host": 120,  # GPU only: a mixture under a memory cap with its experts in host memory
}
# gpu_rows' cases whose rows a tiny model cannot give: --tiny reports them skipped without starting their
# process (a start is ~7 s on 2 cores, spent to learn what is known here)
TINY_SKIPS = {
    # its cap sits between two micro-batches' peaks, which a tiny model's activations (below the CUDA
    # allocator's blocks) cannot separate
    "oom": "activations below the allocator's blocks "
    "(benchmarks/oom_recovery.py: the fault injector's case on the CPU)",
}


def external(case: str, tiny: bool, out: Path) -> list[str] | None:
    """The command of a case that is another script (None: not run at this size)."""
    if case == "doctor":
        return None if tiny else [sys.executable, "-m", "qlora_kit", "doctor", "recipes/demo.yaml"]
    if case == "moe":
        size = ["--smoke", "--compute-dtype", "float32"] if tiny else ["--tokens", "512", "2048", "8192"]
        return [sys.executable, str(HERE / "moe.py"), "--expert-counts", *size, "--out", str(out)]
    if case == "vs_trl":
        return None if tiny else [sys.executable, str(HERE / "vs_trl.py"), "--gpu", "--out", str(out)]
    if case == "experts_on_host":
        return None if tiny else [sys.executable, str(HERE / "experts_on_host.py"), "--out", str(out)]
    return None


def run_case(case: str, tiny: bool, out: Path, limit: float) -> dict:
    """One case in a process of its own: its rows, or what stopped it (an error's last line, a timeout)."""
    if tiny and case in TINY_SKIPS:
        return {"skipped": f"--tiny: {TINY_SKIPS[case]}"}
    command = external(case, tiny, out)
    if command is None and case not in ("doctor", "moe", "vs_trl", "experts_on_host"):
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--case",
            case,
            *(["--tiny"] if tiny else []),
        ]
    if command is None:
        return {"skipped": "a GPU-sized case (--tiny runs without it)"}
    started = time.perf_counter()
    log = out / f"gpu-check-{case}.log"
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = _text(expired.stdout) + _text(expired.stderr), f"timed out after {limit:.0f} s"
    log.write_text(output)
    seconds = round(time.perf_counter() - started, 1)
    rows = [json.loads(line[len(ROW) :]) for line in output.splitlines() if line.startswith(ROW)]
    if rows:
        return {**rows[-1], "seconds": seconds}
    # progress bars end in carriage returns and "it/s]": not a case's last word
    lines = [line for line in output.splitlines() if line.strip() and "it/s]" not in line]
    if code == 0 and case in ("doctor", "moe", "vs_trl"):
        return {"output": lines[-40:], "seconds": seconds}
    return {"error": f"exit {code}: {lines[-1][:400] if lines else 'no output'}", "seconds": seconds}


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def run_cases(cases: list[str], tiny: bool, out: Path) -> dict:
    """Every case in turn, each row printed and the report rewritten as it ends."""
    report: dict = {}
    for case in cases:
        result = run_case(case, tiny, out, LIMITS[case] * (4 if tiny else 1))
        report[case] = result
        (out / "gpu-check.json").write_text(json.dumps(report, indent=2))
        print(f"== {case} ({result.get('seconds', 0)} s)", flush=True)
        for line in describe(case, result):
            print(line, flush=True)
    return report


def describe(case: str, result: dict) -> list[str]:
    """A case's rows as the table's lines."""
    if "error" in result or "skipped" in result:
        return [f"{case}: {result.get('error') or 'skipped, ' + result['skipped']}"]
    if "output" in result:
        return result["output"][-25:]
    lines = []
    for r in result.get("policies", []):
        lines.append(
            f"{r['setting']:40} fwd {r['forward_gib']:6.2f} bwd {r['backward_gib']:6.2f} optim "
            f"{r['optimizer_gib']:6.2f} peak {r['measured_peak_gib']:6.2f} planned {r['predicted_peak_gib']:6.2f} "
            f"GiB | saved {r['saved_mib']:9.1f} planned {r['predicted_saved_mib']:9.1f} MiB | step {r['step_s']:.3f} s"
        )
    if "long_sequence" in result:
        s, c = result["long_sequence"], result["long_context"]
        lines.append(
            f"1 x {s['seq']} tokens, full: forward peak {s['forward_gib']:.2f} GiB, backward {s['backward_gib']:.2f}"
        )
        lines.append(
            f"long context in {c['budget_gib']:.3g} GiB: {c['seq']:,} tokens, peak {c['measured_peak_gib']:.2f} GiB "
            f"(planned {c['planned_peak_gib']:.2f}), host {c['host_gib']:.2f} GiB"
        )
    for r in result.get("optimizers", []):
        lines.append(json.dumps(r))
    if "host_measured_gib" in result:  # experts_on_host
        lines.append(json.dumps({k: round(v, 4) for k, v in result.items() if isinstance(v, float)}))
    if "oom" in result:
        lines.append("out of memory (real): " + json.dumps(result["oom"]))
    return lines


def case_main(case: str, tiny: bool) -> None:
    """The child: one case's rows, as one ``ROW`` line of JSON."""
    sys.path.insert(0, str(HERE))
    import gpu_rows

    if os.environ.get(BREAK_ENV) == case:
        raise RuntimeError(f"{case} broken on purpose ({BREAK_ENV})")
    rows = gpu_rows.CASES[case](gpu_rows.Setup(tiny))
    print(ROW + json.dumps({"versions": gpu_rows.versions(), **rows}), flush=True)


def main() -> None:
    from common import parser

    options = parser(__doc__, out=Path(os.environ.get("OUT", "gpu-check-out")))
    options.add_argument("--tiny", action="store_true", help="a tiny model: a smoke test that runs anywhere")
    options.add_argument("--cases", nargs="+", default=list(LIMITS), choices=list(LIMITS))
    options.add_argument("--break", dest="broken", help="make this case fail at its start (a test)")
    options.add_argument("--case", help=argparse.SUPPRESS)
    options.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = options.parse_args()
    tiny = args.tiny or args.smoke
    if args.child:
        import gpu_rows

        folder, data, optimizer, batch, seq, steps = args.child
        row = gpu_rows.optimizer_row(Path(folder), Path(data), optimizer, int(batch), int(seq), int(steps))
        print("RESULT " + json.dumps(row))
        return
    if args.case:
        case_main(args.case, tiny)
        return
    if args.broken:
        os.environ[BREAK_ENV] = args.broken
    args.out.mkdir(parents=True, exist_ok=True)
    run_cases(args.cases, tiny, args.out)


if __name__ == "__main__":
    main()
