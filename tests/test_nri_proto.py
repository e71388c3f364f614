"""
The NRI plugin's generated message code is what its C{.proto} files give.

Why each check exists:

- C{hostpid/nri/api_pb2.py} and C{ttrpc_pb2.py} (and their C{.pyi}) are
  checked in; regenerating them with the one command C{api.proto} states
  must give the same bytes, so an edit of a C{.proto} without regenerating
  (or a hand edit of the output) fails here.
- The field numbers and names the wire depends on are NRI's and ttrpc's
  (C{pkg/api/api.proto}, C{request.proto}): the package, the event numbers,
  and the fields the plugin reads and writes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

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
