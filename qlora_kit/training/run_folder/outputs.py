"""Output-folder policy: a run never writes over what an earlier run left unless asked to, one run at a
time holds a folder, and nothing half-written is ever taken for finished.

- Checkpoints and final outputs are written under ``.staging/`` inside the output folder and renamed
  into place (a rename within one filesystem is atomic), so a kill at any moment leaves either the
  whole checkpoint or none of it; the finished marker (``adapter_config.json``) is moved last.
- A lock (``filelock``: an OS-level lock that dies with its process, so a crashed run never leaves it
  stuck) beside the folder stops a second run from writing into it at the same time.
- Before training: the folder must be writable and its disk must have room for a checkpoint and the
  final outputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from qlora_kit.errors import OutputDirError
from qlora_kit.model import moe_experts
from qlora_kit.model.loading import resolve_model_path
from qlora_kit.registries.optimizers import OPTIMIZERS
from qlora_kit.training.run_folder.manifest import build_manifest, write_manifest

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

FINISHED_MARKER = "adapter_config.json"
PREVIOUS = ".previous-"  # an earlier run set aside by --overwrite, inside the output folder
STAGING = ".staging"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# The Trainer writes trainer_state.json last; the rest must be there for an exact resume.
CHECKPOINT_FILES = ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")
# Under FSDP the optimizer state (and the adapter the Trainer resumes from) are sharded
# torch.distributed.checkpoint folders, whose .metadata is written once every rank's shard is.
FSDP_CHECKPOINT_FILES = (
    "adapter_model.safetensors",
    "pytorch_model_fsdp_0/.metadata",
    "optimizer_0/.metadata",
    "scheduler.pt",
    "trainer_state.json",
)


def check_output_dir(path: Path, overwrite: bool) -> Path:
    """Refuse, before any work, a folder that already holds files unless ``overwrite``. Changes nothing."""
    path = path.expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"train.output_dir: {path} is a file, not a folder")
    if path.exists() and any(p.name != STAGING for p in path.iterdir()) and not overwrite:
        what = "a finished run" if (path / FINISHED_MARKER).exists() else "files"
        raise OutputDirError(
            f"train.output_dir: {path} already holds {what}; pass --overwrite to replace it "
            "or choose another --output-dir"
        )
    return path


def prepare_output_dir(path: Path, overwrite: bool) -> Path | None:
    """Create the folder, empty; called once model and data have loaded without error. What an earlier run
    left there (with ``overwrite``) is moved aside, not deleted: ``restore_aside`` puts it back if the
    new run fails before it has anything to replace it with, ``drop_aside`` deletes it once it has.
    The aside is a hidden folder *inside* the output folder, so the renames stay on one filesystem
    even when the folder is a mounted volume. Returns it, or None when there was nothing to keep."""
    path = check_output_dir(path, overwrite)
    path.mkdir(parents=True, exist_ok=True)
    earlier = list(path.iterdir())
    if not earlier:
        return None
    aside = Path(tempfile.mkdtemp(prefix=PREVIOUS, dir=path))
    moved: list[Path] = []
    try:
        for item in earlier:
            os.replace(item, aside / item.name)  # a rename: nothing is copied or lost
            moved.append(item)
    except OSError:
        for item in moved:
            os.replace(aside / item.name, item)
        aside.rmdir()
        raise
    return aside


def restore_aside(path: Path, aside: Path) -> None:
    """Put the earlier run back where it was, in place of the failed one."""
    for item in path.iterdir():
        if item != aside:
            shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
    for item in aside.iterdir():
        os.replace(item, path / item.name)
    aside.rmdir()


def drop_aside(aside: Path) -> None:
    shutil.rmtree(aside, ignore_errors=True)


def is_complete_checkpoint(folder: Path) -> bool:
    """Every file an exact resume reads is there: a single-process/DDP checkpoint or an FSDP one."""
    if not any(
        all((folder / name).is_file() for name in files)
        for files in (CHECKPOINT_FILES, FSDP_CHECKPOINT_FILES)
    ):
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


def find_resume_checkpoint(output_dir: Path, resume: bool | str | Path) -> Path | None:
    """The checkpoint to resume from: the given one, or the newest complete one in ``output_dir``;
    None when the run died before its first checkpoint (it then starts again from step 0)."""
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
    return found[-1] if found else None


def checkpoint_step(checkpoint: Path | None) -> int:
    """The step a checkpoint folder (``checkpoint-N``) was written at; 0 for none."""
    return int(checkpoint.name.split("-")[-1]) if checkpoint else 0


def finished_training(checkpoint: Path, max_steps: int) -> bool:
    """The checkpoint is the run's last step (a kill hit the final save). Resuming the Trainer from there
    would train one step too many (transformers 5.24 restarts the epoch's remaining batches).
    ``max_steps``: this run's (-1: by epochs, as the checkpoint's run counted them), so a resume that
    raises train.max_steps trains on."""
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    last = max_steps if max_steps > 0 else state.get("max_steps", float("inf"))
    return state["global_step"] >= last


@contextlib.contextmanager
def exclusive(output_dir: Path):
    """Hold the output folder for this run; a second run into it fails at once with a clear message."""
    blocking = next((p for p in [output_dir, *output_dir.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise OutputDirError(f"train.output_dir: {blocking} is a file, not a folder")
    lock = FileLock(str(output_dir.parent / f".{output_dir.name}.lock"))
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=0)
    except Timeout:  # (a subclass of OSError: caught first)
        raise OutputDirError(
            f"train.output_dir: {output_dir} is in use by another run; wait for it to end or choose another --output-dir"
        ) from None
    except OSError as exc:
        raise OutputDirError(
            f"train.output_dir: {output_dir} is not writable ({exc.strerror or exc})"
        ) from None
    try:
        yield
    finally:
        lock.release()


def check_writable(output_dir: Path, needed_bytes: int) -> None:
    """The folder can be created and written, and its disk has ``needed_bytes`` free."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise OutputDirError(
            f"train.output_dir: {output_dir} is not writable ({exc.strerror or exc})"
        ) from None
    check_free_space(output_dir, needed_bytes)


