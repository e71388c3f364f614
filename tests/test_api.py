"""
The public API: C{hostpid} exports the contract's names (and the few more
its documentation uses), importing it stays light, and C{docs/api.md}
documents every public name with the parameters it really takes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from typing import Any

import pytest
from support import REPO, subprocess_env

import hostpid

API_DOC = REPO / "docs" / "api.md"

#: The contract's names (contract.md, "Python API").
CONTRACT = {
    "query_host_pid", "query_host_pid_deferred", "lookup_host_pid", "TrustPolicy",
    "HostPidUnavailable", "BrokerService",
}

#: Exported besides the contract's names, because api.md's own signatures and
#: the client guide's examples use them.
EXTRA = {"STRICT", "CheckResult", "doctor", "lookup_host_pid_deferred"}

HEADING = re.compile(r"^### `(?P<name>hostpid(?:\.\w+)+)\((?P<params>.*?)\)(?: -> [^`]+)?`$", re.M)


def documented() -> dict[str, tuple[str, str]]:
    """Each documented name: its parameters as written, and its section's text."""
    text = API_DOC.read_text()
    found = list(HEADING.finditer(text))
    sections = {}
    for index, match in enumerate(found):
        end = found[index + 1].start() if index + 1 < len(found) else len(text)
        sections[match["name"]] = (match["params"], text[match.end() : end])
    return sections


def resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_exports_the_contract_and_what_the_docs_use() -> None:
    assert set(hostpid.__all__) == CONTRACT | EXTRA
    namespace: dict[str, object] = {}
    exec("from hostpid import *", namespace)
    assert set(namespace) - {"__builtins__"} == CONTRACT | EXTRA
    assert set(hostpid.__all__) <= set(dir(hostpid))


def test_the_names_are_the_implementations() -> None:
    from hostpid.broker.service import BrokerService
    from hostpid.client import blocking, trust, txclient

    assert hostpid.query_host_pid is blocking.query_host_pid
    assert hostpid.lookup_host_pid is blocking.lookup_host_pid
    assert hostpid.query_host_pid_deferred is txclient.query_host_pid_deferred
    assert hostpid.TrustPolicy is trust.TrustPolicy
    assert hostpid.HostPidUnavailable is trust.HostPidUnavailable
    assert hostpid.BrokerService is BrokerService
    assert hostpid.STRICT is trust.STRICT
    assert hostpid.CheckResult is trust.CheckResult
    assert hostpid.doctor is blocking.doctor
    assert hostpid.lookup_host_pid_deferred is txclient.lookup_host_pid_deferred


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        hostpid.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_importing_hostpid_is_light_and_installs_no_reactor() -> None:
    code = (
        "import sys\n"
        "import hostpid\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('hostpid.'))\n"
        "assert loaded == [], loaded\n"
        "assert 'twisted.internet.reactor' not in sys.modules\n"
        "for name in hostpid.__all__:\n"
        "    getattr(hostpid, name)\n"
        "for module in hostpid.PUBLIC_MODULES:\n"
        "    __import__(module)\n"
        "assert 'twisted.internet.reactor' not in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr


def test_every_public_name_is_documented() -> None:
    names = documented()
    # Constants (STRICT) are named in the text; callables have a heading each.
    assert {f"hostpid.{name}" for name in hostpid.__all__ if not name.isupper()} <= set(names)
    assert "`hostpid.STRICT`" in API_DOC.read_text()
    for module in hostpid.PUBLIC_MODULES:
        public = importlib.import_module(module).__all__
        wanted = {f"{module}.{name}" for name in public if not name.isupper()}
        assert wanted <= set(names), wanted - set(names)
    assert "hostpid.testing.FakeBroker" in names


@pytest.mark.parametrize("name", sorted(documented()))
def test_documented_name_exists_with_those_parameters(name: str) -> None:
    params, section = documented()[name]
    target = resolve(name)
    module, _, short = name.rpartition(".")
    if module == "hostpid":
        assert short in hostpid.__all__, f"{name} is documented but not exported"
    else:
        assert short in importlib.import_module(module).__all__
    # The heading's parameters, read as a function definition's (so a bare
    # "*" marks keyword-only parameters, as in Python).
    definition = ast.parse(f"def f({params}): pass").body[0]
    assert isinstance(definition, ast.FunctionDef)
    arguments = definition.args
    written = [arg.arg for arg in (*arguments.args, *arguments.kwonlyargs)]
    signature = inspect.signature(target)
    assert written == list(signature.parameters), f"{name}: parameters as documented"
    keyword_only = [arg.arg for arg in arguments.kwonlyargs]
    assert keyword_only == [
        parameter.name for parameter in signature.parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ], f"{name}: keyword-only parameters as documented"
    namespace = vars(sys.modules[inspect.unwrap(target).__module__])
    positional = arguments.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults))
    defaults += arguments.defaults
    pairs = [*zip(positional, defaults, strict=True),
             *zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)]
    for arg, default in pairs:
        parameter = signature.parameters[arg.arg]
        if default is None:
            assert parameter.default is inspect.Parameter.empty, (name, arg.arg)
        else:
            wanted = eval(compile(ast.Expression(default), name, "eval"), dict(namespace))
            assert parameter.default == wanted, (name, arg.arg)
    assert "- Raises:" in section, f"{name}: say what it raises"
    assert "- Threads and fork:" in section, f"{name}: say whether threads and fork are safe"
