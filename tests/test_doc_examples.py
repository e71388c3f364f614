"""
The examples in C{README.md} and C{docs/*.md} are true: each shell and
Python example runs on this machine, as written, and passes.

The rules (a doc that breaks one fails CI):

- Every code block is fenced and names its language.  C{sh}, C{bash},
  C{shell} and C{python} blocks are examples; C{text} (output, synopses),
  C{ini}, C{yaml}, C{json}, C{go}, C{c}, C{promql} and the like are shown,
  never run.  An indented code block or a fence with no language could hide a
  command that is never tried, so neither is allowed.
- An example that cannot run here (it needs a cluster, systemd, a GPU node, a
  registry, a running production broker, or runs until stopped) says so on
  the line right before its fence: C{<!-- not-runnable: REASON -->}, with a
  reason.  L{test_not_runnable_examples_say_why} lists them all (run pytest
  with C{-rP}, or read the C{not_runnable} property in a junit report).
- Every other example runs in a scratch directory with a time limit: shell
  with C{bash -euo pipefail}, Python with this interpreter, both with the
  working tree first on C{PYTHONPATH} and this environment's C{bin} (its
  C{hostpid} and C{twistd}) first on C{PATH}, and must exit 0.  They run as
  root, as the docs' examples say they do (CI is root), in a private mount
  namespace whose C{/tmp} and C{/run} are fresh tmpfs mounts
  (C{privatetmp.py}): an example on the default paths (C{/tmp/vgpulock},
  C{/var/run/cdi}) runs as written and the host's are never touched.

The README's first two commands are marked (one runs a foreground server, the
other the whole suite) and tested here otherwise: the test command is what
C{.ci/run} runs, verbatim; the run command's C{twistd} line is run with a
private C{--directory} and must serve; and the README's check of a running
broker (C{hostpid probe}) is run against that broker,
from an environment without the gate, and must pass.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from markdown_it import MarkdownIt
from support import (
    REPO,
    WAIT_SECONDS,
    ask_pid,
    private_tmp,
    subprocess_env,
    wait_for,
)

#: Languages whose blocks are examples, and how each is run.
RUNNABLE = {"sh": "shell", "bash": "shell", "shell": "shell", "python": "python"}
#: Languages shown, never run.
SHOWN = frozenset({"text", "ini", "yaml", "json", "go", "c", "promql", "diff", "toml"})
MARKER = re.compile(r"<!--\s*not-runnable:(.*?)-->")
#: Seconds one example may take.
EXAMPLE_TIMEOUT = 120


def documents() -> list[Path]:
    """Whatever docs exist when the suite runs (others are added over time)."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@attrs.frozen
class Block:
    path: Path
    line: int
    language: str
    code: str
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of C{path}, and every breach of the rules above."""
    text = path.read_text()
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    for token in MarkdownIt("commonmark").parse(text):
        if token.type not in ("fence", "code_block") or token.map is None:
            continue
        first = token.map[0]
        where = f"{path.relative_to(REPO)}:{first + 1}"
        if token.type == "code_block":
            problems.append(f"{where}: an indented code block: fence it and name its language")
            continue
        language = token.info.split()[0] if token.info.strip() else ""
        previous = lines[first - 1].strip() if first > 0 else ""
        marked = MARKER.fullmatch(previous)
        reason = marked.group(1).strip() if marked else None
        if not language:
            problems.append(
                f"{where}: a fence with no language (sh or python for an example, text "
                "for output or a synopsis)"
            )
        elif language not in RUNNABLE and language not in SHOWN:
            problems.append(f"{where}: language {language!r} is neither an example nor shown")
        elif language in SHOWN and marked:
            problems.append(f"{where}: a {language} block is never run: drop the marker")
        blocks.append(Block(path, first + 1, language, token.content, reason))
    return blocks, problems


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in parse(path)[0]]


def examples() -> list[Block]:
    return [block for block in all_blocks() if block.language in RUNNABLE]


def runnable() -> list[Block]:
    return [block for block in examples() if block.reason is None]


def not_runnable() -> list[Block]:
    return [block for block in examples() if block.reason is not None]


def test_every_code_block_declares_itself() -> None:
    problems = [problem for path in documents() for problem in parse(path)[1]]
    assert problems == [], "\n".join(problems)


def test_not_runnable_examples_say_why(record_property: pytest.RecordProperty) -> None:
    marked = not_runnable()
    listing = [f"{block.where} [{block.language}]: {block.reason}" for block in marked]
    record_property("not_runnable", "\n".join(listing))
    print("examples not run here, and why:", *listing, sep="\n  ")
    assert marked, "the README's two commands at least are marked"
    assert all(block.reason for block in marked), "\n".join(listing)


def test_there_are_examples_to_run() -> None:
    """The parametrized test below would pass vacuously on an empty list."""
    assert len(runnable()) >= 3, [block.where for block in runnable()]


def environment(scratch: Path) -> dict[str, str]:
    """The working tree first on PYTHONPATH; this environment's bin first on PATH."""
    env = subprocess_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("LIBVGPU_HOSTPID_BROKER", None)
    env["HOME"] = str(scratch)
    env["TMPDIR"] = str(scratch)
    return env


