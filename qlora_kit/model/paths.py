"""The folders and files a command is pointed at, checked before any work: one line naming the field or
flag, what is wrong and what to do (a ``RecipeError`` or ``OutputDirError``, exit code 2).

- a base-model folder (``model.path``): a folder, a ``config.json`` that is JSON, weight files whose
  headers read, tokenizer files;
- an adapter folder (``--adapter``) or a checkpoint (``--resume``): ``adapter_config.json`` that is JSON,
  an ``adapter_model.safetensors`` whose header reads (a truncated file does not);
- an output path (``--output-dir``, ``--out``, ``--output``): not a file where a folder goes (or the
  reverse), inside a folder that exists or can be made and is writable, never inside what is read.

Reading a safetensors header (a few KB) catches truncation: safetensors refuses a header whose tensors
run past the end of the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open

from qlora_kit.errors import OutputDirError, RecipeError

WEIGHT_PATTERNS = (
    "*.safetensors",
    "pytorch_model*.bin",
    "*.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
# Any of these makes a folder a tokenizer's (fast tokenizers, SentencePiece, BPE vocabularies, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
TOKENIZER_PATTERNS = ("*.model", "*.tiktoken")


def check_model_folder(path: str, field: str = "model.path", weights: bool = True) -> None:
    """A local base-model folder that transformers can load; hub ids (not local) are left to the hub."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return  # a hub id, or a missing local path that Recipe.check_paths names
    if not folder.is_dir():
        raise RecipeError(f"{field}: {folder} is a file; give the folder a model was saved into")
    config = folder / "config.json"
    if not config.is_file():
        raise RecipeError(f"{field}: {folder} has no config.json; it is not a saved model folder")
    read_json(config, field)
    if weights:
        files = [f for pattern in WEIGHT_PATTERNS for f in folder.glob(pattern)]
        if not files:
            raise RecipeError(
                f"{field}: {folder} has a config.json but no weight files (*.safetensors or pytorch_model*.bin)"
            )
        for file in files:
            if file.suffix == ".safetensors":
                check_safetensors(file, field)
    tokenizer_files = [folder / name for name in TOKENIZER_FILES]
    tokenizer_files += [f for pattern in TOKENIZER_PATTERNS for f in folder.glob(pattern)]
    if not any(f.is_file() for f in tokenizer_files):
        raise RecipeError(
            f"{field}: {folder} has no tokenizer files ({' or '.join(TOKENIZER_FILES[:2])}); save the "
            "tokenizer into the model's folder (tokenizer.save_pretrained)"
        )


def check_adapter_folder(folder: Path, flag: str = "--adapter") -> dict:
    """A folder written by ``qlora-kit train`` (or a checkpoint of one) whose adapter files read; returns
    its adapter config."""
    if not folder.exists():
        raise RecipeError(f"{flag}: {folder} does not exist")
    if not folder.is_dir():
        raise RecipeError(f"{flag}: {folder} is a file; give the folder a run wrote")
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise RecipeError(f"{flag}: {folder} holds no adapter (adapter_config.json is missing)")
    config = read_json(path, flag)
    if not isinstance(config, dict):
        raise RecipeError(f"{flag}: {path} is not an adapter config (a JSON object)")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise RecipeError(f"{flag}: {folder} has no adapter_model.safetensors")
    check_safetensors(weights, flag)
    return config


def check_checkpoint(folder: Path) -> None:
    """A checkpoint ``--resume`` can continue from: its adapter reads and its trainer state is JSON."""
    check_adapter_folder(folder, "--resume")
    read_json(folder / "trainer_state.json", "--resume")


def read_json(path: Path, field: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RecipeError(f"{field}: {path} is not valid JSON ({first_line(exc)})") from None


def check_safetensors(path: Path, field: str) -> None:
    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except (OSError, SafetensorError) as exc:
        raise RecipeError(
            f"{field}: {path} is damaged ({first_line(exc)}); was it cut off while copying?"
        ) from None


def check_output_folder(path: Path, flag: str, reading: Path | None = None) -> None:
    """A folder to write into: not a file, not inside ``reading``, its nearest existing parent writable."""
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"{flag}: {path} is a file, not a folder")
    if reading is not None and (path == reading or reading in path.parents):
        raise OutputDirError(f"{flag}: {path} is inside {reading}, which this command reads; choose another")
    _check_writable_parent(path, flag)


def check_output_holds_no_input(output_dir: Path, inputs: dict[str, str | None]) -> None:
    """A run's folder must not hold what the run reads: --overwrite sets a folder's contents aside and
    deletes them once the run has its own."""
    for field, value in inputs.items():
        read = Path(value).expanduser() if value else None
        if read is not None and read.exists():
            read = read.resolve()
            if read == output_dir or output_dir in read.parents:
                raise RecipeError(
                    f"train.output_dir: {output_dir} holds {field} {read}; a run replaces what its folder "
                    "holds (--overwrite), so write it elsewhere"
                )


def check_output_file(path: Path, flag: str) -> None:
    """A file to write: not a folder, in a folder that exists and is writable."""
    if path.is_dir():
        raise OutputDirError(f"{flag}: {path} is a folder; give a file name")
    if not path.parent.is_dir():
        raise OutputDirError(f"{flag}: the folder {path.parent} does not exist")
    _check_writable_parent(path, flag)


def _check_writable_parent(path: Path, flag: str) -> None:
    existing = next((p for p in [path, *path.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise OutputDirError(f"{flag}: {existing} is a file, so {path} cannot be made")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirError(f"{flag}: cannot write in {existing} (permission denied)")


def first_line(exc: BaseException) -> str:
    """An exception's message as one line for a user: its first line, or its class when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__