def check_free_space(path: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise OutputDirError(
            f"train.output_dir: {free / 2**20:,.0f} MiB free on the disk of {path}; a checkpoint and the final "
            f"adapter need about {needed_bytes / 2**20:,.0f} MiB"
        )


def staging_dir(output_dir: Path, name: str | None = None) -> Path:
    """A folder under ``.staging/`` to write into before renaming into place: a fresh one, or the one
    called ``name`` (shared by the processes of a multi-process run)."""
    root = output_dir / STAGING
    root.mkdir(parents=True, exist_ok=True)
    if name is None:
        return Path(tempfile.mkdtemp(dir=root))
    (root / name).mkdir(exist_ok=True)
    return root / name


def move_into_place(staged: Path, destination: Path, last: str | None = None) -> None:
    """Rename ``staged`` to ``destination`` (a folder), or, when ``destination`` exists, each of its files
    into it with ``last`` moved last; flushed to disk first so a power cut cannot reorder them."""
    for file in staged.rglob("*"):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    if not destination.exists():
        os.replace(staged, destination)
    else:
        files = sorted(staged.iterdir(), key=lambda p: p.name == last)
        for item in files:
            target = destination / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
        staged.rmdir()
    _fsync_dir(destination.parent)
    _fsync_dir(destination)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def clear_staging(output_dir: Path) -> None:
    """What a killed run left half-written: never used, removed at the next start."""
    shutil.rmtree(output_dir / STAGING, ignore_errors=True)


def truncate_metrics(output_dir: Path, last_step: int) -> None:
    """Drop metrics.jsonl rows logged after the checkpoint a run resumes from (they are logged again)."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return
    kept = [
        line for line in path.read_text(encoding="utf-8").splitlines() if _metrics_step(line) <= last_step
    ]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _metrics_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:
        return 1 << 62  # a torn last line: drop it


def after_failed_overwrite(output_dir: Path, aside: Path) -> None:
    """The run that was to replace an earlier one failed: with no checkpoint of its own to resume from,
    the earlier run comes back as it was; with one, the earlier run is gone for it."""
    newest = complete_checkpoints(output_dir)
    if newest:
        drop_aside(aside)
        log.warning("--overwrite: the earlier run was replaced; this run can --resume from %s", newest[-1])
        return
    try:
        restore_aside(output_dir, aside)
    except OSError as exc:
        log.error("--overwrite: could not put the earlier run back (%s); it is kept in %s", exc, aside)
        return
    log.warning(
        "--overwrite: this run failed before its first checkpoint; the earlier run in %s is back as it was",
        output_dir,
    )


def prepare_run_folder(
    output_dir: Path, recipe: Recipe, peft_model, overwrite: bool, resume, checkpoint
) -> tuple[dict, Path | None]:
    """The main process readies the output folder; returns the run manifest it wrote, and where an
    earlier run's files were set aside (--overwrite)."""
    aside = None if resume else prepare_output_dir(output_dir, overwrite=overwrite)
    if aside is not None:
        log.info("--overwrite: the earlier run is kept in %s until this run has a checkpoint", aside)
    try:
        check_writable(output_dir, _output_bytes(peft_model, recipe.optimizer.name))
        clear_staging(output_dir)
        if resume:
            truncate_metrics(output_dir, checkpoint_step(checkpoint))
            log.info("resuming from %s", checkpoint or "the start: no complete checkpoint was written")
        manifest = build_manifest(recipe, resolve_model_path(recipe.model))
        manifest["weight_bytes"] = moe_experts.bytes_by_kind(peft_model)  # `qlora-kit show` reads it back
        log.info("run manifest: %s", write_manifest(output_dir, manifest))
        (output_dir / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")
    except BaseException:
        if aside is not None:
            after_failed_overwrite(output_dir, aside)
        raise
    return manifest, aside


def _output_bytes(peft_model, optimizer_name: str) -> int:
    """Room for a checkpoint (adapter + the optimizer's state) and the final adapter, with a margin."""
    spec = OPTIMIZERS[optimizer_name]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    adapter = sum(p.numel() * 4 for p in params)
    return 2 * (2 * adapter + sum(spec.state_bytes(p.numel()) for p in params)) + 64 * 2**20
