"""Write the documentation's reference pages from the code, so they cannot drift from it:

    python scripts/docs_reference.py            # (re)write docs/reference/*.md
    python scripts/docs_reference.py --check    # exit 1 naming each page that differs from the code

- ``recipe.md``: every section and field of the typed recipe (qlora_kit/recipe/): its type, default,
  allowed values and bounds, and its docstring (pydantic's field description);
- ``cli.md``: every ``qlora-kit`` command, its arguments and options, from the typer app's own click
  definitions (qlora_kit/cli/app.py);
- ``families.md`` and ``objectives.md``: the model families, data formats, optimizers and objectives,
  rendered from qlora_kit/registries/.

tests/test_docs_reference.py compares these pages with the committed ones and fails on a field without
a docstring. Standard library, pydantic and click only: nothing here loads torch.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"

for folder in (ROOT, ROOT / "scripts"):  # run as a script from a checkout, or imported by the tests
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from docs_markdown import GENERATED, REGENERATE, code, table  # noqa: E402
from docs_registries import benchmarks_page, families_page, objectives_page  # noqa: E402

# --- the recipe ---------------------------------------------------------------------------------


def yaml_value(value: object) -> str:
    """A default as a recipe file writes it (null, true, [a, b])."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    if isinstance(value, Path):
        value = str(value)
    return json.dumps(value) if not isinstance(value, str) else value


def type_name(annotation: object) -> str:
    """A field's annotation in words a recipe writer reads: ``int or "auto"``, ``list of str``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def bounds(field) -> str:
    """The numeric bounds pydantic enforces (``> 0``, ``>= 0, < 1``)."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = []
    for rule in field.metadata:
        for attr, sign in signs.items():
            if getattr(rule, attr, None) is not None:
                found.append(f"{sign} {getattr(rule, attr)}")
    return ", ".join(found)


def sections():
    """(dotted name, pydantic class) of every section of the recipe, nested ones after their parent:
    ``data``, ``data.sources[]``, ``data.preflight``."""
    from qlora_kit.recipe.recipe import Recipe

    found = []

    def walk(prefix: str, model) -> None:
        found.append((prefix, model))
        for name, field in model.model_fields.items():
            nested = _nested_section(field.annotation)
            if nested is not None:
                walk(
                    f"{prefix}.{name}" + ("[]" if typing.get_origin(field.annotation) is list else ""), nested
                )

    for name, field in Recipe.model_fields.items():
        walk(name, field.annotation)
    return found


def _nested_section(annotation):
    candidates = [annotation, *typing.get_args(annotation)]
    return next((c for c in candidates if isinstance(c, type) and hasattr(c, "model_fields")), None)


def fields_without_docstrings() -> list[str]:
    """Every recipe field, at any depth, that has no docstring (no description for validate and docs)."""
    return [
        f"{prefix}.{name}"
        for prefix, model in sections()
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]


