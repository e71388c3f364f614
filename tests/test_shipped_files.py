"""
The files a project ships beside its code: the license the metadata names,
a changelog with the current version, and guides whose links lead somewhere.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from support import REPO

import hostpid


def test_the_license_file_is_the_apache_license_the_metadata_names() -> None:
    metadata = configparser.ConfigParser()
    metadata.read(REPO / "setup.cfg")
    assert metadata["metadata"]["license"] == "Apache-2.0"
    assert metadata["metadata"]["license_files"].split() == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for landmark in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
                     "9. Accepting Warranty or Additional Liability.",
                     "END OF TERMS AND CONDITIONS",
                     "http://www.apache.org/licenses/LICENSE-2.0"):
        assert landmark in text, landmark


def test_the_changelog_has_the_current_version_with_upgrade_notes() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    versions = {section.split("\n", 1)[0].strip(): section for section in sections}
    assert hostpid.__version__ in versions, sorted(versions)
    for name, section in versions.items():
        assert "### Upgrade notes" in section, f"{name}: say what an upgrade needs"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    tokens = MarkdownIt("commonmark").parse(path.read_text())
    for index, token in enumerate(tokens):
        if token.type == "heading_open":
            inline = tokens[index + 1]
            title = "".join(
                child.content for child in inline.children or ()
                if child.type in ("text", "code_inline")
            )
            base = slug(title)
            name, count = base, 1
            while name in found:
                name, count = f"{base}-{count}", count + 1
            found.add(name)
    return found


def links(path: Path) -> list[str]:
    found: list[str] = []
    for token in MarkdownIt("commonmark").parse(path.read_text()):
        for child in token.children or ():
            if child.type == "link_open":
                found.append(str(child.attrs["href"]))
    return found


#: The pages whose every relative link is checked.
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_lead_somewhere(page: Path) -> None:
    """A moved page or report, or a renamed heading, breaks no link silently."""
    broken = []
    for href in links(page):
        if re.match(r"^[a-z]+:", href):
            continue
        target, _, anchor = href.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{href}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{href}: no such heading")
    assert broken == [], "\n".join(broken)


def test_the_troubleshooting_page_is_linked_from_the_readme() -> None:
    assert "docs/troubleshooting.md" in links(REPO / "README.md")


def test_the_link_check_sees_links_and_headings(tmp_path: Path) -> None:
    """The check above is not vacuous: it reads links and headings as GitHub does."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Two `code` words (here)\n\n## Two `code` words (here)\n\n[a](#x) [b](other.md)\n"
    )
    assert anchors(page) == {"two-code-words-here", "two-code-words-here-1"}
    assert links(page) == ["#x", "other.md"]
    assert "4-hostpid-doctor-in-the-workload" in anchors(REPO / "docs" / "troubleshooting.md")
