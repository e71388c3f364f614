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

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from kernelfeatures import kernel_feature
from nrilib import gpu_container, pod
from support import require_root, require_tool, subprocess_env
from test_lockparent import WORKLOAD_UID, run_as
from twisted.internet import defer
from twisted.internet.error import ConnectError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactor
from twisted.logger import capturedLogs

from hostpid.node import renameat
from hostpid.nri import api_pb2
from hostpid.nri.decision import Config
from hostpid.nri.hostcheck import HostCheck
from hostpid.nri.service import Adjuster, NRIMetrics
from hostpid.nri.tap import SocketEndpoint

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = kernel_feature("immutable_tmp")


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
    assert state == type(state)(immutable=True) and calls == []


def test_mountpoint_writable_by_others_is_not_sound(tree: Path) -> None:
    """
    A root-owned mountpoint of mode 0777 (left by root, or by an older
    preparation) is not sound: another user could put entries in it, below
    the broker mount's source.  It is restored to 0755, and counted.
    """
    entry = tree / "tmp" / "vgpulock" / "hostpid"
    entry.mkdir()
    os.chmod(entry, 0o777)
    state = check(tree).check()
    assert [(r.found, r.mode, r.action) for r in state.repairs] == [
        ("directory", 0o777, "mode restored")], state
    assert os.stat(entry).st_mode & 0o7777 == 0o755
    assert state.immutable and not state.mountpoint_problem


@pytest.fixture
def public_tree(public_tmp: Path) -> Path:
    """L{tree} where a UID 1000 process can reach the lock parent."""
    require_root()
    (public_tmp / "tmp").mkdir(mode=0o755)
    (public_tmp / "tmp" / "vgpulock").mkdir()
    os.chmod(public_tmp / "tmp" / "vgpulock", 0o1777)
    (public_tmp / "broker").mkdir()
    return public_tmp


def test_a_tenant_cannot_move_the_checked_mountpoint_in_a_0777_lock_parent(
        public_tree: Path) -> None:
    """
    What HAMi's device plugin does on every allocation (the lock parent 0777,
    no sticky bit) between the plugin's look and the runtime's mount: a UID
    1000 process then tries to rename the entry away, remove it, rename its
    own entry over it and exchange the two.  The kernel refuses each (the
    entry is immutable), so the entry the plugin checked is the one mounted,
    and a running container's broker mount cannot be detached.
    """
    lock_parent = public_tree / "tmp" / "vgpulock"
    host = HostCheck(str(lock_parent), str(public_tree / "broker"))
    state = host.check()
    assert not state.missing and not state.mountpoint_problem, state
    entry = lock_parent / "hostpid"
    before = os.lstat(entry)
    os.chmod(lock_parent, 0o777)

    def tenant() -> None:
        os.symlink("/etc", lock_parent / "planted")
        attempts: dict[str, Callable[[], object]] = {
            "rename away": lambda: os.rename(entry, lock_parent / "moved"),
            "rmdir": lambda: os.rmdir(entry),
            "rename over": lambda: os.rename(lock_parent / "planted", entry),
            "exchange": lambda: renameat.renameat2(
                "planted", "hostpid", dir_fd=os.open(lock_parent, os.O_RDONLY),
                flags=renameat.RENAME_EXCHANGE),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
            except PermissionError:
                continue
            raise AssertionError(f"a UID 1000 tenant could {name} the broker mountpoint")

    run_as(WORKLOAD_UID, tenant)
    after = os.lstat(entry)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert not host.check().mountpoint_problem


#: Run as root without CAP_LINUX_IMMUTABLE (as a chart whose plugin container
#: lacks that one capability): the adjustment of a GPU container, the metric and
#: the readiness reason, as JSON.
WITHOUT_CAPABILITY = """
import json, sys
from nrilib import gpu_container, pod
from hostpid.node import renameat
from hostpid.nri import api_pb2
from hostpid.nri.decision import Config
from hostpid.nri.health import degraded_because, not_ready_because
from hostpid.nri.service import Adjuster, NRIMetrics

lock_parent, broker = sys.argv[1:3]
metrics = NRIMetrics()
adjuster = Adjuster(Config(gate=True, lock_parent=lock_parent, broker_dir=broker), metrics)
adjustment = adjuster.adjust(api_pb2.CreateContainerRequest(pod=pod(), container=gpu_container()))
class Ready:
    ready = True
    socketPath = "nri.sock"
print(json.dumps({
    "mounts": [m.destination for m in adjustment.mounts],
    "env": [e.key for e in adjustment.env],
    "immutable": metrics.registry.get_sample_value("hostpid_nri_mountpoint_immutable"),
    "unsafe": metrics.registry.get_sample_value(
        "hostpid_nri_containers_total", {"reason": "mountpoint_unsafe"}),
    "not_ready": not_ready_because(Ready(), adjuster.look),
    "degraded": degraded_because(adjuster.look),
}))
"""


def test_without_the_capability_the_lock_parent_alone(tree: Path) -> None:
    """
    Where the flag cannot be set (here a plugin without CAP_LINUX_IMMUTABLE;
    on tmpfs before Linux 6.0 the same), a sound-looking root 0755 directory
    is not enough: the device plugin can make the lock parent 0777 at any
    moment.  The container gets the lock parent alone, the metric is 0, and
    the readiness says why, naming the capability, and stays ready: no wait
    repairs a node's missing attribute, and a plugin held out of Ready would
    hold every rollout of its DaemonSet on that node (surge-first) while it
    fails closed all the same.
    """
    setpriv = require_tool("setpriv")
    lock_parent = tree / "tmp" / "vgpulock"
    done = subprocess.run(
        [setpriv, "--bounding-set=-linux_immutable", "--inh-caps=-linux_immutable",
         sys.executable, "-c", WITHOUT_CAPABILITY, str(lock_parent), str(tree / "broker")],
        capture_output=True, text=True, timeout=60, env=subprocess_env(),
        cwd=Path(__file__).parent, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["mounts"] == ["/tmp/vgpulock"] and seen["env"] == [], seen
    assert seen["immutable"] == 0 and seen["unsafe"] == 1, seen
    assert seen["not_ready"] is None, seen
    assert "cannot be made immutable" in seen["degraded"], seen
    assert "CAP_LINUX_IMMUTABLE" in seen["degraded"], seen
    assert (lock_parent / "hostpid").is_dir(), "made, just not trusted for a broker mount"


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
