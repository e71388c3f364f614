"""
No doc installs from a package index a name this project has not published.

This project publishes no distribution to any index: it is installed from
its own checkout or from a wheel built from it.  C{docs/nri.md} told root on
a node to run C{pip install --upgrade hostpid-broker}: no such distribution
exists on PyPI, so it failed, and the day anyone registered the name it would
have installed their code as root on every GPU node that followed the doc.

So every C{pip install} in the docs, the deploy files' comments and the
scripts' help names a path (the checkout, C{.}, C{'.[extra]'}, a wheel file,
an upper-case placeholder for one) or a dependency the project declares in
C{setup.cfg} or C{pyproject.toml} (a name its owner publishes, which the
install would fetch anyway); anything else, the project's own name first, is
a name fetched from whoever holds it on the index.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

from support import REPO

#: pip's options that take a value (the value is not a requirement).
VALUED = {"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url",
          "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root",
          "--platform", "--python-version", "--implementation", "--abi", "--src",
          "--upgrade-strategy", "--progress-bar", "--report", "--cache-dir", "--log"}
INSTALL = re.compile(r"\bpip3?\s+install\b(?P<args>[^`\n|;&#)]*)")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def texts() -> list[Path]:
    """The docs, and every file under deploy/, bench/ and bin/ that a reader runs or reads."""
    found = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    for folder in ("deploy", "bench", "bin", ".ci"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and "reports" not in path.parts and \
                    path.suffix not in (".json", ".png", ".svg", ".csv"):
                found.append(path)
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """Every dependency the project declares: install_requires, extras, build requires."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines()
    for extra in setup["options.extras_require"].values():
        lines += extra.splitlines()
    pyproject = (REPO / "pyproject.toml").read_text()
    lines += re.findall(r'"([^"]+)"', pyproject.split("requires", 1)[1].split("]", 1)[0])
    names = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if match := NAME.match(line):
            names.add(normalized(match.group(0)))
    return names


def is_path(argument: str) -> bool:
    return (argument.startswith((".", "/", "~", "$")) or "/" in argument
            or argument.endswith((".whl", ".tar.gz", ".zip"))
            or re.fullmatch(r"[A-Z][A-Z0-9_-]*", argument) is not None)


def fetched_names(arguments: str) -> list[str]:
    """The requirements of one C{pip install ARGS} that pip would look up on an index."""
    try:
        words = shlex.split(arguments)
    except ValueError:
        words = arguments.split()
    if "--no-index" in words:
        return []  # only the --find-links given (the image's own wheels) are looked at
    names = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in VALUED:
            skip = True
        elif word.startswith("-") or is_path(word):
            continue
        elif match := NAME.match(word):
            names.append(match.group(0))
    return names


def installs() -> list[tuple[str, str]]:
    found = []
    for path in texts():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        joined = text.replace("\\\n", "  ")  # continuation lines joined, offsets kept
        for match in INSTALL.finditer(joined):
            number = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(REPO)}:{number}", match.group("args")))
    return found


def test_no_doc_fetches_a_name_the_project_has_not_published() -> None:
    allowed = declared()
    found = installs()
    assert len(found) >= 10, "the docs' pip installs were found"
    wrong = [(where, name) for where, arguments in found for name in fetched_names(arguments)
             if normalized(name) not in allowed]
    assert wrong == []


def test_the_check_finds_what_it_should() -> None:
    """The control: the command the NRI doc gave, and the forms that are fine."""
    allowed = declared()
    assert "hostpid-broker" not in allowed and "twisted" in allowed
    assert fetched_names(" --upgrade hostpid-broker   ") == ["hostpid-broker"]
    assert fetched_names(" -q '.[test]'") == []
    assert fetched_names(" /path/to/hostpid_broker-VERSION-*.whl") == []
    assert fetched_names(" --no-index --find-links /wheels hostpid-broker") == []
    assert fetched_names(" --find-links /wheels hostpid-broker") == ["hostpid-broker"]
    assert fetched_names(" CHECKOUT-OR-WHEEL") == []
    assert fetched_names(" --no-deps .") == []
    assert [m.group("args") for m in INSTALL.finditer(
        "/opt/hostpid/venv/bin/pip install --upgrade hostpid-broker   # the running")] == \
        [" --upgrade hostpid-broker   "]
