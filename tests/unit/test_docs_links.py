"""Every link in the README, docs/ and bench/README.md resolves, and the pages stay short enough to read.

A relative link must name a file or folder of the repository; a ``#fragment`` must be the anchor
GitHub gives one of the target page's headings. The Markdown is parsed with markdown-it-py (the
CommonMark parser rich already depends on), so links inside code are not links, as on GitHub.
"""

from __future__ import annotations

import unicodedata
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
LONGEST = {"bench/README.md": 200}  # every docs/*.md: DOCS_LONGEST
DOCS_LONGEST = 400

_md = MarkdownIt("commonmark").enable("table")


def github_slug(text: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading whose text is ``text``, ``seen`` holding the page's earlier ones.

    github-slugger's rule (what github.com does): lower case; letters, marks, numbers, connector
    punctuation and ``-`` kept, every space becomes ``-``, anything else dropped; a repeated
    anchor gets ``-1``, ``-2``, ... No library here does this, hence these lines.
    """
    slug = "".join(
        "-" if unicodedata.category(c) == "Zs"
        else c if c == "-" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"
        else ""
        for c in text.lower()
    )
    base = slug
    while slug in seen:
        seen[base] += 1
        slug = f"{base}-{seen[base]}"
    seen[slug] = 0
    return slug


def _plain_text(inline: Token) -> str:
    """A heading's text as GitHub renders it: code spans keep their content, markup goes."""
    return "".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline"))


@cache
def _parsed(page: Path) -> list[Token]:
    return _md.parse(page.read_text(encoding="utf-8"))


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown page."""
    tokens = _parsed(page)
    seen: dict[str, int] = {}
    return frozenset(
        github_slug(_plain_text(tokens[i + 1]), seen) for i, t in enumerate(tokens) if t.type == "heading_open"
    )


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image of a page, code excluded."""
    found = []
    for block in _parsed(page):
        line = (block.map or [0])[0] + 1
        for child in block.children or []:
            line += child.type in ("softbreak", "hardbreak")
            attr = {"link_open": "href", "image": "src"}.get(child.type)
            target = child.attrGet(attr) if attr else None
            if isinstance(target, str):
                found.append((line, target))
    return found


def broken(page: Path, target: str, root: Path = ROOT) -> str | None:
    """Why ``target`` (a link on ``page``, in the repository at ``root``) does not resolve, or None."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return None  # a web address: not checked offline
    path, fragment = unquote(parts.path), unquote(parts.fragment)
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"no file {path}"
    if root not in dest.parents and dest != root:
        return f"{path} is outside the repository"
    if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
        return f"no heading with the anchor #{fragment} in {dest.relative_to(root)}"
    if fragment and dest.suffix != ".md":
        return f"#{fragment} on {path}, which is not a Markdown page"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    """Each relative link of the page names a file, and each fragment a heading of it."""
    problems = [f"{page.relative_to(ROOT)}:{line}: {target}: {why}"
                for line, target in links(page) if (why := broken(page, target))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_stay_short(page: Path) -> None:
    """bench/README.md at most 200 lines, every docs/*.md at most 400: history goes to the commit log."""
    name = str(page.relative_to(ROOT))
    limit = LONGEST.get(name, DOCS_LONGEST if name.startswith("docs/") else None)
    if limit is None:
        return  # the README has no limit of its own
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{name} has {lines} lines, more than {limit}"


# github-slugger's fixtures (test/fixtures.json), which its authors check against github.com.
SLUGGER_FIXTURES = [
    ("heading with a - dash", "heading-with-a---dash"),
    ("heading with an _ underscore", "heading-with-an-_-underscore"),
    ("heading with a period.txt", "heading-with-a-periodtxt"),
    ("exchange.bind_headers(exchange, routing [, bindCallback])", "exchangebind_headersexchange-routing--bindcallback"),
    ("apostrophe\u2019s should be trimmed", "apostrophes-should-be-trimmed"),
    ("I \u2665 unicode", "i--unicode"),
    ("en\u2013dash", "endash"),
    ("Привет non-latin 你好", "привет-non-latin-你好"),
]
SLUGGER_REPEATS = [
    ("echo", "echo"), ("echo", "echo-1"), ("echo 1", "echo-1-1"), ("echo-1", "echo-1-2"), ("echo", "echo-2"),
    ("foxtrot-1", "foxtrot-1"), ("foxtrot", "foxtrot"), ("foxtrot", "foxtrot-2"),
]


@pytest.mark.parametrize(("heading", "anchor"), SLUGGER_FIXTURES)
def test_slug_matches_github(heading: str, anchor: str) -> None:
    """The anchor rule gives what GitHub gives, on github-slugger's own cases."""
    assert github_slug(heading, {}) == anchor


def test_repeated_headings_are_numbered_as_on_github() -> None:
    """A page's repeated anchors get -1, -2 in order, skipping ones taken by a heading's own text."""
    seen: dict[str, int] = {}
    assert [github_slug(h, seen) for h, _ in SLUGGER_REPEATS] == [a for _, a in SLUGGER_REPEATS]


def test_the_checker_finds_a_broken_link(tmp_path: Path) -> None:
    """A missing file and a missing anchor are reported; a good anchor, a folder and a web address are not."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Top `code` heading\n\n## Again\n\n## Again\n\n"
        "[a](#top-code-heading) [b](#again-1) [c](#nowhere) [d](missing.md) [e](.) [f](https://example.com/x#y)\n"
        "`[g](#in-code)`\n",
        encoding="utf-8",
    )
    found = links(page)
    assert [line for line, _ in found] == [7] * 6  # the line each link stands on
    verdicts = {target: broken(page, target, tmp_path) for _, target in found}
    assert set(verdicts) == {"#top-code-heading", "#again-1", "#nowhere", "missing.md", ".", "https://example.com/x#y"}
    assert {t for t, why in verdicts.items() if why} == {"#nowhere", "missing.md"}
