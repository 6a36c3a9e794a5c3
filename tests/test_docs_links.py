"""Every relative link of the repository's Markdown pages resolves: the file (or folder) exists, and an anchor
names a heading of the target page by GitHub's slug rules. External links (http, https, mailto) are not
followed: no test touches the network.

Pages checked: README.md, docs/**/*.md, and the READMEs under bench/ and toolkit/. Links are inline
(`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, images `![alt](path)`) and reference definitions
(`[name]: path`); anything inside code (fenced blocks, `inline spans`) is text, not a link.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted({REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("bench/**/*.md"),
                *REPO.glob("toolkit/**/*.md")})

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def page_lines(text: str, *, code_spans: bool = False) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks; inline code spans blanked unless `code_spans`
    (a heading's anchor includes its code's text, a link inside code is not a link)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line if code_spans else INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (links reduced to their text, markup and punctuation dropped
    except '-' and '_'), lowercased, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = "".join(c for c in text.lower() if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a page offers: one per heading (a repeated one gets -1, -2, ... as on GitHub), and HTML
    `<a name=...>` / `<a id=...>` targets."""
    text = page.read_text(encoding="utf-8")
    found = {a for _, line in page_lines(text) for a in HTML_ANCHOR.findall(line)}
    seen: dict[str, int] = {}
    for _, line in page_lines(text, code_spans=True):
        if (m := HEADING.match(line)) is not None:
            base = slug(m.group(2))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link on the page."""
    out = []
    for number, line in page_lines(page.read_text(encoding="utf-8")):
        out += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        if (m := REFERENCE.match(line)) is not None:
            out.append((number, m.group(1)))
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """`page:line: target (why)` for each relative link of `page` that does not resolve."""
    broken = []
    for number, target in links(page):
        if target.lower().startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            dest = page
        elif path_part.startswith("/"):
            dest = root / path_part.lstrip("/")  # GitHub reads a leading / as the repository root
        else:
            dest = Path(os.path.normpath(page.parent / path_part))
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and dest.is_file() and unquote(anchor).lower() not in anchors(dest):
            broken.append(f"{where} (no heading '{anchor}' in {dest.relative_to(root)})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_pages_checked_include_the_front_page_and_docs() -> None:
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/bad_inputs.md"} <= names


def test_github_slugs() -> None:
    assert slug("Data at scale: token stores") == "data-at-scale-token-stores"
    assert slug("Look at the data first: `toolkit inspect-data`") == "look-at-the-data-first-toolkit-inspect-data"
    assert slug("Vision-language stages (Qwen2.5-VL, Qwen3-VL)") == "vision-language-stages-qwen25-vl-qwen3-vl"
    assert slug("CPU: peak memory of the loss head (issue 13)") == "cpu-peak-memory-of-the-loss-head-issue-13"
    assert slug("keep_last and [the best](x.md)") == "keep_last-and-the-best"


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A section: here\n\n## A section: here\n")
    page = tmp_path / "README.md"
    page.write_text("\n".join([
        "# Page",
        "[ok](docs/other.md) [ok](docs/other.md#a-section-here) [ok](docs/other.md#a-section-here-1) [ok](#page)",
        "[gone](docs/missing.md) ![gone](docs/images/missing.png)",
        "[bad anchor](docs/other.md#no-such-heading) [bad](#nowhere)",
        "[ext](https://example.com/x) [mail](mailto:a@b.c) `[code](not/a/link.md)`",
        "```", "[fenced](not/a/link.md)", "```",
        "[ref]: docs/also-missing.md",
    ]))
    assert broken_links(page, root=tmp_path) == [
        "README.md:3: docs/missing.md (no such file)",
        "README.md:3: docs/images/missing.png (no such file)",
        "README.md:4: docs/other.md#no-such-heading (no heading 'no-such-heading' in docs/other.md)",
        "README.md:4: #nowhere (no heading 'nowhere' in README.md)",
        "README.md:9: docs/also-missing.md (no such file)",
    ]


TEST_CITATION = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_test_exists(page: Path) -> None:
    """A `tests/<file>.py::<name>` a page cites (docs/reliability.md's guarding tests) names a test function of that
    file: a renamed test leaves no stale name behind (two did)."""
    stale = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        for file, name in TEST_CITATION.findall(line):
            source = REPO / file
            if not source.is_file() or not re.search(rf"^\s*def {name}\(", source.read_text(), re.MULTILINE):
                stale.append(f"{page.name}:{number}: {file}::{name}")
    assert not stale, stale
