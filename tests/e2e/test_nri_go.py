"""
The NRI plugin against NRI's own Go code: the runtime side that containerd
and CRI-O link (C{pkg/adaptation}), built from Debian's sources of two NRI
releases (L{nrilib}), listens on a private socket; the plugin connects,
registers, is configured and synchronized; nrigo then sends CreateContainer
requests and prints the merged responses, which the tests compare with
what the plugin must answer.

A control plugin written with NRI's own stub (C{nristub}) runs through the
same driver first, so an empty answer from hostpid's plugin is its answer,
not a driver that never reaches plugins.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from nrigolib import (
    NRI_RELEASES,
    NriPrograms,
    build,
    drive,
    nri_container,
    nri_pod,
)
from support import require_root

pytestmark = pytest.mark.privileged


@pytest.fixture(scope="module", params=sorted(NRI_RELEASES))
def programs(request: pytest.FixtureRequest) -> Iterator[NriPrograms]:
    require_root()
    out = Path(tempfile.mkdtemp(prefix="hostpid-nrigo-"))
    try:
        yield build(NRI_RELEASES[request.param], out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def workdir() -> Iterator[Path]:
    made = Path(tempfile.mkdtemp(prefix="hostpid-nri-go-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def test_control_stub_adjustment_is_reported(programs: NriPrograms, workdir: Path) -> None:
    """NRI's own stub plugin, through NRI's own runtime side: its env reaches the answer."""
    pod = nri_pod("p", str(uuid.uuid4()))
    socket = workdir / "nri.sock"
    driven = drive(programs, [str(programs.nristub), str(socket), "10"], {
        "synchronize": {"pods": [pod], "containers": [nri_container("running", pod)]},
        "cases": [{"pod": pod, "container": nri_container("first", pod)},
                  {"pod": pod, "container": nri_container("second", pod)}],
    }, socket)
    assert driven.answer["synchronized"] and not driven.answer["syncError"]
    assert [driven.adjustment(i).get("env") for i in (0, 1)] == [
        [{"key": "NRISTUB_SEEN", "value": "first"}],
        [{"key": "NRISTUB_SEEN", "value": "second"}],
    ], driven.answer
