"""
Every table in the README and docs/ renders as a table: a row cut off from
its table (a paragraph between them, a missing header or separator) is
printed as a line of pipes instead, which a reader of the rendered page
cannot use.  Rendered with markdown-it-py (CommonMark with GitHub's tables).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from support import REPO

PAGES = sorted([REPO / "README.md", REPO / "deploy" / "helm" / "hostpid-broker" / "README.md",
                *(REPO / "docs").glob("*.md")])
ROW = re.compile(r"^\s*\|.*\|\s*$")


def unrendered_rows(text: str) -> list[int]:
    """The line numbers (1-based) of table-like rows that no rendered table holds."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    held: set[int] = set()
    for token in tokens:
        if token.map is not None and token.type in ("table_open", "fence", "code_block",
                                                    "html_block"):
            held.update(range(token.map[0], token.map[1]))
    return [number + 1 for number, line in enumerate(text.splitlines())
            if ROW.match(line) and number not in held]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_table_renders(page: Path) -> None:
    assert unrendered_rows(page.read_text()) == []


def test_a_row_cut_off_from_its_table_is_found() -> None:
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n\nA paragraph.\n| 3 | 4 |\n"
    assert unrendered_rows(text) == [6]
