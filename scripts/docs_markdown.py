"""Markdown for the generated reference pages (scripts/docs_reference.py): tables whose cells stay cells,
pages of blocks, and the line that says a page is generated."""

from __future__ import annotations

REGENERATE = "python scripts/docs_reference.py"
GENERATED = f"<!-- Generated from the code by `{REGENERATE}`: edit the code, not this page. -->"


def cell(text: object) -> str:
    """Text that stays inside one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def page(*blocks: str) -> str:
    """A page: its blocks (a heading, a paragraph, a table) separated by blank lines."""
    return "\n\n".join(blocks) + "\n"


def code(value: object) -> str:
    return f"`{value}`" if value != "" else ""


def yes(value: bool) -> str:
    return "yes" if value else ""