def default_of(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return (
        "" if _nested_section(field.annotation) and hasattr(value, "model_dump") else code(yaml_value(value))
    )


def recipe_page() -> str:
    parts = [
        "# Recipe reference",
        "",
        GENERATED,
        "",
        "Every field of the typed recipe (`qlora_kit/recipe/`), section by section: its type, its default, the "
        "values or bounds it allows and its docstring. A recipe file holds only the values that differ from "
        "these defaults; `qlora-kit validate RECIPE` prints every resolved value, and `--set section.field=value` "
        "overrides any of them from the command line. Unknown keys are errors.",
    ]
    for prefix, model in sections():
        parts += ["", f"## `{prefix}`", ""]
        own_doc = model.__doc__ if "__doc__" in vars(model) and model.__doc__ else ""
        if own_doc:
            parts += [" ".join(own_doc.split()), ""]
        rows = []
        for name, field in model.model_fields.items():
            allowed = bounds(field)
            rows.append(
                [
                    f"`{name}`",
                    type_name(field.annotation),
                    default_of(field),
                    allowed,
                    field.description or "",
                ]
            )
        parts.append(table(["field", "type", "default", "bounds", "what it sets"], rows))
    return "\n".join(parts) + "\n"


# --- the command line ---------------------------------------------------------------------------


def cli_page() -> str:
    import typer

    from qlora_kit.cli.app import app

    root = typer.main.get_command(app)
    parts = [
        "# Command-line reference",
        "",
        GENERATED,
        "",
        f"{root.help}",
        "",
        "Every command that takes a recipe takes a shipped recipe's name too (`qlora-kit recipes` lists "
        "them). `python -m qlora_kit` is the same command line.",
    ]

    # duck-typed: typer 0.29 carries its own copy of click (typer._click), earlier releases use click
    def command(path: list[str], cmd) -> None:
        usage = " ".join([*path, *usage_pieces(cmd)])
        parts.extend(["", f"## `{' '.join(path)}`", "", (cmd.help or "").strip(), "", f"```\n{usage}\n```"])
        rows = [param_row(param) for param in cmd.params if not getattr(param, "hidden", False)]
        if rows:
            parts.extend(["", table(["argument or option", "type", "default", "what it does"], rows)])
        if hasattr(cmd, "commands"):
            for name in sorted(cmd.commands):
                command([*path, name], cmd.commands[name])

    for name in sorted(root.commands):
        command(["qlora-kit", name], root.commands[name])
    return "\n".join(parts) + "\n"


def usage_pieces(cmd) -> list[str]:
    """``[OPTIONS] RECIPE [DEST]``: click's usage line, written the same under every typer release."""
    pieces = ["[OPTIONS]"] if any(p.param_type_name == "option" for p in cmd.params) else []
    for param in cmd.params:
        if param.param_type_name == "argument":
            name = param.name.upper()
            pieces.append(name if param.required else f"[{name}]")
    if hasattr(cmd, "commands"):
        pieces.append("[COMMAND]")
    return pieces


def param_row(param) -> list[str]:
    if param.param_type_name == "argument":
        name = param.name.upper()
    else:
        name = ", ".join(param.opts + param.secondary_opts)
    required = "required" if param.required else ""
    descriptor = getattr(param, "type_descriptor", None)  # typer >= 0.29; else click's type object
    if getattr(param, "is_flag", False) and not param.secondary_opts:
        kind = "flag"
    elif getattr(param, "is_flag", False):
        kind = "on/off"
    else:
        kind = type_name(descriptor.annotation) if descriptor is not None else click_type_name(param)
        kind = {"Path": "path", "list of Path": "list of path"}.get(kind, kind)
        if getattr(param, "multiple", False):
            kind = kind.removeprefix("list of ") + " (repeatable)"
    default = param.default
    if default is None or default == () or (getattr(param, "is_flag", False) and default is False):
        default = required
    else:
        default = code(yaml_value(default))
    return [f"`{name}`", kind, default, getattr(param, "help", None) or ""]


def click_type_name(param) -> str:
    """The type column from click's own objects (typer before 0.29, e.g. at pyproject.toml's floor), as
    typer 0.29's annotation gives it: click names a bounded int "int range", and says that an argument
    takes any number of values only through its nargs."""
    name = {"int range": "int", "float range": "float"}.get(param.type.name, param.type.name)
    return f"list of {name}" if param.nargs == -1 else name


# --- the registries -----------------------------------------------------------------------------


def pages() -> dict[str, str]:
    """Each reference page's file name and text, as the code stands."""
    return {
        "benchmarks.md": benchmarks_page(),
        "recipe.md": recipe_page(),
        "cli.md": cli_page(),
        "families.md": families_page(),
        "objectives.md": objectives_page(),
    }


def stale_pages() -> list[str]:
    """The reference pages whose committed text differs from what the code makes now."""
    return [
        name
        for name, text in pages().items()
        if not (REFERENCE / name).exists() or (REFERENCE / name).read_text(encoding="utf-8") != text
    ]


def main(argv: list[str]) -> int:
    missing = fields_without_docstrings()
    if missing:
        print(f"recipe fields without a docstring: {', '.join(missing)}", file=sys.stderr)
        return 1
    if "--check" in argv:
        stale = stale_pages()
        for name in stale:
            print(f"docs/reference/{name} is stale: run {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (REFERENCE / name).write_text(text, encoding="utf-8")
        print(f"wrote docs/reference/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
