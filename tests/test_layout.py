"""
The package's shape, enforced: imports only go downward and no module
imports another's private names.

Layers, bottom up:

  - shared: C{wire}, C{gate}, C{peercred}, C{starttime}, C{defaults}, C{errors}, C{logs},
    C{version}, C{values}, C{boundedhttp} (the HTTP bounds of the broker's
    metrics server and of the webhook), C{servicemaker} (the twistd plugin
    whose part lacks its extra says so in one line), C{fileattr} (the immutable
    attribute of the broker mountpoint, which the allocation side and the NRI
    plugin set and the broker's watch reads), C{pacedport} (the accept pace
    of the broker's and the NRI plugin's metrics ports);
    they import no side (C{values} nothing of the project at all, and C{wire}
    nothing but C{values});
  - sides: C{broker}, C{client}, C{node}, C{admission}, C{nri}; each imports
    the shared modules and its own side, never another side (but
    C{admission} and C{nri} take the canonical mounts and CDI names from
    C{node}, see L{ALLOWED});
  - the top: the package itself (the public API), C{cli} and C{testing},
    which may use the sides but not one another.

Read with C{ast} from the source, so a violating import is found whether
or not any test happens to execute it.

And the tree's text names no internal issue numbers: a reader of the
repository cannot look them up, so comments, docstrings, test names and
guides state the reason itself.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from support import REPO

PACKAGE = REPO / "hostpid"
SHARED = {
    "wire", "gate", "peercred", "ucred", "starttime", "defaults", "errors", "logs", "version",
    "values", "boundedhttp", "servicemaker", "fileattr", "pacedport",
}
SIDES = {"broker", "client", "node", "admission", "nri"}
TOP = {"", "cli", "testing", "tap", "allocation"}


@attrs.frozen
class Import:
    module: str  # the importing module
    target: str  # the project module imported (or imported from)
    names: tuple[str, ...]  # names taken from it (empty for a plain import)
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def project_imports(module: str, tree: ast.AST, is_package: bool) -> Iterator[Import]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hostpid":
                    yield Import(module, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "hostpid":
                continue
            plain = []
            for alias in node.names:
                if is_module(f"{base}.{alias.name}"):
                    yield Import(module, f"{base}.{alias.name}", (), node.lineno)
                else:
                    plain.append(alias.name)
            if plain:
                yield Import(module, base, tuple(plain), node.lineno)


def module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to project modules (C{import a.b as c}, C{from a import b})."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hostpid":
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else "hostpid"
                    )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hostpid"):
            for alias in node.names:
                if is_module(f"{node.module}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def is_private(name: str) -> bool:
    return name.startswith("_") and not is_dunder(name)


def package_attribute_uses(module: str, source: str) -> list[str]:
    """
    Below the top, C{hostpid.NAME} after C{import hostpid} may name a
    submodule or a dunder, not the public API (that would import upward).
    """
    if layer(module)[0] == "top":
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "hostpid"
            and not is_dunder(node.attr)
            and not is_module(f"hostpid.{node.attr}")
        ):
            found.append(f"{module}:{node.lineno}: uses hostpid.{node.attr} from below")
    return found


def private_uses(module: str, source: str) -> list[str]:
    """Every use in C{source} of a private name of another project module."""
    tree = ast.parse(source)
    found = []
    for item in project_imports(module, tree, is_package=False):
        if item.target != module and any(is_private(part) for part in item.target.split(".")):
            found.append(f"{module}:{item.line}: imports private module {item.target}")
        for name in item.names:
            if is_private(name) and item.target != module:
                found.append(f"{module}:{item.line}: imports {item.target}.{name}")
    aliases = module_aliases(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != module
            and is_private(node.attr)
        ):
            found.append(
                f"{module}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}"
            )
    return found


def layer(module: str) -> tuple[str, str]:
    """(layer, which): C{("shared", "wire")}, C{("side", "broker")}, C{("top", "cli")}."""
    parts = module.split(".")[1:]
    head = parts[0] if parts else ""
    if head in SHARED:
        return "shared", head
    if head in SIDES:
        return "side", head
    if head in TOP:
        return "top", head
    raise AssertionError(f"{module}: not in any layer; add it to tests/test_layout.py")


#: Known edges across sides, each with its reason.  Keep this short: an edge
#: here is a design decision someone has to be able to defend.
ALLOWED: set[tuple[str, str]] = {
    # The webhook gives a pod exactly what an allocation gets: the same
    # canonical mounts and the same CDI device name, never a copy of them.
    ("hostpid.admission.decision", "hostpid.node.allocation"),
    ("hostpid.admission.decision", "hostpid.node.cdi"),
    # The NRI plugin likewise gives a container the allocation's own mounts.
    ("hostpid.nri.decision", "hostpid.node.allocation"),
    # ...checks and repairs the broker mountpoint by the allocation's own code
    # (a copy of a descriptor-by-descriptor repair would drift from it)...
    ("hostpid.nri.hostcheck", "hostpid.node.lockparent"),
    # ...and bounds its log fields by the webhook's rule: one clip, not two.
    ("hostpid.nri.service", "hostpid.admission.decision"),
}


def layering_problem(item: Import) -> str | None:
    if (item.module, item.target) in ALLOWED:
        return None
    here, there = layer(item.module), layer(item.target)
    where = f"{item.module}:{item.line}: imports {item.target}"
    if item.target == "hostpid":
        # Every import loads the package; below the top only its dunders
        # (the version) may be taken from it, never the public API.
        if here[0] == "top" or all(is_dunder(name) for name in item.names):
            return None
        return f"{where}: takes {', '.join(item.names)} (the public API) from below"
    if here == ("shared", "values"):
        return f"{where}: values imports nothing of the project"
    if here == ("shared", "wire") and item.target != "hostpid.values":
        return f"{where}: wire imports nothing of the project but its value base class"
    if here[0] == "shared" and there[0] != "shared":
        return f"{where}: a shared module imports upward"
    if here[0] == "side" and there[0] == "side" and here[1] != there[1]:
        return f"{where}: one side imports another"
    if here[0] == "side" and there[0] == "top":
        return f"{where}: a side imports upward"
    if here[0] == "top" and there[0] == "top" and here[1] != there[1] and here[1]:
        return f"{where}: {here[1]} and {there[1]} are independent"
    if here == ("top", "") and there[0] == "top" and there[1]:
        return f"{where}: the public API does not depend on {there[1]}"
    return None


def sources() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield module_name(path), path


def test_no_module_imports_another_modules_private_names() -> None:
    found = [
        problem
        for module, path in sources()
        for problem in private_uses(module, path.read_text())
    ]
    assert found == []


def test_imports_only_go_downward() -> None:
    found = []
    for module, path in sources():
        tree = ast.parse(path.read_text())
        for item in project_imports(module, tree, path.name == "__init__.py"):
            problem = layering_problem(item)
            if problem:
                found.append(problem)
        found.extend(package_attribute_uses(module, path.read_text()))
    assert found == []


def test_every_module_is_in_a_layer() -> None:
    for module, _ in sources():
        layer(module)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "hostpid.client.txclient",
            "from hostpid.client.blocking import FIRST_BACKOFF, _new_socket\n",
            ["hostpid.client.txclient:1: imports hostpid.client.blocking._new_socket"],
        ),
        (
            "hostpid.cli",
            "from hostpid.client import blocking\nblocking._BlockingConnection(1)\n",
            ["hostpid.cli:2: uses hostpid.client.blocking._BlockingConnection"],
        ),
        (
            "hostpid.cli",
            "import hostpid.broker.service as s\ns._release\n",
            ["hostpid.cli:2: uses hostpid.broker.service._release"],
        ),
        ("hostpid.broker.metrics", "import hostpid\nhostpid.__version__\n", []),
    ],
)
def test_the_private_name_check_finds_them(
    module: str, source: str, expected: list[str]
) -> None:
    assert private_uses(module, source) == expected


@pytest.mark.parametrize(
    ("module", "target", "bad"),
    [
        ("hostpid.wire", "hostpid.defaults", True),
        ("hostpid.gate", "hostpid.client.trust", True),
        ("hostpid.broker.server", "hostpid.client.trust", True),
        ("hostpid.node.allocation", "hostpid.broker.fsrules", True),
        ("hostpid.client.blocking", "hostpid.testing", True),
        ("hostpid.testing", "hostpid.cli", True),
        ("hostpid.cli", "hostpid.testing", True),
        ("hostpid", "hostpid.cli", True),
        ("hostpid.client.txclient", "hostpid.client.connect", False),
        ("hostpid.broker.service", "hostpid.peercred", False),
        ("hostpid.testing", "hostpid.client.trust", False),
        ("hostpid", "hostpid.broker.service", False),
    ],
)
def test_the_layering_check_finds_them(module: str, target: str, bad: bool) -> None:
    problem = layering_problem(Import(module, target, (), 1))
    assert (problem is not None) == bad, problem


def test_the_public_api_is_not_taken_from_below() -> None:
    version = Import("hostpid.broker.metrics", "hostpid", ("__version__",), 1)
    assert layering_problem(version) is None
    assert layering_problem(Import("hostpid.node.allocation", "hostpid", ("TrustPolicy",), 1))
    assert layering_problem(Import("hostpid.cli", "hostpid", ("TrustPolicy",), 1)) is None
    source = "import hostpid\nhostpid.__version__\nhostpid.wire.MAGIC\nhostpid.TrustPolicy()\n"
    assert package_attribute_uses("hostpid.broker.metrics", source) == [
        "hostpid.broker.metrics:4: uses hostpid.TrustPolicy from below"
    ]


# --- No internal issue numbers in the tree. ---

#: A reference to an issue by its number: the word and a number, or a hash
#: and two digits or more.
ISSUE_NUMBER = re.compile(r"\bissue ?#?[0-9]+|#[0-9]{2}\b", re.IGNORECASE)

#: What is searched: the code, its tests, the tools and the documentation.
SEARCHED = ("hostpid", "tests", "twisted", "bench", "deploy", "docs", "native", ".ci")
SEARCHED_FILES = ("README.md", "CHANGELOG.md", "setup.py", "setup.cfg", "pyproject.toml", "tox.ini")

#: Generated benchmark reports are kept exactly as the tools wrote them.
NOT_SEARCHED = (REPO / "bench" / "reports",)


def searched_files() -> Iterator[Path]:
    for name in SEARCHED_FILES:
        if (REPO / name).is_file():
            yield REPO / name
    for top in SEARCHED:
        for path in sorted((REPO / top).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if any(path.is_relative_to(skipped) for skipped in NOT_SEARCHED):
                continue
            yield path


def issue_references(text: str) -> list[str]:
    return [match.group(0) for match in ISSUE_NUMBER.finditer(text)]


def test_no_internal_issue_numbers_in_the_tree() -> None:
    found = []
    searched = 0
    for path in searched_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary file (a plot, a built helper)
        searched += 1
        for number, line in enumerate(text.splitlines(), 1):
            for reference in issue_references(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {reference!r}: {line.strip()}")
    assert searched > 100, "the walk found the tree"
    assert found == [], "state the reason instead of the issue number:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("(" + "issue" + " 12 item 4)", ["issue" + " 12"]),
        ("Is" + "sue 19: a flood", ["Is" + "sue 19"]),
        ("see " + "issue" + "#7", ["issue" + "#7"]),
        ("fixed in " + "#" + "19.", ["#" + "19"]),
        ("the PR #251 line of HAMi-core; 0x1F; C#; issues remain", []),
    ],
)
def test_the_issue_number_check_finds_them(text: str, found: list[str]) -> None:
    assert issue_references(text) == found