@pytest.mark.parametrize("block", runnable(), ids=lambda block: block.where)
def test_example_runs_as_written(block: Block, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if RUNNABLE[block.language] == "shell":
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        script = scratch / "example.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    with private_tmp(keep=[scratch], private_run=True) as prefix:
        done = subprocess.run(
            [*prefix, *argv],
            cwd=scratch, env=environment(scratch), capture_output=True, text=True,
            timeout=EXAMPLE_TIMEOUT, stdin=subprocess.DEVNULL,
        )
    assert done.returncode == 0, (
        f"{block.where} exited {done.returncode}\n--- stdout\n{done.stdout}"
        f"--- stderr\n{done.stderr}"
    )


# --- The README's two commands. ---


def readme_examples() -> list[str]:
    blocks, _ = parse(REPO / "README.md")
    return [block.code.strip() for block in blocks if block.language in RUNNABLE]


def readme_commands() -> tuple[str, str]:
    """The README's run command (its first example) and test command (the one running pytest)."""
    commands = readme_examples()
    (test_command,) = [command for command in commands if "-m pytest" in command]
    return commands[0], test_command


def readme_check_command() -> str:
    """The README's check that the broker works (C{hostpid probe})."""
    (check,) = [command for command in readme_examples() if " probe" in command]
    assert check.startswith(".venv/bin/hostpid probe"), check
    return check


def test_readme_test_command_is_what_ci_runs() -> None:
    _, test_command = readme_commands()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, ".ci/run must run the README's test command verbatim"
    assert ci[ci.index(test_command) - 1] == "# The README's test command, verbatim:"


@pytest.fixture
def private_directory(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "hostpid"


def test_readme_run_command_serves(private_directory: Path) -> None:
    """
    The run command is C{venv && install && twistd ...}: the first two are
    the test command's (which CI runs); the third, run from this environment
    with a private C{--directory}, serves, and stops on SIGTERM as documented.
    """
    run_command, test_command = readme_commands()
    venv, install, broker = run_command.split(" && ")
    assert venv == test_command.split(" && ")[0] == "python3 -m venv .venv"
    assert install == ".venv/bin/python -m pip install ."
    assert broker.startswith("LIBVGPU_HOSTPID_BROKER=1 .venv/bin/twistd ")
    here = broker.replace(".venv/bin/twistd", str(Path(sys.executable).parent / "twistd"), 1)
    command = f"exec env {here} --directory {private_directory}"
    env = environment(private_directory.parent)
    process = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", command], env=env, cwd=private_directory.parent,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        socket_path = private_directory / "broker.sock"

        def serving() -> bool:
            assert process.poll() is None, process.communicate()[0]
            try:
                return ask_pid(socket_path) == os.getpid()
            except OSError:
                return False

        wait_for(serving, f"the README's broker at {socket_path}")
        # The README's check, from a shell without the gate (environment() removes it),
        # pointed at this broker: exit 0, the probe's own PID, the gate it saw.
        check = readme_check_command().replace(
            ".venv/bin/hostpid", str(Path(sys.executable).parent / "hostpid"), 1)
        checked = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", f"{check} --socket {socket_path}"],
            env=env, cwd=private_directory.parent, capture_output=True, text=True,
            timeout=EXAMPLE_TIMEOUT, stdin=subprocess.DEVNULL,
        )
        assert checked.returncode == 0, checked.stderr
        assert re.fullmatch(
            rf"{re.escape(str(socket_path))}: ok: answered PID \d+ \(this process\); "
            r"socket, uid \d+, mode 0666; gate here: LIBVGPU_HOSTPID_BROKER unset "
            r"\(information only: a workload asks only with '1'\)\n",
            checked.stdout,
        ), checked.stdout
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=WAIT_SECONDS)
        assert process.returncode == -signal.SIGTERM, output
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert not socket_path.exists()


# --- Every example imports only public names. ---


#: The example files shipped beside the guides (Python, whatever the suffix).
EXAMPLE_FILES = ("*.py", "*.tac")

