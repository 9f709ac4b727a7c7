"""Where rows come from: a file, a folder of shards, a ``save_to_disk`` folder, a hub dataset or a
builtin dataset, loaded through ``datasets`` with the source's field names mapped to its format's.
Files are converted once to datasets' memory-mapped arrow cache, so data bigger than memory is never
loaded whole. A file that does not load is one ``DataError`` line naming it (errors.py).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
from datasets import Dataset
from datasets.utils import logging as datasets_logging

from qlora_kit.data import demo
from qlora_kit.data.errors import diagnose_load_failure
from qlora_kit.errors import DataError, RecipeError
from qlora_kit.model import hub
from qlora_kit.recipe.data import SourceSection
from qlora_kit.recipe.recipe import DataSection

LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def split_of(path: str) -> tuple[str, str | None]:
    """(the training file, validation data the source brings itself: builtin datasets do)."""
    if demo.is_builtin(path):
        train_file, val_file = demo.demo_data_files(path)
        return str(train_file), str(val_file)
    return path, None


@dataclass
class SourceSplit:
    """One source's training rows and the rows it holds out for validation (``held_from``: where they
    were read, for the data report's lines)."""

    train_from: str
    rows: Dataset
    held_out: Dataset | None = None
    held_from: str | None = None


def split_source(
    section: SourceSection, data: DataSection, seed: int, number_as: str | None = None
) -> SourceSplit:
    """A source's rows and what it holds out: its own validation file (builtin sets bring one), else
    ``data.val_fraction`` of its rows split off with the seed; nothing where ``data.val_path`` holds out
    for every source. ``number_as``: a column numbering the rows from 1 before the split, so a bad row
    is still named by its line in the file."""
    train_from, own_val = split_of(section.path)
    rows = load_rows(train_from, data, section)
    if data.val_path is not None:
        return SourceSplit(train_from, rows)
    if own_val is not None:
        return SourceSplit(train_from, rows, load_rows(own_val, data, section), own_val)
    if data.val_fraction > 0 and len(rows) > 1:
        if number_as:
            rows = rows.add_column(number_as, list(range(1, len(rows) + 1)))
        halves = rows.train_test_split(test_size=data.val_fraction, seed=seed)
        return SourceSplit(train_from, halves["train"], halves["test"], train_from)
    return SourceSplit(train_from, rows)


def load_val_rows(data: DataSection) -> Dataset:
    """The rows of ``data.val_path``, read with data's own config name and field names (each of
    ``data.sources`` names its own; the validation file is data's), for every objective alike."""
    section = SourceSection(path=data.val_path, config_name=data.config_name, fields=data.fields)
    return load_rows(data.val_path, data, section)


def load_rows(source: str, data: DataSection, section: SourceSection | None = None) -> Dataset:
    """Rows of a file, a folder of files (shards), a save_to_disk folder or a hub dataset, with the
    source's field names mapped to the format's. Files are converted once to datasets' memory-mapped
    arrow cache, so data bigger than memory is never loaded whole."""
    section = section or data.source_list()[0]
    path = Path(source).expanduser()
    try:
        with quiet_datasets(progress=False):
            if path.is_dir():
                rows = _load_folder(path)
            elif path.suffix in LOADERS:
                if not path.exists():
                    raise DataError(f"{path}: no such file")
                rows = datasets.load_dataset(LOADERS[path.suffix], data_files=str(path), split="train")
            else:
                named_by = _field_naming(source, data, section)
                with hub.hub_errors(named_by, source, None, kind="dataset"):
                    rows = datasets.load_dataset(source, section.config_name, split="train")
    except (DataError, RecipeError):
        raise
    except Exception as exc:  # datasets raises many types; the user needs the file, the row and the reason
        raise diagnose_load_failure(path, source, exc) from None
    if isinstance(rows, datasets.DatasetDict):
        raise DataError(f"{source}: holds several splits ({', '.join(rows)}); point at one split's folder")
    return _rename_fields(rows, section.fields, source)


def _field_naming(source: str, data: DataSection, section: SourceSection) -> str:
    """The recipe field a source comes from, for its error lines."""
    if source == data.val_path:
        return "data.val_path"
    if section in data.sources:  # by identity: two sources may name the same file
        return f"data.sources[{data.sources.index(section)}].path"
    return "data.path"


def _load_folder(path: Path) -> Dataset:
    """A save_to_disk folder, or a folder of .jsonl/.json/.csv/.parquet shards of one kind."""
    if (path / "dataset_info.json").exists() or (path / "state.json").exists():
        return datasets.load_from_disk(str(path))
    shards = sorted(p for p in path.rglob("*") if p.suffix in LOADERS and p.is_file())
    kinds = {LOADERS[p.suffix] for p in shards}
    if not shards:
        raise DataError(
            f"{path}: a folder with no data files (.jsonl, .json, .csv, .parquet) and no saved dataset"
        )
    if len(kinds) > 1:
        raise DataError(
            f"{path}: holds files of several kinds ({', '.join(sorted(kinds))}); use one kind per folder"
        )
    return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in shards], split="train")


def _rename_fields(rows: Dataset, fields: dict[str, str], source: str) -> Dataset:
    renames = {theirs: ours for ours, theirs in fields.items() if theirs != ours}
    for ours, theirs in fields.items():
        if theirs not in rows.column_names:
            raise DataError(
                f"{source}: row 1: missing field {theirs!r} (data.fields.{ours}; has {', '.join(rows.column_names)})"
            )
    return rows.rename_columns(renames) if renames else rows


@contextlib.contextmanager
def quiet_datasets(progress: bool = True):
    # datasets logs its own multi-line error before raising; ours is the one line the user sees.
    logger = logging.getLogger("datasets")
    level, bars = logger.level, datasets_logging.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL)
    if not progress:
        datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()


def read_prompts(path: str) -> list[str]:
    """The ``prompt`` of every row of a prompts file (``qlora-kit generate --file``), read like any data."""
    rows = load_rows(path, DataSection(path=path))
    if "prompt" not in rows.column_names:
        raise DataError(f"{path}: row 1: missing field 'prompt' (has {', '.join(rows.column_names)})")
    prompts = list(rows["prompt"])
    for number, prompt in enumerate(prompts, start=1):
        if not isinstance(prompt, str):
            raise DataError(
                f"{path}: row {number}: field 'prompt' must be text (got {type(prompt).__name__})"
            )
    return prompts
