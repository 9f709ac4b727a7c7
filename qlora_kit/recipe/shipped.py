"""The recipes shipped inside the package, found by name wherever qlora_kit is installed.

They are the repository's top-level ``recipes/`` folder itself: ``qlora_kit/recipes`` is a symlink to
it in a checkout (so an editable install and ``PYTHONPATH`` read the same files), and the wheel copies
the files it points at (package data), so there is no second copy to drift. ``qlora-kit recipes``
lists them; every command that takes a recipe path also takes a shipped recipe's name:

    qlora-kit train demo                       # the shipped demo.yaml
    qlora-kit train recipes/demo.yaml          # the same, from a folder that has no recipes/demo.yaml

A path that exists always wins over a shipped name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SUFFIX = ".yaml"
ACCELERATE = "accelerate"  # the sub-folder of accelerate launch configs the FSDP recipes name


def folder() -> Path:
    """The shipped recipes' folder (a real folder: the package is installed from files, never a zip)."""
    return Path(str(resources.files("qlora_kit") / "recipes"))


def recipe_names() -> list[str]:
    """The shipped recipes' names (file names without ``.yaml``), sorted."""
    return sorted(path.stem for path in folder().glob(f"*{SUFFIX}"))


def accelerate_names() -> list[str]:
    """The shipped accelerate configs, named as ``recipes copy`` takes them: ``accelerate/fsdp-qlora``."""
    return sorted(f"{ACCELERATE}/{path.stem}" for path in (folder() / ACCELERATE).glob(f"*{SUFFIX}"))


def find(name: str) -> Path | None:
    """The shipped file a name means (``demo``, ``demo.yaml``, ``recipes/demo.yaml``,
    ``accelerate/fsdp-qlora``), or None when nothing shipped has that name."""
    parts = Path(name.removesuffix(SUFFIX)).parts
    if parts[:1] == ("recipes",):  # the form the README and the recipes' own comments use
        parts = parts[1:]
    key = "/".join(parts)
    if key in recipe_names() or key in accelerate_names():
        return folder() / f"{key}{SUFFIX}"
    return None


def resolve(path: Path) -> Path:
    """The file a recipe argument names: the path itself when it exists (or when it names nothing
    shipped: reading it then gives the usual one-line error), else the shipped recipe of that name."""
    if path.exists():
        return path
    shipped = find(str(path))
    return shipped if shipped is not None and shipped.stem in recipe_names() else path
