"""The recipe's input paths, listed in one place: every file or folder a run reads (model.path,
model.adapter, the training data — data.path or each of data.sources — and data.val_path).

``path_fields`` works on a recipe's raw values (so a recipe file's relative paths are resolved against
its folder before validation) and ``Recipe.input_paths`` on a loaded recipe; the path checks, the output
folder's refusal, the manifest's data hashes and the hub's checks all read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qlora_kit.recipe.base import looks_local
from qlora_kit.recipe.data import DataSection

_PATH_FIELDS = [("model", "path"), ("model", "adapter"), ("data", "path"), ("data", "val_path")]


def path_fields(values: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """Every input path a recipe's values hold, as (field, the mapping holding it, its key): model.path,
    model.adapter, the training data (data.path, or each of data.sources when there is a mixture) and
    data.val_path. Read on raw values (resolving a recipe file's relative paths) and on a loaded recipe."""
    data = values.get("data") if isinstance(values.get("data"), dict) else {}
    sources = data.get("sources") if isinstance(data.get("sources"), list) else []
    found = []
    for section, key in _PATH_FIELDS:
        if section == "data" and key == "path" and sources:
            continue  # a mixture reads its sources, not data.path
        found.append((f"{section}.{key}", values.get(section), key))
    found += [(f"data.sources[{i}].path", source, "path") for i, source in enumerate(sources)]
    return [
        (field, block, key)
        for field, block, key in found
        if isinstance(block, dict) and isinstance(block.get(key), str)
    ]


def data_paths(data: DataSection) -> list[tuple[str, str]]:
    """The data section's part of ``Recipe.input_paths``: the training sources and data.val_path (with
    neither data.path nor data.sources, the demo data the run reads)."""
    found = [(field, block[key]) for field, block, key in path_fields({"data": data.model_dump()})]
    if data.path is None and not data.sources:
        found.insert(0, ("data.path", data.source_list()[0].path))
    return found


def is_local_path(field: str, value: str) -> bool:
    """A local file or folder, not a hub id or a builtin: name (an adapter is always a folder)."""
    return field == "model.adapter" or looks_local(value)


def resolve_paths(values: dict[str, Any], base: Path) -> None:
    """Make relative local paths absolute against the recipe's folder; hub ids and builtin: names stay."""
    for field, block, key in path_fields(values):
        value = block[key]
        if is_local_path(field, value) and not Path(value).expanduser().is_absolute():
            block[key] = str((base / value).resolve())
