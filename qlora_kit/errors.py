"""Every user-facing error type: a user's mistake or a run's stop, each one line that says what to do.

A leaf module that every layer may import (it imports only the standard library). The CLI catches these
and prints their one line with exit code 2 (or, for ``Interrupted``, 128 + the signal); anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import signal


class RecipeError(ValueError):
    """A user mistake in a recipe: one line naming the field and the value."""


class DataError(ValueError):
    """A problem with the user's data: one line naming the file, the row and the problem."""


class OutputDirError(ValueError):
    """The output folder cannot be used as asked: one line saying why and what to do."""


class TrainingGuardError(RuntimeError):
    """A run stopped by a guard: one line saying what happened, where, and what is kept."""


class MergeDriftError(RuntimeError):
    """The merged model drifts from the adapter it came from; the export was left in a staging folder."""


class ExportError(ValueError):
    """An export cannot be made as asked (an architecture GGUF does not cover, a missing extra): one line."""


class ExportParityError(RuntimeError):
    """An export does not behave like the trained adapter: the figure past its threshold, the folder kept."""


class Interrupted(RuntimeError):
    """The run stopped on a signal after writing a checkpoint; ``exit_code`` is 128 + the signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        kept = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint written"
        super().__init__(
            f"stopped by {name} after step {step}; {kept}; continue with the same command and --resume"
        )