#: An import statement of this package inside any code block that is not
#: Python (a C{python3 -c '...'} in a shell block, a Pod's command in YAML).
EMBEDDED_IMPORT = re.compile(
    r"\bfrom\s+(hostpid(?:\.\w+)*)\s+import\s+\(?([\w\s,]+?)\)?\s*(?:;|'|\"|$)"
    r"|\bimport\s+(hostpid(?:\.\w+)*)",
    re.M,
)


def example_files() -> list[Path]:
    return sorted(
        path for pattern in EXAMPLE_FILES for path in (REPO / "docs" / "examples").rglob(pattern)
    )


def public_names(module: str) -> frozenset[str] | None:
    """
    The names C{module} makes public (C{hostpid.__all__} is the source of
    truth for the package and names its other public modules), or C{None}
    when the module itself is internal.
    """
    import importlib

    import hostpid

    if module != "hostpid" and module not in hostpid.PUBLIC_MODULES:
        return None
    return frozenset(importlib.import_module(module).__all__)


def import_problems(code: str, where: str) -> list[str]:
    """Each import in C{code} of a module or name of this package that is not public."""
    import ast

    problems: list[str] = []

    def check(module: str, names: list[str], line: int) -> None:
        public = public_names(module)
        if public is None:
            problems.append(f"{where}+{line}: imports the internal module {module}")
            return
        for name in names:
            if name == "*":
                continue
            if name in public:
                continue
            # "from hostpid import testing" imports a public module.
            if f"{module}.{name}" in __import__("hostpid").PUBLIC_MODULES:
                continue
            problems.append(f"{where}+{line}: {module}.{name} is not a public name")

    def check_attributes(tree: ast.AST, aliases: dict[str, str]) -> None:
        """C{hostpid.NAME} used through an imported module must be public too."""
        inner = {
            id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            parts: list[str] = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in aliases:
                continue
            dotted = ".".join([aliases[value.id], *parts])
            module, name = aliases[value.id], parts[0]
            for index in range(len(parts) - 1, 0, -1):
                candidate = ".".join([aliases[value.id], *parts[:index]])
                if candidate in __import__("hostpid").PUBLIC_MODULES:
                    module, name = candidate, parts[index]
                    break
            public = public_names(module)
            if public is None or name not in public:
                problems.append(f"{where}+{node.lineno}: {dotted} is not a public name")

    try:
        tree = ast.parse(code)
    except SyntaxError:
        tree = None
    if tree is not None:
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "hostpid":
                    check(node.module, [alias.name for alias in node.names], node.lineno)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "hostpid":
                        continue
                    if public_names(alias.name) is None:
                        problems.append(
                            f"{where}+{node.lineno}: imports the internal module {alias.name}")
                    elif alias.asname or "." not in alias.name:
                        aliases[alias.asname or alias.name] = alias.name
        check_attributes(tree, aliases)
        return problems
    for match in EMBEDDED_IMPORT.finditer(code):
        line = code.count("\n", 0, match.start()) + 1
        if match.group(1):
            names = [name.strip() for name in match.group(2).split(",") if name.strip()]
            check(match.group(1), [name.split()[0] for name in names], line)
        elif public_names(match.group(3)) is None:
            problems.append(f"{where}+{line}: imports the internal module {match.group(3)}")
    return problems


def test_examples_import_only_public_names() -> None:
    """
    The README, the guides and the example files use only the public API
    (C{docs/api.md}): an example that imports an internal module, or a name
    a public module does not list in its C{__all__}, teaches readers to
    depend on what may change.
    """
    problems: list[str] = []
    for block in all_blocks():
        problems += import_problems(block.code, block.where)
    files = example_files()
    for path in files:
        problems += import_problems(path.read_text(), str(path.relative_to(REPO)))
    assert files, "docs/examples/ has example files to check"
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import hostpid\nhostpid.query_host_pid()\n", []),
        ("from hostpid.testing import Delay, FakeBroker, Reply\n", []),
        ("from hostpid.client.blocking import query_host_pid\n",
         ["x+1: imports the internal module hostpid.client.blocking"]),
        ("from hostpid import no_such_name\n", ["x+1: hostpid.no_such_name is not a public name"]),
        ("import hostpid\nhostpid.client.blocking.doctor()\n",
         ["x+2: hostpid.client.blocking.doctor is not a public name"]),
        ("import hostpid.node.allocation\n",
         ["x+1: imports the internal module hostpid.node.allocation"]),
        ("python3 -c 'from hostpid.gate import gate_enabled; print(1)'\n",
         ["x+1: imports the internal module hostpid.gate"]),
        ("python3 -c 'import hostpid; print(hostpid.query_host_pid())'\n", []),
    ],
)
def test_the_import_check_finds_what_it_should(code: str, expected: list[str]) -> None:
    """The check above is not vacuous: each kind of breach is reported."""
    assert import_problems(code, "x") == expected
