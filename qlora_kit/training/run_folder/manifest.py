"""The run manifest: everything needed to tell what produced an adapter, in ``manifest.json``.

Resolved recipe, library versions, a hash of every data file, a hash of the base model's config,
the seed, the project's git commit when run from a checkout, and the machine.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

from qlora_kit.data import demo
from qlora_kit.recipe.paths import data_paths

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

LIBRARIES = (
    "qlora-kit",
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "datasets",
    "tokenizers",
    "trl",
)
MANIFEST = "manifest.json"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def build_manifest(recipe: Recipe, model_path: str) -> dict[str, Any]:
    return {
        "recipe": recipe.model_dump(mode="json"),
        "versions": {"python": platform.python_version(), **{name: _version(name) for name in LIBRARIES}},
        "data_files": data_hashes(recipe),
        "base_model": {"path": model_path, "config_sha256": _config_hash(model_path, recipe)},
        **_starting_adapter(recipe),
        "seed": recipe.train.seed,
        "git_commit": project_commit(),
        "machine": machine(),
        "argv": sys.argv,
        "started_at": utc_now(),
    }


def _starting_adapter(recipe: Recipe) -> dict[str, Any]:
    """model.adapter: the adapter the run started from (for DPO, also its reference), by its weights' hash."""
    if recipe.model.adapter is None:
        return {}
    weights = Path(recipe.model.adapter) / "adapter_model.safetensors"
    return {"starting_adapter": {"path": recipe.model.adapter, "sha256": _sha256(weights)}}


def write_manifest(output_dir: Path, manifest: dict[str, Any]) -> Path:
    path = output_dir / MANIFEST
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    temporary.replace(path)
    return path


def data_hashes(recipe: Recipe) -> dict[str, str]:
    """sha256 of each local data file of every source (every file of a folder); hub names as given."""
    sources = []
    for _, source in data_paths(recipe.data):
        if demo.is_builtin(source):
            sources += [str(p) for p in demo.demo_data_files(source)]
        else:
            sources.append(source)
    hashes = {}
    for source in sources:
        path = Path(source).expanduser()
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            hashes[str(file)] = _sha256(file) if file.is_file() else "hub dataset (no local file)"
    return hashes


def project_commit() -> str | None:
    """The git commit of the qlora_kit checkout this code runs from (with +dirty), or None."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:

    info: dict[str, Any] = {"platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _config_hash(model_path: str, recipe: Recipe) -> str:
    config = Path(model_path) / "config.json"
    if config.is_file():
        return _sha256(config)

    loaded = AutoConfig.from_pretrained(
        model_path, trust_remote_code=recipe.model.trust_remote_code, revision=recipe.model.revision
    )
    return hashlib.sha256(loaded.to_json_string(use_diff=False).encode()).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
