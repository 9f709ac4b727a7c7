"""Every ``qlora-kit`` command line the documentation shows (docs/*.md and the README, in code blocks and
in inline code) parses as the command line would parse it: its command exists, its flags exist, it takes
that many arguments, and the recipe it names validates with its ``--set`` overrides. In process, through
the typer app's own click command (nothing runs, nothing trains): a renamed flag or field, or a recipe
changed under a page that shows it, is red here with the page and the line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import typer.main

from qlora_kit.cli.app import app
from qlora_kit.errors import RecipeError
from qlora_kit.recipe import shipped
from qlora_kit.recipe.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
# the generated references show usage lines ([OPTIONS] RECIPE), not commands a user types
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)
INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*qlora-kit [a-z][^`]*)`")
# where a page names a folder or file it cannot know (a run's output, a user's recipe): a word in capitals
PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b")


def shell_lines(text: str) -> list[tuple[str, bool]]:
    """The command lines of the page's code blocks (continuations joined), whole, and of its inline code,
    which may name a command or a flag in passing (`qlora-kit plan --with-data`): (line, whole)."""
    lines = []
    for block in FENCE.findall(text):
        lines += [(line, True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines + [(span, False) for span in INLINE.findall(FENCE.sub("", text))]


def qlora_kit_args(line: str) -> list[list[str]]:
    """The arguments after ``qlora-kit`` (or ``-m qlora_kit``, or the image's entrypoint under ``docker
    run``) of each command in a shell line, its comment and a trailing ``...`` left out."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # not shell (a YAML or Python line with a quote in it)
        return []
    found, segment = [], []
    for token in [*tokens, "&&"]:
        if token not in {"&&", "||", ";", "|"}:
            segment.append(token)
            continue
        while segment and re.match(r"^[A-Z_]+=", segment[0]):  # VAR=value before the command
            segment.pop(0)
        if segment[:1] == ["qlora-kit"]:
            found.append(segment[1:])
        elif "-m" in segment and segment[segment.index("-m") + 1 :][:1] == ["qlora_kit"]:
            found.append(segment[segment.index("-m") + 2 :])
        elif segment[:2] == ["docker", "run"] and "qlora-kit" in segment:
            found.append(segment[segment.index("qlora-kit") + 1 :])
        segment = []
    return [[a for a in args if a != "..."] for args in found]


def commands_shown() -> list[tuple[str, list[str], bool]]:
    return [
        (f"{page.relative_to(ROOT)}: {line.strip()}", args, whole)
        for page in PAGES
        for line, whole in shell_lines(page.read_text(encoding="utf-8"))
        for args in qlora_kit_args(line)
    ]


def parse(args: list[str], whole: bool = True):
    """The leaf command and its parsed parameters, as ``qlora-kit ARGS`` would parse them (no run). A
    command named in passing (not ``whole``) may leave out its arguments; its flags must still exist."""
    command, path = CLI, ["qlora-kit"]
    while hasattr(command, "commands") and args and not args[0].startswith("-"):
        if args[0] not in command.commands:
            raise ValueError(f"no such command: {' '.join([*path, args[0]])}")
        path.append(args[0])
        command, args = command.commands[args[0]], args[1:]
    try:
        return command, command.make_context(" ".join(path), list(args), resilient_parsing=not whole).params
    except Exception as exc:  # click's UsageError (typer carries its own click: matched by name)
        if any(kind.__name__ == "UsageError" for kind in type(exc).__mro__):
            raise ValueError(f"{' '.join(path)}: {exc}") from None
        raise


def check_recipe(params: dict) -> None:
    """The recipe a command names validates with the command's overrides, unless it is a placeholder
    (``OUT/recipe.yaml``) or a run's own saved recipe (``outputs/...``), which no page can know."""
    value = params.get("recipe")
    if value is None or PLACEHOLDER.search(str(value)) or str(value).startswith("outputs/"):
        return
    path = ROOT / value if (ROOT / value).exists() else shipped.resolve(Path(value))
    Recipe.from_yaml(path, overrides=list(params.get("set_") or []))


SHOWN = commands_shown()
CLI = typer.main.get_command(app)  # built once: typer reads every command's signature to build it


def test_the_pages_show_commands_of_every_kind():
    # the extraction itself: code blocks, inline code, -m qlora_kit under a launcher, docker run
    assert len(SHOWN) >= 60, len(SHOWN)
    kinds = {args[0] for _, args, _ in SHOWN if args}
    assert {"train", "eval", "export", "plan", "recipes", "validate", "doctor"} <= kinds, kinds


def test_every_command_line_in_the_docs_parses_and_its_recipe_validates():
    # one test, not one per line: 100-odd parametrized cases would cost the fast tier their setup
    failures = []
    for where, args, whole in SHOWN:
        try:
            _, params = parse(args, whole)
            if whole:
                check_recipe(params)
        except (ValueError, RecipeError) as exc:
            failures.append(f"{where}\n  {exc}")
    assert not failures, "\n".join(failures)
