"""Output-folder policy: a run never writes over what an earlier run left unless asked to."""

from __future__ import annotations

import shutil
from pathlib import Path

FINISHED_MARKER = "adapter_config.json"


class OutputDirError(ValueError):
    """The output folder cannot be used as asked: one line saying why and what to do."""


def check_output_dir(path: Path, overwrite: bool) -> Path:
    """Refuse, before any work, a folder that already holds files unless ``overwrite``. Changes nothing."""
    path = path.expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"train.output_dir: {path} is a file, not a folder")
    if path.exists() and any(path.iterdir()) and not overwrite:
        what = "a finished run" if (path / FINISHED_MARKER).exists() else "files"
        raise OutputDirError(
            f"train.output_dir: {path} already holds {what}; pass --overwrite to replace it "
            "or choose another --output-dir"
        )
    return path


def prepare_output_dir(path: Path, overwrite: bool) -> Path:
    """Empty (when allowed) and create the folder; called once model and data have loaded without error,
    so a mistake in the recipe or the data never costs the user an earlier run."""
    path = check_output_dir(path, overwrite)
    if path.exists() and any(path.iterdir()):
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path
