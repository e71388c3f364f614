"""
The NRI plugin's generated message code is what its C{.proto} files give.

Why each check exists:

- C{hostpid/nri/api_pb2.py} and C{ttrpc_pb2.py} (and their C{.pyi}) are
  checked in; regenerating them with the one command C{api.proto} states
  must give the same bytes, so an edit of a C{.proto} without regenerating
  (or a hand edit of the output) fails here.
- The generated code is of protobuf's previous major (6), so that the
  C{nri} extra's C{protobuf>=6.30.0,<8} lets it sit beside an agent pinned to 6
  (opentelemetry-proto 1.42): gencode of major V runs on runtimes V and V+1.
  C{setup.cfg}'s C{nri} extra (and the test extra, which runs the plugin's
  tests) requires exactly the range L{hostpid.nri} checks, the base install
  requires no protobuf at all, and a missing or too old runtime makes
  C{twistd hostpid-nri} say in one line which extra to install.
- The field numbers and names the wire depends on are NRI's and ttrpc's
  (C{pkg/api/api.proto}, C{request.proto}): the package, the event numbers,
  and the fields the plugin reads and writes.
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

from hostpid import nri
from hostpid.nri import api_pb2, ttrpc_pb2

GENERATED = ["api_pb2.py", "api_pb2.pyi", "ttrpc_pb2.py", "ttrpc_pb2.pyi"]


def test_generated_code_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    tree = tmp_path / "hostpid" / "nri"
    tree.mkdir(parents=True)
    for name in ("api.proto", "ttrpc.proto"):
        shutil.copy(REPO / "hostpid" / "nri" / name, tree / name)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
                    "--pyi_out=.", "hostpid/nri/api.proto", "hostpid/nri/ttrpc.proto"],
                   cwd=tmp_path, check=True, timeout=60)
    for name in GENERATED:
        assert (tree / name).read_bytes() == (REPO / "hostpid" / "nri" / name).read_bytes(), (
            f"{name} is stale: run the command in hostpid/nri/api.proto")


def test_gencode_is_the_previous_major_and_the_install_allows_both() -> None:
    for name in ("api_pb2.py", "ttrpc_pb2.py"):
        text = (REPO / "hostpid" / "nri" / name).read_text()
        (version,) = re.findall(r"^# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)$", text,
                                re.MULTILINE)
        assert tuple(map(int, version)) == nri.PROTOBUF_OLDEST, name
    assert nri.PROTOBUF_OLDEST[0] + 2 == nri.PROTOBUF_NEXT_MAJOR
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")

    def protobuf(requirements: str) -> list[str]:
        return [line.strip() for line in requirements.splitlines()
                if line.strip().startswith("protobuf")]

    assert protobuf(config["options"]["install_requires"]) == []
    extras = config["options.extras_require"]
    assert protobuf(extras[nri.EXTRA]) == [nri.PROTOBUF_REQUIREMENT]
    assert protobuf(extras["test"]) == [nri.PROTOBUF_REQUIREMENT]


@pytest.mark.parametrize(("version", "fits"), [
    (None, False), ((5, 29, 3), False), ((6, 29, 9), False), ((6, 30, 0), True),
    ((6, 33, 6), True), ((7, 36, 2), True), ((8, 0, 0), False)])
def test_protobuf_problem(version: tuple[int, int, int] | None, fits: bool) -> None:
    problem = nri.protobuf_problem(version)
    assert (problem is None) == fits
    if problem is not None:
        assert f"pip install '{nri.PROTOBUF_REQUIREMENT}'" in problem


def test_twistd_names_the_extra_when_protobuf_is_missing() -> None:
    # The plugin's environment without protobuf (the base install, without
    # the nri extra): twistd says in one line which extra to install, instead
    # of a traceback (tests/test_install.py does it in a real install).
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['google.protobuf'] = None\n"
         "from twisted.scripts.twistd import run\n"
         "sys.argv = ['twistd', 'hostpid-nri', '--help']\nrun()"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "twistd hostpid-nri: " + nri.protobuf_problem(None)], done.stderr
    assert f"'{nri.EXTRA}' extra" in done.stderr


def field(message: type, name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number  # type: ignore[attr-defined]


def test_wire_names_and_numbers() -> None:
    assert api_pb2.DESCRIPTOR.package == "nri.pkg.api.v1alpha1"
    assert ttrpc_pb2.DESCRIPTOR.package == "ttrpc"
    assert api_pb2.CREATE_CONTAINER == 4 and api_pb2.LAST == 15
    assert field(api_pb2.ConfigureResponse, "events") == 2
    assert field(api_pb2.SynchronizeResponse, "more") == 2
    assert field(api_pb2.Container, "CDI_devices") == 20
    assert field(api_pb2.Container, "linux") == 11
    assert field(api_pb2.LinuxContainer, "devices") == 2
    assert field(api_pb2.ContainerAdjustment, "mounts") == 3
    assert field(api_pb2.ContainerAdjustment, "env") == 4
    assert field(ttrpc_pb2.Request, "timeout_nano") == 4
    assert field(ttrpc_pb2.Response, "payload") == 2


def test_unknown_fields_are_kept_not_misread() -> None:
    # A runtime's Container with fields this plugin does not declare (state,
    # hooks, rlimits, user): parsed, ignored, the known ones intact.
    extra = (b"\x20\x03"  # state = 3 (field 4, varint)
             b"\x6a\x04\x08\x01\x10\x02"  # rlimits (field 13, bytes)
             b"\xaa\x01\x02\x08\x07")  # user (field 21, bytes)
    known = api_pb2.Container(name="c", env=["A=B"]).SerializeToString()
    parsed = api_pb2.Container.FromString(known + extra)
    assert (parsed.name, list(parsed.env)) == ("c", ["A=B"])
