"""
User-namespaced pods (Kubernetes C{hostUsers: false}) against a real broker.

Each "pod" is made with real system calls (L{tests.usernspod}): a user
namespace mapping 0..65535 to host 100000..165535 written by host root, its
own mount and PID namespaces, and the broker's directory mounted read-only
in it, idmapped with the pod's own mapping (what the kubelet asks for every
volume, and so for a webhook hostPath and a device plugin's mount) or plain
(what a runtime-added NRI mount is unless it asks for C{idmap}).  The
broker is C{twistd hostpid-broker} on a private directory.  The pod's PID 1
runs the real client; the host PID it is told is compared with the PID host
root saw fork return.

One pod of each kind per module run, each about half a second; every test
reads what its pod reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import usernspod
from clienttools import build_c_client
from kernelfeatures import kernel_feature
from support import BrokerProcess, remove_tree, require_root, skip_or_fail, subprocess_env

from hostpid import fileattr

pytestmark = pytest.mark.privileged

IDMAP = pytest.param("idmap", marks=[pytest.mark.kernel, kernel_feature("idmapped_mounts")])
KINDS = [IDMAP, "plain"]
POD_NOBODY = usernspod.POD_BASE + usernspod.NOBODY


@pytest.fixture(scope="module")
def c_client() -> Iterator[Path]:
    """The C contract client, where the pod's root can run it (a 0755 directory)."""
    require_root()
    directory = Path(tempfile.mkdtemp(prefix="hostpid-userns-c-", dir="/tmp"))
    try:
        yield build_c_client(directory)
    finally:
        remove_tree(directory, ignore_errors=True)


