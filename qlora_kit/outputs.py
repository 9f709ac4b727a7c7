"""Output-folder policy: a run never writes over what an earlier run left unless asked to, and resumes
only from a checkpoint that was written completely."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

FINISHED_MARKER = "adapter_config.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# The Trainer writes trainer_state.json last; the rest must be there for an exact resume.
CHECKPOINT_FILES = ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")


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


def is_complete_checkpoint(folder: Path) -> bool:
    if not all((folder / name).is_file() for name in CHECKPOINT_FILES):
        return False
    try:
        json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest step first."""
    if not output_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT.match(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found) if is_complete_checkpoint(p)]


def find_resume_checkpoint(output_dir: Path, resume: bool | str | Path) -> Path:
    """The checkpoint to resume from: the given one, or the newest complete one in ``output_dir``."""
    if resume is not True:
        checkpoint = Path(resume).expanduser().resolve()
        if not is_complete_checkpoint(checkpoint):
            raise OutputDirError(
                f"--resume: {checkpoint} is not a complete checkpoint ({', '.join(CHECKPOINT_FILES)})"
            )
        return checkpoint
    if (output_dir / FINISHED_MARKER).exists():
        raise OutputDirError(f"--resume: {output_dir} holds a finished run; there is nothing to resume")
    found = complete_checkpoints(output_dir)
    if not found:
        raise OutputDirError(
            f"--resume: no complete checkpoint in {output_dir} (set train.save_steps to write checkpoints)"
        )
    return found[-1]
