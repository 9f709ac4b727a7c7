"""Data bigger than memory: peak RSS while qlora_kit prepares a generated JSONL file of a given size.

A file of alpaca rows (about 4 KB each, random words) is written, then ``prepare.prepare_datasets`` runs
in a fresh process with an empty datasets cache, as a run's data stage does: datasets converts the file
to its memory-mapped arrow cache in blocks, tokenizing writes batches to the cache, packing reads and
writes in chunks, and the reports and preflight read small per-example columns only. The child's peak
resident memory is read from the kernel (``ru_maxrss``) and set against the file's size.

    python benchmarks/large_data.py            # 1 GB
    python benchmarks/large_data.py --mb 64    # a quick look
    python benchmarks/large_data.py --smoke --out /tmp/x   # a 1 MB file
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import markdown_table, parser, scratch_folder, write_result

CHILD = """
import json, resource, sys, threading, time
peak = {"RssAnon": 0, "RssFile": 0}
def sample():  # the kernel reports peak RSS with file pages included; anonymous memory is sampled
    while True:
        for line in open("/proc/self/status"):
            key = line.split(":")[0]
            if key in peak:
                peak[key] = max(peak[key], int(line.split()[1]) * 1024)
        time.sleep(0.2)
threading.Thread(target=sample, daemon=True).start()
from qlora_kit import Recipe
from qlora_kit.model import loading as model
from qlora_kit.data import prepare, preflight
recipe = Recipe.from_dict({"data": {"path": sys.argv[1], "max_seq_len": 1024}})
tokenizer = model.load_tokenizer(recipe.model)
start = time.perf_counter()
prepared = prepare.prepare_datasets(recipe.data, tokenizer, seed=0)
checks = preflight.run_checks(prepared, recipe.data, tokenizer, prepare.build_collator(tokenizer, True))
seconds = time.perf_counter() - start
time.sleep(0.5)
print(json.dumps({
    "seconds": seconds,
    "examples": len(prepared.example_lengths),
    "tokens": sum(prepared.example_lengths),
    "packed_rows": len(prepared.train),
    "checks_passed": all(c.passed for c in checks),
    "peak_anon": peak["RssAnon"],
    "peak_file": peak["RssFile"],
}))
"""


def single_token_words() -> list[str]:
    """Whole words the demo tokenizer encodes as one token each (~6 characters a token, as real
    tokenizers give English text), so the file's size stands for a realistic number of tokens."""
    from qlora_kit import Recipe
    from qlora_kit.model import loading as model

    vocab = model.load_tokenizer(Recipe().model).get_vocab()
    return sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)


def write_rows(path: Path, megabytes: int) -> int:
    """Alpaca rows of random words until the file holds ``megabytes``; returns the row count."""
    words = single_token_words()
    rng = random.Random(0)
    target, written, rows = megabytes * 2**20, 0, 0
    with path.open("w", encoding="utf-8") as handle:
        while written < target:
            row_words = rng.choices(words, k=700)
            row = {
                "instruction": " ".join(row_words[:60]),
                "input": " ".join(row_words[60:400]),
                "output": " ".join(row_words[400:]),
            }
            line = json.dumps(row) + "\n"
            handle.write(line)
            written += len(line)
            rows += 1
    return rows


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--mb", type=int, default=1024, help="size of the generated JSONL file")
    args = options.parse_args()
    if args.smoke:
        args.mb = 1
    work = scratch_folder("large-data-")
    path = work / "rows.jsonl"
    rows = write_rows(path, args.mb)
    env = {"HF_DATASETS_CACHE": str(work / "cache"), "QLORA_KIT_CACHE": str(work / "models")}
    start = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env={**os.environ, **env}
    )
    wall = time.perf_counter() - start
    if child.returncode != 0:
        sys.exit(child.stderr[-3000:])
    result = json.loads(child.stdout.strip().splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    cache = sum(p.stat().st_size for p in (work / "cache").rglob("*") if p.is_file())
    size = path.stat().st_size
    table = markdown_table(
        ["JSONL file", "rows", "tokens", "packed rows", "prepare s", "peak anonymous", "peak RSS (with mapped files)", "arrow cache", "checks"],
        [[
            f"{size / 2**30:.2f} GiB", f"{rows:,}", f"{result['tokens'] / 1e6:,.0f} M", f"{result['packed_rows']:,}",
            f"{result['seconds']:.0f}", f"{result['peak_anon'] / 2**20:,.0f} MiB",
            f"{peak / 2**20:,.0f} MiB", f"{cache / 2**30:.1f} GiB", "pass" if result["checks_passed"] else "FAIL",
        ]],
    )  # fmt: skip
    write_result(
        "large-data-cpu",
        "Preparing data bigger than memory (peak memory)",
        table,
        notes=(
            "prepare s: loading, tokenizing (max_seq_len 1024, about 700 tokens a row), packing and the "
            f"preflight, in a fresh process ({wall:.0f} s with its imports). Peak anonymous: the process's own "
            "memory (RssAnon, sampled every 0.2 s), about 0.45 GiB of it torch and transformers once imported. "
            "Peak RSS also counts pages of the memory-mapped arrow cache the kernel can drop at any time "
            "(ru_maxrss)."
        ),
        folder=args.out,
    )


if __name__ == "__main__":
    main()
