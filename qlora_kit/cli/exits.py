"""How a command ends: a user's mistake or a stopped run as one line on stderr and its exit code.

Every command in ``app`` and its sub-apps (``recipes``) is wrapped in ``user_errors``, so the same
mistake reads the same from any command and never shows a traceback.
"""

from __future__ import annotations

import functools
import typing

import typer
from rich.console import Console
from rich.markup import escape  # a message's own brackets (data.sources[0], qlora-kit[wandb]) are text

from qlora_kit.errors import RecipeError
from qlora_kit.recipe.options import Checked

errors = Console(stderr=True)
USER_ERROR = 2
GUARD_STOP = 3  # a guard stopped training: the setup or the run went wrong, not the command line


def user_errors(command):
    """Turn a user's mistake into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from qlora_kit.errors import DataError, Interrupted, OutputDirError, TrainingGuardError

        try:
            for name, checked in numeric_options(command).items():
                checked.check(kwargs.get(name))
            return command(*args, **kwargs)
        except (RecipeError, DataError, OutputDirError) as exc:
            errors.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(USER_ERROR) from None
        except TrainingGuardError as exc:
            errors.print(
                f"[bold red]training stopped:[/] {escape(str(exc))}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(GUARD_STOP) from None
        except Interrupted as exc:
            errors.print(f"[bold yellow]interrupted:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


@functools.cache
def numeric_options(command) -> dict[str, Checked]:
    """Each parameter of ``command`` declared with a ``Checked`` (recipe/options.py), by name: its numeric
    options, checked as the recipe checks the fields they stand for."""
    hints = typing.get_type_hints(command, include_extras=True)
    return {
        name: checked
        for name, hint in hints.items()
        for checked in getattr(hint, "__metadata__", ())
        if isinstance(checked, Checked)
    }
