"""README.md and docs/*.md: every relative link points at a file that exists (and at a heading that exists, when
it names one), and the README stays short enough to read in five minutes with its two commands first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250

_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")  # [text](target), not images
_FENCE = re.compile(r"^\s*```")
_EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a link-like string in code is not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens; repeats get -1, -2, ..."""
    found: set[str] = set()
    for line in prose(page.read_text(encoding="utf-8")):
        if match := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
            candidate, n = slug, 0
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
    return found


def links(page: Path) -> list[str]:
    text = "\n".join(prose(page.read_text(encoding="utf-8")))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return [target for target in _LINK.findall(text) if not target.startswith(_EXTERNAL)]


def test_the_pages_exist() -> None:
    names = {page.name for page in PAGES}
    for name in ("configuration.md", "gguf-and-kernels.md", "benchmarks.md", "serving.md", "architecture.md",
                 "llama-stack.md", "scale-out.md", "hardening.md"):  # fmt: skip
        assert name in names, f"docs/{name} is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [gone](missing.md) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n", encoding="utf-8")  # fmt: skip
    assert links(page) == ["page.md#title", "missing.md"]
    assert anchors(page) == {"title"}


def test_readme_is_short_with_the_two_commands_first() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    head = "\n".join(lines[:8])
    assert "\nbash scripts/serve.sh " in head and "\nbash scripts/test.sh " in head
    assert head.index("bash scripts/serve.sh") < head.index("bash scripts/test.sh")