def _run_pod(kind: str, c_client: Path, immutable: bool = False) -> dict:
    require_root()
    directory = Path(tempfile.mkdtemp(prefix="hostpid-userns-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        (directory / "mnt" / "hostpid").mkdir(parents=True, mode=0o755)
        (directory / "mnt" / "lock").mkdir(mode=0o755)
        nobody = directory / "nobody"
        nobody.mkdir()
        os.chown(nobody, POD_NOBODY, POD_NOBODY)
        # A lock parent as the allocation side leaves it: root's, 01777,
        # with root's 0755 mountpoint directory in it.
        lock_parent = directory / "lockparent"
        lock_parent.mkdir()
        lock_parent.chmod(0o1777)
        (lock_parent / "hostpid").mkdir(mode=0o755)
        if immutable:
            # As every preparation leaves it now (hostpid.node.lockparent).
            held = os.open(lock_parent / "hostpid", os.O_RDONLY | os.O_DIRECTORY)
            try:
                assert fileattr.set_immutable(held).immutable
            finally:
                os.close(held)
        env = subprocess_env()
        with BrokerProcess(directory / "broker") as broker:
            broker.wait_listening()
            pod = subprocess.Popen(
                [sys.executable, usernspod.__file__, "pod", str(directory), str(c_client)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=env,
            )
            try:
                line = pod.stdout.readline()  # type: ignore[union-attr]
                if not line.startswith("unshared "):
                    pod.kill()
                    skip_or_fail(f"cannot make a user namespace: {pod.communicate()[1]}")
                pid = int(line.split()[1])
                usernspod.write_maps(pid)
                subprocess.run(
                    [sys.executable, usernspod.__file__, "mount", str(pid),
                     str(directory / "broker"), str(directory / "mnt" / "hostpid"), kind,
                     str(lock_parent), str(directory / "mnt" / "lock")],
                    check=True, env=env, capture_output=True, text=True, timeout=30,
                )
                out, err = pod.communicate("go\n", timeout=60)
            finally:
                if pod.poll() is None:
                    pod.kill()
                    pod.wait()
            assert pod.returncode == 0, err
            result = json.loads(out)
            result["lock_parent_left"] = (lock_parent / "hostpid").is_dir()
            written = directory / "broker" / "written-by-pod"
            result["written_host_owner"] = (
                written.lstat().st_uid if written.exists() else None
            )
            result["broker_log"] = broker.output()
            return result
    finally:
        remove_tree(directory, ignore_errors=True)


@pytest.fixture(scope="module", params=KINDS)
def pod(request: pytest.FixtureRequest, c_client: Path) -> Iterator[tuple[str, dict]]:
    yield request.param, _run_pod(request.param, c_client)


def test_client_gets_its_own_host_pid(pod: tuple[str, dict]) -> None:
    """
    The pod's PID 1 asks and is told the PID host root saw it get: the
    client trusts the broker in a user namespace, on either kind of mount.
    """
    kind, seen = pod
    assert seen["ns_pid"] == 1
    assert seen["uid_map"] == ["0", str(usernspod.POD_BASE), str(usernspod.POD_SIZE)]
    assert seen["query"] == {"pid": seen["host_pid"]}, seen["query"]
    # The C contract client (HAMi-core's rule with the same change) agrees:
    # the broker's answer, then its own getpid() in the pod's PID namespace.
    c_query = seen["c_query"]
    (c_host_pid,) = c_query["host_pids"]
    assert c_query["line"] == f"{c_host_pid} {c_query['ns_pid']}", c_query


def test_doctor_names_the_user_namespace_and_each_value(pod: tuple[str, dict]) -> None:
    kind, seen = pod
    lines = {line.split()[0]: line for line in seen["doctor"]}
    assert lines["user-namespace"].startswith(
        "user-namespace ok user namespace (uid_map 0->100000x65536): host uid 0 is not mapped"
    )
    owner = "uid 0" if kind == "idmap" else "uid 65534"
    how = "through an idmapped mount" if kind == "idmap" else "on a mount without an idmapping"
    assert lines["directory"] == (
        f"directory ok directory, {owner}, mode 0711 (the host's uid 0 {how})"
    )
    assert lines["socket"] == f"socket ok socket, {owner}, mode 0666 (the host's uid 0 {how})"
    assert lines["peer-uid"].startswith(
        "peer-uid ok uid 65534 (pid 0): the overflow uid outside this PID namespace"
    )
    assert lines["peer-pid"] == "peer-pid ok pid 0: outside this PID namespace (the host's)"
    assert lines["reply"] == f"reply ok host PID {seen['host_pid']}"


def test_root_with_cap_sys_admin_on_its_own_tmpfs_is_refused(pod: tuple[str, dict]) -> None:
    """
    The pod's root, with CAP_SYS_ADMIN in its user namespace, mounts a tmpfs
    over the broker directory in the client's own mount namespace, listens
    there and makes it read-only: directory, socket and mount pass, and so
    does peer-uid (the pod's root shows as UID 0, as the host's rule would
    see it), but the listener is one of this PID namespace's processes and
    peer-pid refuses before a byte is sent.
    """
    kind, seen = pod
    query = seen["tmpfs"]["query"]
    assert query["check"] == "peer-pid", query
    assert "is inside this process's PID namespace" in query["observed"]
    doctor = {line.split()[0]: line for line in seen["tmpfs"]["doctor"]}
    assert doctor["directory"].startswith("directory ok directory, uid 0, mode 0755")
    assert doctor["read-only-mount"] == "read-only-mount ok read-only"
    assert doctor["peer-uid"].endswith("uid 0 as this user namespace shows it")
    assert "is inside this process's PID namespace" in doctor["peer-pid"]
    assert doctor["reply"] == "reply FAIL not tried: peer-pid failed"
    c_line = seen["tmpfs"]["c_query"]["line"]
    assert c_line.startswith("hostpid_client: peer-pid: pid "), c_line
    assert "is inside this process's PID namespace" in c_line
    assert str(usernspod.FAKE_PID) not in json.dumps(seen["tmpfs"])


def test_fake_broker_still_serves_the_pods_own_tests(pod: tuple[str, dict]) -> None:
    """
    L{hostpid.testing.FakeBroker} in a user-namespaced container: its
    listener shows as its own UID, which the rule still accepts as the host's
    rule would (its policy turns off peer-pid, as everywhere).
    """
    kind, seen = pod
    assert seen["fake_broker"] == {"pid": usernspod.FAKE_PID}


def test_nobody_cannot_take_the_path_and_its_own_listener_is_refused(
    pod: tuple[str, dict]
) -> None:
    """
    The pod's nobody (65534: a UID the pod maps, the same number as the
    overflow UID) can neither bind in the read-only broker directory nor
    mount; a listener of its own, in a directory it owns, is refused.
    """
    kind, seen = pod
    nobody = seen["nobody"]
    assert nobody["bind"] == "EROFS"
    assert nobody["mount"] == "EPERM"
    assert nobody["query"] == {"check": "read-only-mount", "observed": "read-write mount"}


def test_cap_sys_admin_pod_writes_the_host_directory_only_through_an_idmapped_mount(
    pod: tuple[str, dict]
) -> None:
    """
    What decides which mount the node must give: the pod's root with
    CAP_SYS_ADMIN in its user namespace can make its broker mount writable
    (a mount made inside its mount namespace is not locked).  Through an
    idmapped mount the host's root-owned directory is then its own and it
    creates a file in the host's broker directory; through a plain mount
    the owner stays unmapped and the write is refused.
    """
    kind, seen = pod
    assert seen["remount"]["remount"] == "writable"
    if kind == "idmap":
        assert seen["remount"] == {"remount": "writable", "write": "created", "owner_here": 0}
        assert seen["written_host_owner"] == 0, "created as the host's root"
    else:
        assert seen["remount"] == {"remount": "writable", "write": "EACCES"}
        assert seen["written_host_owner"] is None


def test_lock_parent_idmapped_makes_pod_root_its_owner(pod: tuple[str, dict]) -> None:
    """
    The lock parent read-write and idmapped: with no capability at all, the
    pod's root owns the host's root-owned mountpoint directory and removes
    it (which detaches the broker mount in every container bound on it);
    mounted plain, it owns nothing there (the sticky bit refuses: EPERM).
    """
    kind, seen = pod
    lock = seen["lock_parent"]
    if kind == "idmap":
        assert lock == {"owner": 0, "rmdir": "removed"}
        assert not seen["lock_parent_left"]
    else:
        assert lock == {"owner": usernspod.NOBODY, "rmdir": "EPERM"}
        assert seen["lock_parent_left"]


@pytest.mark.kernel
@kernel_feature("idmapped_mounts", "immutable_tmp")
def test_an_immutable_mountpoint_is_kept_from_the_idmapped_pods_root(c_client: Path) -> None:
    """
    The same pod root, through the same idmapped lock parent, owns the
    mountpoint directory but cannot remove it once it is immutable (as every
    preparation now leaves it): the kernel refuses an immutable inode's
    removal before it asks who owns it, and the pod has no
    C{CAP_LINUX_IMMUTABLE} in the initial user namespace to clear the flag.
    """
    seen = _run_pod("idmap", c_client, immutable=True)
    assert seen["lock_parent"] == {"owner": 0, "rmdir": "EPERM"}, seen["lock_parent"]
    assert seen["lock_parent_left"]


def _start_neighbour(role: str, target: Path, source: Path, kind: str, base: int,
                     env: dict[str, str]) -> subprocess.Popen[str]:
    pod = subprocess.Popen(
        [sys.executable, usernspod.__file__, "neighbour", role, str(target)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )
    line = pod.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("unshared "):
        pod.kill()
        skip_or_fail(f"cannot make a user namespace: {pod.communicate()[1]}")
    pid = int(line.split()[1])
    usernspod.write_maps(pid, base)
    subprocess.run(
        [sys.executable, usernspod.__file__, "mount", str(pid), str(source), str(target), kind],
        check=True, env=env, capture_output=True, text=True, timeout=30,
    )
    pod.stdin.write("go\n")  # type: ignore[union-attr]
    pod.stdin.flush()  # type: ignore[union-attr]
    return pod


@pytest.mark.parametrize("kind", KINDS)
def test_one_pod_with_cap_sys_admin_and_another_pods_client(kind: str) -> None:
    """
    Two user-namespaced pods on one node, each with the broker directory
    mounted read-only.  The first adds CAP_SYS_ADMIN: it makes its broker
    mount writable and replaces the broker's socket in the host's directory
    with a listener of its own.  Through an idmapped mount it can (it owns
    the directory through the idmapping, and its socket is created as the
    host's root), and the second pod's client, whose rule accepts the
    overflow UID with PID 0, takes the forged PID: the node must not give an
    idmapped broker mount to a pod that adds CAP_SYS_ADMIN (docs/userns.md).
    Through a plain mount the replacement fails and the second pod is told
    its own PID.
    """
    require_root()
    directory = Path(tempfile.mkdtemp(prefix="hostpid-userns-2-", dir="/tmp"))
    forger = asker = None
    try:
        directory.chmod(0o755)
        for name in ("forger", "asker"):
            (directory / name).mkdir(mode=0o755)
        env = subprocess_env()
        with BrokerProcess(directory / "broker") as broker:
            broker.wait_listening()
            forger = _start_neighbour("forger", directory / "forger", directory / "broker",
                                      kind, usernspod.POD_BASE, env)
            steps = json.loads(forger.stdout.readline())  # type: ignore[union-attr]
            asker = _start_neighbour("asker", directory / "asker", directory / "broker",
                                     kind, usernspod.POD_BASE + usernspod.POD_SIZE, env)
            asked = json.loads(asker.stdout.readline())  # type: ignore[union-attr]
            host_socket = (directory / "broker" / "broker.sock").lstat()
        if kind == "idmap":
            assert steps == {"remount": "writable", "unlink": "done", "listen": "done"}
            assert host_socket.st_uid == 0, "the forger's socket is the host root's"
            assert asked == {"query": {"pid": usernspod.FAKE_PID}}
        else:
            assert steps == {"remount": "writable", "error": "EACCES"}
            assert set(asked["query"]) == {"pid"}
            assert asked["query"]["pid"] != usernspod.FAKE_PID
    finally:
        for pod in (forger, asker):
            if pod is not None:
                if pod.poll() is None:
                    pod.communicate("\n", timeout=30)
        remove_tree(directory, ignore_errors=True)
