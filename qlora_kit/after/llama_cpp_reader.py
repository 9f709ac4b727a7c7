"""llama.cpp itself as a reader of GGUF exports, for the parity report and ``qlora-kit doctor``.

``llama-cpp-python`` compiles llama.cpp at install (far beyond a CI's time on 2 cores); the npm package
``node-llama-cpp`` ships llama.cpp prebuilt per platform, so node runs it with nothing compiled. It is a
dev/test tool, installed beside the checkout by ``scripts/install_llama_cpp.sh`` (into ``.llama-cpp/``,
or where ``QLORA_KIT_LLAMA_CPP`` points). One node process reads one export (``llama_cpp_read.mjs``): its
own tokenization of the rendered prompts, the raw logits at every answer position under teacher forcing,
and its greedy tokens; the reader then answers the report's questions from those, as the transformers
reader does from a model in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

SCRIPT = Path(__file__).with_name("llama_cpp_read.mjs")
VERSION = "3.22.1"  # node-llama-cpp: llama.cpp prebuilt for linux-x64, macOS, Windows
ENTRY = Path("node_modules") / "node-llama-cpp" / "dist" / "index.js"
TIMEOUT_S = 900


def install_folders() -> list[Path]:
    """Where node-llama-cpp is looked for: $QLORA_KIT_LLAMA_CPP, the checkout's .llama-cpp, the user cache."""
    folders = [Path(os.environ["QLORA_KIT_LLAMA_CPP"])] if os.environ.get("QLORA_KIT_LLAMA_CPP") else []
    folders.append(Path(__file__).resolve().parents[2] / ".llama-cpp")
    folders.append(Path.home() / ".cache" / "qlora_kit" / "llama-cpp")
    return folders


def entry_point() -> Path | None:
    """node-llama-cpp's module where node can run it; None where either is missing."""
    if shutil.which("node") is None:
        return None
    return next((f / ENTRY for f in install_folders() if (f / ENTRY).is_file()), None)


def describe() -> str:
    """One line for ``doctor``: where llama.cpp is, or how to get it."""
    entry = entry_point()
    if entry is not None:
        return f"node-llama-cpp in {entry.parents[2]} (the parity report adds llama.cpp's rows)"
    if shutil.which("node") is None:
        return "not available: no node on PATH (scripts/install_llama_cpp.sh needs node >= 20 and npm)"
    return "not installed: bash scripts/install_llama_cpp.sh (node-llama-cpp from npm, nothing compiled)"


def read(
    path: Path, items: list[tuple[list[int], list[int], int]], texts: list[str], lora: Path | None = None
):
    """llama.cpp's reading of the GGUF at ``path`` (with the LoRA GGUF ``lora`` applied): per item
    (prompt ids, answer ids, greedy count) the answer's logits and the greedy tokens, and the ids it
    serves for each text. None where llama.cpp is not installed."""
    entry = entry_point()
    if entry is None:
        return None
    with tempfile.TemporaryDirectory(prefix="qlora-kit-llama-cpp-") as folder:
        job = {
            "model": str(path),
            "lora": str(lora) if lora else None,
            "texts": texts,
            "items": [{"prompt": p, "answer": a, "greedy": n} for p, a, n in items],
        }
        (Path(folder) / "job.json").write_text(json.dumps(job), encoding="utf-8")
        done = subprocess.run(
            ["node", str(SCRIPT), str(entry), str(Path(folder) / "job.json"), folder],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env={**os.environ, "NODE_LLAMA_CPP_SKIP_DOWNLOAD": "true"},
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            said = next((line for line in lines if "Error" in line), lines[-1])  # node's own, not its version
            raise RuntimeError(f"llama.cpp could not read {path.name}: {said.strip()[:300]}")
        result = json.loads((Path(folder) / "result.json").read_text(encoding="utf-8"))
        flat = np.fromfile(Path(folder) / "logits.f32", dtype=np.float32)
    logits = torch.from_numpy(flat.reshape(-1, result["vocab"]).copy())
    return LlamaCppReading(items, logits, result["greedy"], dict(zip(texts, result["served"], strict=True)))


class LlamaCppReading:
    """A finished llama.cpp reading as a parity reader (the transformers reader's methods)."""

    name = "llama.cpp"

    def __init__(self, items, logits: torch.Tensor, greedy: list[list[int]], served: dict) -> None:
        self._logits, self._greedy, self._served = {}, {}, served
        start = 0
        for (prompt, answer, _), tokens in zip(items, greedy, strict=True):
            key = (tuple(prompt), tuple(answer))
            self._logits[key] = logits[start : start + len(answer)]  # (len(answer), V)
            self._greedy[tuple(prompt)] = tokens
            start += len(answer)

    def answer_logits(self, prompt: list[int], answer: list[int]) -> torch.Tensor:
        return self._logits[(tuple(prompt), tuple(answer))]

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        return self._greedy[tuple(prompt)][:count]

    def served_ids(self, text: str) -> list[int]:
        return self._served[text]

    def render(self) -> str | None:
        return None  # llama.cpp's own template engine is not node-llama-cpp's; the GGUF's Jinja is checked
