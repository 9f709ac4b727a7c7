"""A run's checkpoints and final save, as the run folder holds them: each checkpoint written whole under
``.staging/`` and then renamed into place (outputs.py's ``move_into_place``), the best checkpoint recorded
where it ends up, and the final folder's adapter and tokenizer.

``GuardedTrainer`` (training/step/trainer.py) overrides the Trainer's ``_save_checkpoint``,
``_get_output_dir`` and ``save_model`` with one call each to what is here, handing over the library's own
save as a function; nothing here calls the trainer.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qlora_kit.model import adapters
from qlora_kit.training.run_folder.outputs import move_into_place, staging_dir


class StagedCheckpoints:
    """Where the Trainer writes a checkpoint while it writes it (``folder``: the staging folder, or None
    between checkpoints), and the steps of one atomic checkpoint (``save``)."""

    def __init__(self) -> None:
        self.folder: Path | None = None

    def output_dir(self, default: str) -> str:
        """The Trainer's ``_get_output_dir``: the staging folder while a checkpoint is written."""
        return str(self.folder) if self.folder is not None else default

    def save(
        self,
        args: Any,
        state: Any,
        accelerator: Any,
        write: Callable[[], None],
        add: Callable[[Path], None],
    ) -> None:
        """``write`` (the library's ``_save_checkpoint``) writes the whole checkpoint under .staging/,
        ``add`` puts qlora_kit's files beside it, then it is renamed into place: a kill mid-save leaves the
        previous checkpoint as the newest complete one, never a half-written one. Every rank writes its
        part (RNG states) into the same staging folder; the main process moves it once all are done."""
        output_dir = Path(args.output_dir)
        self.folder = staging_dir(output_dir, name=f"step-{state.global_step}")
        try:
            write()
        finally:
            staged, self.folder = self.folder, None
        checkpoint = staged / f"checkpoint-{state.global_step}"
        if args.should_save:
            add(checkpoint)
        record_best_where_it_will_be(state, checkpoint, output_dir, args.should_save)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for written in staged.glob("checkpoint-*"):
                move_into_place(written, output_dir / written.name)
            shutil.rmtree(staged, ignore_errors=True)
        accelerator.wait_for_everyone()


def record_best_where_it_will_be(state: Any, checkpoint: Path, output_dir: Path, should_save: bool) -> None:
    """The Trainer records the best checkpoint as the folder it has just written, here under .staging/:
    record where it is moved to, in the state and in the checkpoint's trainer_state.json (a resume reads
    it from there, and would drop a path that no longer exists)."""
    best = state.best_global_step
    if not best or state.best_model_checkpoint is None:
        return
    final = output_dir / f"checkpoint-{best}"
    if Path(state.best_model_checkpoint) == final:
        return
    state.best_model_checkpoint = str(final)
    if should_save:
        state.save_to_json(str(checkpoint / "trainer_state.json"))


def save_final(
    model: Any, unwrapped: Any, output_dir: str, processing_class: Any, fsdp: bool, should_save: bool
) -> None:
    """The adapter and tokenizer, as the final folder holds them (adapters.save_adapter); ``unwrapped``:
    ``model`` without accelerate's wrappers. Replaces the Trainer's ``save_model``: under FSDP it writes a model only with
    FULL_STATE_DICT, and then gathers the whole model, 4-bit base included, onto one process. Here every
    rank gathers the adapter alone. (The sharded adapter and optimizer state the Trainer resumes from are
    written beside it.)"""
    adapter = adapters.full_adapter_state(model) if fsdp else None
    if should_save:
        adapters.save_adapter(unwrapped, output_dir, adapter)
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
