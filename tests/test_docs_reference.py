"""The documentation's references are the code's: docs/reference/*.md is what scripts/docs_reference.py
makes from the typed recipe, the typer app and the registries, every recipe field (at any depth: a
mixture's source, the preflight, a reward) has the docstring the recipe reference shows, and the
benchmark figures a page includes (pymdownx.snippets) are whole committed tables, never retyped."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference  # noqa: E402

SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::(\d+):(\d+))?"$', re.MULTILINE)


def test_every_recipe_field_at_any_depth_has_a_docstring():
    missing = docs_reference.fields_without_docstrings()
    assert not missing, f"recipe fields without a docstring (one line under the field): {missing}"


def test_the_reference_pages_are_what_the_code_makes_now():
    stale = docs_reference.stale_pages()
    assert not stale, (
        f"docs/reference/ is stale ({', '.join(stale)}): run `{docs_reference.REGENERATE}` and commit the pages"
    )


def test_the_recipe_reference_has_a_row_for_every_field():
    page = (ROOT / "docs" / "reference" / "recipe.md").read_text(encoding="utf-8")
    for prefix, model in docs_reference.sections():
        section = page.split(f"## `{prefix}`\n", 1)[1].split("\n## ", 1)[0]
        for name in model.model_fields:
            assert f"| `{name}` |" in section, f"{prefix}.{name}"


def included_ranges() -> list[tuple[str, str, int, int]]:
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for path, start, end in SNIPPET.findall(page.read_text(encoding="utf-8")):
            found.append((page.name, path, int(start or 1), int(end or 0)))
    return found


def test_included_benchmark_lines_are_a_tables_command_date_and_whole_table():
    ranges = included_ranges()
    assert any(path.startswith("benchmarks/results/") for _, path, _, _ in ranges)
    for page, path, start, end in ranges:
        lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
        if path == "README.md":  # getting-started shows the README's two commands, its first bash block
            assert lines[start - 1] == "```bash" and lines[end - 1] == "```", f"{page}: {path}:{start}:{end}"
            assert "```bash" not in lines[: start - 1], f"{page}: {path}:{start}:{end} is not the first block"
            continue
        shown = lines[start - 1 : end]
        where = f"{page} includes {path}:{start}:{end}"
        assert shown[0].startswith("- command: "), f"{where}: it must open with the table's command line"
        assert any(line.startswith("- date: ") for line in shown), f"{where}: without the table's date"
        rows = [i for i, line in enumerate(lines) if line.startswith("|")]
        first, last = rows[0], rows[-1]
        # the whole table: from its header to its last row (a rerun that grows it moves the range)
        assert start - 1 <= first and last <= end - 1, (
            f"{where}: cuts the table (lines {first + 1}-{last + 1})"
        )


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (lower case, punctuation but - and _ dropped, spaces to -)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_reach_a_file_and_its_heading():
    # the README is read on GitHub and in the wheel, outside the site's strict build: its links are checked here
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) > 20
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), f"README.md links {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {github_anchor(h) for h in headings}, (
                f"README.md links {path}#{anchor}: no such heading"
            )
