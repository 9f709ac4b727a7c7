"""Open the built documentation site in a real browser (headless Chromium) and check that it renders:

    mkdocs build --strict && python scripts/docs_browser.py [SITE] [--shots DIR] [--require]

It screenshots the front page and the recipe reference into DIR (default /tmp/docs-shots), then reads
back the DOM the browser built (after its scripts ran) and checks that the front page shows the
navigation, every page mkdocs.yml names in it, and that the recipe reference renders its tables, with
a row for each field of the recipe's first section. Exit 1 names what is missing. Without Chromium
(Debian's package: apt-get install chromium) it prints one line and exits 0, or 1 with --require
(CI installs it: .ci/run).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
PAGES = {"front": "index.html", "recipe-reference": "reference/recipe/index.html"}


class Page(HTMLParser):
    """What the checks read of a rendered page: the primary navigation's link texts and the tables' rows."""

    def __init__(self) -> None:
        super().__init__()
        self.nav_links: list[str] = []
        self.rows: list[list[str]] = []
        self._stack: list[tuple[str, str]] = []  # (tag, class) of the open elements
        self._text: list[str] | None = None
        self._row: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        classes = dict(attrs).get("class") or ""
        if tag not in {"br", "img", "input", "meta", "link", "hr"}:
            self._stack.append((tag, classes))
        # a page is a link, a section (navigation.sections) a label
        if tag in {"a", "label"} and "md-nav__link" in classes and self._inside("md-nav--primary"):
            self._text = []
        if tag == "tr":
            self._row = []
        if tag in {"td", "th"}:
            self._text = []

    def handle_endtag(self, tag):
        if tag in {"a", "label"} and self._text is not None and self._row is None:
            self.nav_links.append(" ".join("".join(self._text).split()))
            self._text = None
        if tag in {"td", "th"} and self._row is not None and self._text is not None:
            self._row.append(" ".join("".join(self._text).split()))
            self._text = None
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)

    def _inside(self, css_class: str) -> bool:
        return any(css_class in classes for _, classes in self._stack)


def nav_titles(nav) -> list[str]:
    """Every title in mkdocs.yml's nav, sections and pages, in order."""
    titles = []
    for entry in nav:
        for title, target in entry.items():
            titles.append(title)
            if isinstance(target, list):
                titles += nav_titles(target)
    return titles


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def render(browser: str, url: str, *args: str) -> str:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=3000"]
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [browser, *flags, f"--user-data-dir={profile}", *args, url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"{browser} failed on {url}: {done.stderr.strip()[-400:]}")
    return done.stdout


def problems(front: Page, reference: Page, titles: list[str], first_section: list[str]) -> list[str]:
    found = []
    missing = [title for title in titles if title not in front.nav_links]
    if not front.nav_links:
        found.append("the front page renders no navigation")
    elif missing:
        found.append(f"the front page's navigation lacks {', '.join(missing)}")
    fields = {row[0] for row in reference.rows if row}
    if not reference.rows:
        found.append("the recipe reference renders no table")
    elif not set(first_section) <= fields:
        found.append(f"the recipe reference's table lacks the rows {sorted(set(first_section) - fields)}")
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "site", nargs="?", type=Path, default=ROOT / "site", help="the built site (mkdocs build)"
    )
    parser.add_argument(
        "--shots", type=Path, default=Path("/tmp/docs-shots"), help="where the screenshots go"
    )
    parser.add_argument("--require", action="store_true", help="fail, not skip, without chromium (CI)")
    args = parser.parse_args(argv)
    site, shots = args.site, args.shots
    browser = find_browser()
    if browser is None:
        print("docs browser check skipped: no chromium (apt-get install chromium)")
        return 1 if args.require else 0
    if not (site / "index.html").exists():
        print(f"{site}: no built site (mkdocs build --strict first)", file=sys.stderr)
        return 1
    shots.mkdir(parents=True, exist_ok=True)
    pages = {}
    for name, path in PAGES.items():
        url = (site / path).resolve().as_uri()
        render(browser, url, f"--screenshot={shots / (name + '.png')}", "--window-size=1400,1000")
        page = Page()
        page.feed(render(browser, url, "--dump-dom"))
        pages[name] = page
    sys.path.insert(0, str(ROOT))
    from qlora_kit.recipe.recipe import Recipe

    first = next(iter(Recipe.model_fields))
    first_section = list(Recipe.model_fields[first].annotation.model_fields)
    titles = nav_titles(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    found = problems(pages["front"], pages["recipe-reference"], titles, first_section)
    for line in found:
        print(f"docs browser check: {line}", file=sys.stderr)
    if not found:
        print(
            f"docs browser check: {len(titles)} navigation entries and {len(pages['recipe-reference'].rows)} "
            f"recipe reference rows rendered; screenshots in {shots}"
        )
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
