"""
Every image name the docs' commands give is one podman, Docker and the
kubelet accept.

C{docs/image.md} built C{-t REGISTRY/hostpid/hostpid-broker:0.1.0}, which
fails as written: a name's first component is a registry host only when it
has a C{.} or a C{:} or is C{localhost} (the distribution reference
grammar); otherwise it is a path component on Docker Hub, and path
components are lower case, so podman refuses the name (C{invalid reference
format: repository name must be lowercase}), and the chart's
C{image.repository} set to it would leave the pods in C{InvalidImageName}.

The names are found in C{podman}/C{docker} C{build -t}, C{push}, C{save},
C{tag} and C{run} commands and in C{image.repository=} settings, and checked
against the grammar; the grammar's verdict on the old and the new example is
checked against podman's own where podman is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support import REPO, skip_or_fail

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             REPO / "deploy" / "helm" / "hostpid-broker" / "README.md"]

# The distribution reference grammar (github.com/distribution/reference, regexp.go).
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_PATH = rf"{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?"
WITH_DOMAIN = re.compile(rf"{_DOMAIN}/{_PATH}")
WITHOUT_DOMAIN = re.compile(_PATH)
IMAGE_COMMAND = re.compile(
    r"\b(?:podman|docker)\s+(?:build\b[^`\n]*?\s-t|push|save\b[^`\n]*?\s-o\s+\S+|tag)"
    r"\s+(?P<name>[^\s`'\"]+)")
REPOSITORY = re.compile(r"image\.repository=(?P<name>[^\s`'\"\\]+)")


def has_domain(name: str) -> bool:
    """The parser's rule: the first component is a host only with a '.' or ':', or localhost."""
    first, _, rest = name.partition("/")
    return bool(rest) and ("." in first or ":" in first or first == "localhost")


def valid(name: str) -> bool:
    pattern = WITH_DOMAIN if has_domain(name) else WITHOUT_DOMAIN
    return pattern.fullmatch(name) is not None


def names() -> list[tuple[str, str]]:
    found = []
    for path in DOCUMENTS:
        text = path.read_text().replace("\\\n", "  ")
        for pattern in (IMAGE_COMMAND, REPOSITORY):
            for match in pattern.finditer(text):
                name = match.group("name")
                if name.startswith(("-", "$", ".")) or name == "IMAGE":
                    continue  # an option, a variable, a path, the reader's own image
                number = text.count("\n", 0, match.start()) + 1
                found.append((f"{path.relative_to(REPO)}:{number}", name))
    return found


def test_every_image_name_in_the_docs_is_valid() -> None:
    found = names()
    assert len(found) >= 8, found
    assert [(where, name) for where, name in found if not valid(name)] == []


def test_the_grammar_refuses_the_old_example() -> None:
    assert not valid("REGISTRY/hostpid/hostpid-broker:0.1.0")
    assert valid("registry.example.com/hostpid/hostpid-broker:0.1.0")
    assert valid("REGISTRY.example.com:5000/hostpid/hostpid-broker")  # a host: any case
    assert valid("localhost/hostpid/hostpid-broker:0.1.0")
    assert not valid("localhost/Hostpid/hostpid-broker")


@pytest.mark.parametrize("name", ["REGISTRY/hostpid/hostpid-broker:0.1.0",
                                  "registry.example.com/hostpid/hostpid-broker:0.1.0"])
def test_podman_agrees(name: str, tmp_path: Path) -> None:
    """podman's own parser, on a one-layer image built from scratch (nothing pulled)."""
    if shutil.which("podman") is None:
        skip_or_fail("podman is not installed: its parser cannot be asked")
    (tmp_path / "Containerfile").write_text("FROM scratch\nLABEL hostpid.test=name\n")
    tag = name.replace("0.1.0", "doc-name-check")
    built = subprocess.run(["podman", "build", "-q", "-f", str(tmp_path / "Containerfile"),
                            "-t", tag, str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    try:
        assert (built.returncode == 0) == valid(name), built.stderr
        if not valid(name):
            assert "repository name must be lowercase" in built.stderr, built.stderr
    finally:
        if built.returncode == 0:
            subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, timeout=60)
