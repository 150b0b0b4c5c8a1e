"""The README and docs/ pages link only to files that exist: a moved or renamed page breaks this test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def relative_links(page: Path) -> list[str]:
    """Targets of the page's markdown links and ``<img src>`` outside code blocks, without URLs and anchors."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a link in a code block does not render
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_names_a_file(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


def test_the_docs_index_lists_every_page():
    index = relative_links(REPO / "docs" / "README.md")
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert pages <= set(index), pages - set(index)
