"""
The NRI plugin's look at the host (L{hostpid.nri.hostcheck}) on a private
tree, and the plugin's words when the runtime's socket is missing.

Why each check exists:

- A file, a symlink or a tenant's directory at C{<lock parent>/hostpid} is
  repaired by the same code as C{hostpid allocate} (a root directory, 0755;
  the lock parent 01777 again), never followed; a sound one is left alone,
  with nothing written; where preparation refuses the tree, the problem is
  reported, not raised, and nothing changes.
- The L{Adjuster} logs a host problem once per change of state, counts each
  repair, and gives an unsafe mountpoint the lock parent alone.
- No socket at C{--nri-socket}: said once (not at every retry) with how to
  turn NRI on, and again only after a connection succeeded in between.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nrilib import gpu_container, pod
from support import require_root
from twisted.internet import defer
from twisted.internet.error import ConnectError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactor
from twisted.logger import capturedLogs

from hostpid.nri import api_pb2
from hostpid.nri.decision import Config
from hostpid.nri.hostcheck import HostCheck
from hostpid.nri.service import Adjuster, NRIMetrics
from hostpid.nri.tap import SocketEndpoint


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    require_root()
    (tmp_path / "tmp").mkdir(mode=0o755)
    (tmp_path / "tmp" / "vgpulock").mkdir(mode=0o1777)
    os.chmod(tmp_path / "tmp" / "vgpulock", 0o1777)
    (tmp_path / "broker").mkdir()
    return tmp_path


def check(tree: Path) -> HostCheck:
    return HostCheck(str(tree / "tmp" / "vgpulock"), str(tree / "broker"))


@pytest.mark.parametrize("plant", ["file", "symlink", "tenant directory"])
def test_planted_entries_are_repaired(tree: Path, plant: str) -> None:
    lock_parent = tree / "tmp" / "vgpulock"
    entry = lock_parent / "hostpid"
    target = tree / "target"
    target.mkdir()
    if plant == "file":
        entry.write_text("x")
    elif plant == "symlink":
        entry.symlink_to(target)
    else:
        entry.mkdir()
    os.lchown(entry, 1000, 1000)
    os.chmod(lock_parent, 0o777)
    state = check(tree).check()
    assert state.broker_present and not state.mountpoint_problem, state
    assert len(state.repairs) == 1 and state.repairs[0].owner_uid == 1000
    st = os.lstat(entry)
    assert not entry.is_symlink() and st.st_uid == 0 and st.st_mode & 0o7777 == 0o755
    assert os.stat(lock_parent).st_mode & 0o7777 == 0o1777
    assert target.is_dir() and not list(target.iterdir())


def test_sound_mountpoint_is_not_touched(tree: Path) -> None:
    host = check(tree)
    assert host.check().made  # first use: made, not a repair
    calls = []
    host.prepare = lambda *a, **k: calls.append(a)  # type: ignore[assignment,misc]
    state = host.check()
    assert state == type(state)() and calls == []


def test_unrepairable_is_reported_and_left(tree: Path) -> None:
    os.chown(tree / "tmp", 1000, 1000)
    (tree / "tmp" / "vgpulock" / "hostpid").write_text("x")
    state = check(tree).check()
    assert "regular file" in state.mountpoint_problem
    assert "is owned by UID 1000" in state.repair_failure
    assert (tree / "tmp" / "vgpulock" / "hostpid").read_text() == "x"
    missing = HostCheck(str(tree / "nowhere"), str(tree / "broker")).check()
    assert missing.missing == (str(tree / "nowhere"),) and not missing.broker_present


def test_adjuster_logs_each_change_once_and_counts_repairs(tree: Path) -> None:
    lock_parent = tree / "tmp" / "vgpulock"
    config = Config(gate=True, lock_parent=str(lock_parent), broker_dir=str(tree / "broker"))
    metrics = NRIMetrics()
    adjuster = Adjuster(config, metrics)
    request = api_pb2.CreateContainerRequest(pod=pod(), container=gpu_container())
    os.chown(tree / "tmp", 1000, 1000)  # no repair possible
    (lock_parent / "hostpid").write_text("x")
    with capturedLogs() as events:
        for _ in range(3):
            adjustment = adjuster.adjust(request)
            assert [m.destination for m in adjustment.mounts] == ["/tmp/vgpulock"]
        os.chown(tree / "tmp", 0, 0)
        assert len(adjuster.adjust(request).mounts) == 2
    texts = [e["log_format"] for e in events]
    assert sum("cannot be repaired" in t for t in texts) == 1, texts
    assert sum("repaired the broker mountpoint" in t for t in texts) == 1, texts
    assert sum("sound again" in t for t in texts) == 1, texts
    assert metrics.registry.get_sample_value("hostpid_nri_mountpoint_repairs_total") == 1
    assert metrics.registry.get_sample_value(
        "hostpid_nri_containers_total", {"reason": "mountpoint_unsafe"}) == 3


class Failing:
    def __init__(self) -> None:
        self.fail = True

    def connect(self, factory: object) -> defer.Deferred[Protocol]:
        if self.fail:
            return defer.fail(ConnectError("no such file"))
        return defer.succeed(Protocol())


def test_missing_socket_is_said_once_until_connected(tmp_path: Path) -> None:
    endpoint = SocketEndpoint(MemoryReactor(), str(tmp_path / "nri.sock"))
    inner = Failing()
    endpoint._endpoint = inner  # type: ignore[assignment]

    def attempt() -> None:
        endpoint.connect(Factory()).addErrback(lambda f: None)

    with capturedLogs() as events:
        for _ in range(3):
            attempt()
        inner.fail = False
        attempt()
        inner.fail = True
        attempt()
    said = [e for e in events if "no NRI socket" in e["log_format"]]
    assert len(said) == 2, events
    assert 'io.containerd.nri.v1.nri' in said[0]["hint"] and "enable_nri" in said[0]["hint"]
