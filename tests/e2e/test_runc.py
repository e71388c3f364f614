"""
End to end with a real OCI runtime (issues 4 and 9).

A real broker (C{twistd hostpid-broker}) runs on the host.  C{hostpid
allocate} prepares a private lock parent and patches an allocation response;
the response's mounts, in order, become bind mounts of an OCI bundle whose
root is read-only binds of the host's C{/usr} and C{/etc} (plus the Python
that runs the tests and this working tree), and C{runc run} starts it in its
own PID namespace.  Inside, C{python -m hostpid.cli query} runs with every
default trust check, and the PID it prints must be the host PID runc reports
for the container's init process (C{--pid-file}, the same value C{runc state}
gives).

The container's command is a shell that reports a few facts about the
container (its own PID, the gate variable, how many mounts are at the broker
mountpoint) and then C{exec}s the query, so the query runs as the container's
init process: PID 1 inside, the runc-reported PID outside.

Run with C{pytest -s} to see the container run times and host PIDs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
from kernelfeatures import kernel_feature
from support import (
    REPO,
    hostpid_argv,
    release_immutable,
    remove_tree,
    require_root,
    require_tool,
    running_broker,
    subprocess_env,
)

from hostpid.gate import GATE_ENV
from hostpid.node.allocation import Mount, response_from_json

WORKLOAD_UID = 1000
RUNC_TIMEOUT = 60.0



def query_script(python: str) -> str:
    """A shell that reports the container's view, then becomes the query (same PID)."""
    return (
        'echo "ns-pid $$"; '
        'echo "gate ${' + GATE_ENV + '-unset}"; '
        'echo "broker-mounts $(grep -c " /tmp/vgpulock/hostpid " /proc/self/mountinfo)"; '
        f"exec {shlex.quote(python)} -m hostpid.cli query"
    )


@attrs.frozen
class ContainerRun:
    """What one C{runc run} did."""

    name: str
    exit_code: int
    host_pid: int | None
    stdout: str
    stderr: str
    seconds: float

    def facts(self) -> dict[str, str]:
        """The C{key value} lines the script printed before the query."""
        found = {}
        for line in self.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key in ("ns-pid", "gate", "broker-mounts"):
                found[key] = value
        return found

    def printed_pid(self) -> int | None:
        """The PID the query printed: the one line that is only digits."""
        numbers = [line for line in self.stdout.splitlines() if line.isdigit()]
        assert len(numbers) <= 1, self.stdout
        return int(numbers[0]) if numbers else None


@attrs.frozen
class PythonLayout:
    """
    How the container runs this Python with this working tree.

    The base interpreter is bound at its own path (its prefix is compiled
    in).  The working tree and any other import directory (a virtualenv's
    site-packages, a user site) are bound under C{/e2e}, outside C{/tmp}:
    CI clones the repository under C{/tmp}, and the container's own C{/tmp}
    (and the allocation's mounts there) would hide them.
    """

    executable: str
    binds: tuple[tuple[str, str], ...]
    pythonpath: tuple[str, ...]

    @classmethod
    def of_this_process(cls) -> PythonLayout:
        executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        base = os.path.realpath(sys.base_prefix)
        binds: list[tuple[str, str]] = []
        if not _inside(base, "/usr"):
            binds.append((base, base))
        pythonpath = ["/e2e/src"]
        binds.append((str(REPO), "/e2e/src"))
        for entry in sys.path:
            if not os.path.isabs(entry) or not os.path.isdir(entry):
                continue
            real = os.path.realpath(entry)
            already = real == str(REPO) or any(host == real for host, _ in binds)
            if already or _inside(real, "/usr") or _inside(real, base):
                continue
            target = f"/e2e/path{len(pythonpath)}"
            binds.append((real, target))
            pythonpath.append(target)
        return cls(executable, tuple(binds), tuple(pythonpath))


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def make_rootfs(workdir: Path) -> Path:
    """
    An empty 0755 container root in C{workdir}: this Debian (and CI's) has
    C{/bin}, C{/lib}, C{/lib64} and C{/sbin} as symlinks into C{/usr};
    recreate whichever the host has (the runtimes bind C{/usr} itself).
    """
    rootfs = workdir / "rootfs"
    rootfs.mkdir()
    os.chmod(rootfs, 0o755)
    for name in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / name
        if host.is_symlink():
            (rootfs / name).symlink_to(os.readlink(host))
    return rootfs


class Runtime:
    """
    Bundles and OCI runtime runs under one private state directory.

    C{command} is the runtime and its global options (C{[runc]}, or
    C{[runsc, "--host-uds=open"]}); C{uid_mappings}, when given, puts each
    container in a user namespace with that one mapping (container UID,
    host UID, count), for UIDs and GIDs alike, as Kubernetes'
    C{hostUsers: false} does.
    """

    def __init__(self, command: str | Sequence[str], workdir: Path,
                 uid_mappings: tuple[int, int, int] | None = None) -> None:
        self.command = [command] if isinstance(command, str) else list(command)
        self.uid_mappings = uid_mappings
        self.workdir = workdir
        self.state = workdir / "runc-state"
        self.state.mkdir(mode=0o700)
        self.rootfs = make_rootfs(workdir)
        if uid_mappings is not None:
            # The runtime makes the mountpoints as the container's root.
            os.chown(self.rootfs, uid_mappings[1], uid_mappings[1])
        self.python = PythonLayout.of_this_process()
        #: More read-only binds (host path, container path) for every container.
        self.extra_binds: list[tuple[str, str]] = []
        self.runs: list[ContainerRun] = []

    def _config(self, mounts: Sequence[Mount], envs: dict[str, str], uid: int,
                args: list[str], rbind: bool = False) -> dict[str, Any]:
        def bind(source: str, destination: str, read_only: bool,
                 recursive: bool = False) -> dict[str, Any]:
            kind = "rbind" if recursive else "bind"
            options = [kind, "nosuid", "nodev", "ro" if read_only else "rw"]
            return {"destination": destination, "type": "bind", "source": source,
                    "options": options}

        base_mounts: list[dict[str, Any]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            bind("/usr", "/usr", True),
            bind("/etc", "/etc", True),
            *(bind(host, inside, True) for host, inside in
              (*self.python.binds, *self.extra_binds)),
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", "size=16m"]},
        ]
        # The allocation response's mounts, in its order: the point of the test.
        # rbind=True: recursive, as containerd's CRI plugin binds every mount.
        response_mounts = [bind(m.host_path, m.container_path, m.read_only, rbind)
                           for m in mounts]
        env = [
            "PATH=/usr/local/bin:/usr/bin:/bin",
            f"PYTHONPATH={':'.join(self.python.pythonpath)}",
            "PYTHONDONTWRITEBYTECODE=1",
            "HOME=/",
            *(f"{key}={value}" for key, value in envs.items()),
        ]
        namespaces = ["pid", "network", "ipc", "uts", "mount"]
        linux: dict[str, Any] = {
            "namespaces": [{"type": t} for t in namespaces],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/sys/firmware"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"],
        }
        if self.uid_mappings is not None:
            inside, outside, size = self.uid_mappings
            mapping = [{"containerID": inside, "hostID": outside, "size": size}]
            linux["namespaces"].append({"type": "user"})
            linux["uidMappings"] = linux["gidMappings"] = mapping
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": uid, "gid": uid},
                "args": args,
                "env": env,
                "cwd": "/",
                "capabilities": {kind: ["CAP_KILL"] for kind in
                                 ("bounding", "effective", "permitted")},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
                "noNewPrivileges": True,
            },
            "root": {"path": str(self.rootfs), "readonly": True},
            "hostname": "hostpid-e2e",
            "mounts": [*base_mounts, *response_mounts],
            "linux": linux,
        }

    def run(self, name: str, mounts: Sequence[Mount], envs: dict[str, str], uid: int,
            args: list[str] | None = None, rbind: bool = False) -> ContainerRun:
        """Run one container to completion; record and print what happened."""
        container_id = f"hostpid-e2e-{uuid.uuid4().hex[:12]}"
        bundle = self.workdir / container_id
        bundle.mkdir()
        script = query_script(self.python.executable)
        config = self._config(mounts, envs, uid, args or ["/bin/sh", "-c", script], rbind)
        (bundle / "config.json").write_text(json.dumps(config, indent=2))
        pid_file = bundle / "init.pid"
        started = time.monotonic()
        try:
            result = subprocess.run(
                [*self.command, "--root", str(self.state), "run", "--bundle", str(bundle),
                 "--pid-file", str(pid_file), container_id],
                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=RUNC_TIMEOUT, check=False,
            )
        finally:
            seconds = time.monotonic() - started
            subprocess.run([*self.command, "--root", str(self.state), "delete", "--force",
                            container_id], capture_output=True, timeout=RUNC_TIMEOUT,
                           check=False)
        host_pid = int(pid_file.read_text()) if pid_file.exists() else None
        run = ContainerRun(name, result.returncode, host_pid, result.stdout, result.stderr,
                           seconds)
        self.runs.append(run)
        print(f"\n[e2e] {name}: uid={uid} exit={run.exit_code} host_pid={host_pid} "
              f"printed={run.printed_pid()} seconds={seconds:.3f} facts={run.facts()} "
              f"stderr={run.stderr.strip()!r}")
        return run


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    require_root()
    runc = require_tool("runc")
    workdir = Path(tempfile.mkdtemp(prefix="hostpid-e2e-"))
    try:
        yield Runtime(runc, workdir)
    finally:
        remove_tree(workdir, ignore_errors=True)


@attrs.frozen
class Node:
    """A stand-in node: the broker directory and the lock parent, both private."""

    broker_dir: Path
    lock_parent: Path


@pytest.fixture
def node() -> Iterator[Node]:
    with private_node() as made:
        yield made


@contextmanager
def private_node() -> Iterator[Node]:
    """
    Root-owned 0755 directories in C{/tmp} standing in for C{/var/run/hami}
    (the broker makes C{hostpid} inside, 0711) and C{/tmp} (the lock parent
    C{vgpulock} is prepared inside).
    """
    require_root()
    home = Path(tempfile.mkdtemp(prefix="hostpid-node-", dir="/tmp"))
    os.chmod(home, 0o755)
    (home / "run").mkdir(mode=0o755)
    (home / "tmp").mkdir(mode=0o755)
    try:
        yield Node(broker_dir=home / "run" / "hostpid", lock_parent=home / "tmp" / "vgpulock")
    finally:
        remove_tree(home)


def allocate(node: Node, gate: str, request: dict[str, Any] | None = None
             ) -> tuple[tuple[Mount, ...], dict[str, str], str]:
    """Run C{hostpid allocate} as a device plugin would; the mounts, envs and stderr."""
    env = subprocess_env()
    env.pop(GATE_ENV, None)
    env[GATE_ENV] = gate
    result = subprocess.run(
        hostpid_argv("allocate", "--lock-parent", str(node.lock_parent),
                     "--broker-dir", str(node.broker_dir)),
        input=json.dumps(request or {"envs": {"NVIDIA_VISIBLE_DEVICES": "0"}}),
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    response = response_from_json(result.stdout)
    return response.mounts, dict(response.envs), result.stderr


def assert_host_pid_answered(run: ContainerRun) -> None:
    assert run.exit_code == 0, run.stderr
    assert run.facts()["ns-pid"] == "1", "the query must run in its own PID namespace"
    assert run.facts()["gate"] == "1"
    assert run.facts()["broker-mounts"] == "1"
    assert run.host_pid is not None and run.host_pid > 1
    assert run.printed_pid() == run.host_pid


@pytest.mark.parametrize("uid", [0, WORKLOAD_UID])
def test_query_returns_the_container_host_pid(runtime: Runtime, node: Node, uid: int) -> None:
    with running_broker(node.broker_dir) as broker:
        mounts, envs, _ = allocate(node, "1", {
            "envs": {GATE_ENV: "0", "NVIDIA_VISIBLE_DEVICES": "0"},
            # A stale broker mount from an older plugin: replaced, not kept.
            "mounts": [{"container_path": "/tmp/vgpulock/hostpid/", "host_path": "/nowhere",
                        "read_only": False}],
        })
        assert [m.container_path for m in mounts] == ["/tmp/vgpulock", "/tmp/vgpulock/hostpid"]
        run = runtime.run(f"gate on, uid {uid}", mounts, envs, uid)
        assert_host_pid_answered(run)
        # Two containers, two different host PIDs, neither the broker's.
        second = runtime.run(f"gate on, uid {uid}, again", mounts, envs, uid)
        assert_host_pid_answered(second)
        assert second.host_pid != run.host_pid
        assert broker.pid not in (run.host_pid, second.host_pid)


@pytest.mark.parametrize("uid", [0, WORKLOAD_UID])
def test_gate_off_gives_neither_env_nor_broker_mount(
    runtime: Runtime, node: Node, uid: int
) -> None:
    with running_broker(node.broker_dir):
        mounts, envs, _ = allocate(node, "0", {
            "envs": {GATE_ENV: "1"},
            "mounts": [{"containerPath": "/tmp/vgpulock/hostpid",
                        "hostPath": str(node.broker_dir), "readOnly": True}],
        })
        assert GATE_ENV not in envs
        assert [m.container_path for m in mounts] == ["/tmp/vgpulock"]
        run = runtime.run(f"gate off, uid {uid}", mounts, envs, uid)
    assert run.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0"}
    assert run.exit_code == 1
    assert run.printed_pid() is None
    assert run.stderr.count("\n") == 1 and "gate check failed" in run.stderr


def test_negative_control_reversed_mounts_hide_the_broker(runtime: Runtime, node: Node) -> None:
    """
    The same allocation with its two mounts reversed: the parent is mounted
    over the broker mount and hides it.  The query must fail, which shows
    this test can tell a working order from a broken one.
    """
    with running_broker(node.broker_dir):
        mounts, envs, _ = allocate(node, "1")
        good = runtime.run("control: patched order", mounts, envs, WORKLOAD_UID)
        reversed_run = runtime.run("control: reversed order", tuple(reversed(mounts)), envs,
                                   WORKLOAD_UID)
    assert_host_pid_answered(good)
    assert reversed_run.exit_code == 1
    assert reversed_run.printed_pid() is None
    assert reversed_run.stderr.strip().startswith("hostpid query:")


def test_ancestor_mount_listed_last_is_moved_before_them(runtime: Runtime, node: Node,
                                                         tmp_path: Path) -> None:
    """A plugin's own C{/tmp} mount, listed after ours, would hide both."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o1777)
    os.chmod(scratch, 0o1777)
    request = {"mounts": [{"containerPath": "/tmp/vgpulock", "hostPath": "/old"},
                          {"containerPath": "/tmp", "hostPath": str(scratch)}]}
    with running_broker(node.broker_dir):
        mounts, envs, _ = allocate(node, "1", request)
        assert [m.container_path for m in mounts] == ["/tmp", "/tmp/vgpulock",
                                                      "/tmp/vgpulock/hostpid"]
        run = runtime.run("ancestor /tmp reordered", mounts, envs, WORKLOAD_UID)
        hidden = runtime.run("ancestor /tmp last (unpatched order)",
                             (*mounts[1:], mounts[0]), envs, WORKLOAD_UID)
    assert_host_pid_answered(run)
    assert hidden.exit_code == 1 and hidden.printed_pid() is None


def test_planted_mountpoint_repaired_by_the_next_allocation(runtime: Runtime,
                                                            node: Node) -> None:
    """
    A UID 1000 workload plants a regular file at the broker
    mountpoint through its writable C{/tmp/vgpulock}.  Without repair the
    next broker-enabled container cannot even start; the next allocation
    repairs it and the next container gets its host PID.
    """
    with running_broker(node.broker_dir):
        # The broker was off when this workload was allocated: the lock
        # parent exists, the mountpoint does not yet.
        off_mounts, off_envs, _ = allocate(node, "0")
        assert not (node.lock_parent / "hostpid").exists()
        plant = runtime.run(
            "planted mountpoint: uid 1000 plants a file", off_mounts, off_envs, WORKLOAD_UID,
            ["/bin/sh", "-c", ": > /tmp/vgpulock/hostpid && echo planted"],
        )
        assert plant.exit_code == 0, plant.stderr
        planted = os.lstat(node.lock_parent / "hostpid")
        assert planted.st_uid == WORKLOAD_UID
        assert (planted.st_mode & 0o170000) == 0o100000

        # Control: the broker-enabled mounts without the repair.
        from hostpid.node.allocation import canonical_mounts

        unrepaired = runtime.run(
            "planted mountpoint: no repair",
            canonical_mounts(True, str(node.lock_parent), str(node.broker_dir)),
            {GATE_ENV: "1"}, WORKLOAD_UID,
        )
        assert unrepaired.exit_code != 0
        assert unrepaired.printed_pid() is None
        assert "not a directory" in unrepaired.stderr

        mounts, envs, stderr = allocate(node, "1")
        assert "found a regular file owned by UID 1000" in stderr
        repaired = os.lstat(node.lock_parent / "hostpid")
        assert (repaired.st_uid, repaired.st_mode) == (0, 0o040755)
        run = runtime.run("planted mountpoint: after repair", mounts, envs, WORKLOAD_UID)
    assert_host_pid_answered(run)


def test_lock_file_inside_the_parent_listed_before_tmp(runtime: Runtime, node: Node,
                                                       tmp_path: Path) -> None:
    """
    Mount order: a legacy lock file mounted inside the lock parent, listed
    before the plugin's own C{/tmp} mount.  Patched, it comes after C{/tmp},
    the parent and the broker mount, and the container sees it; in the old
    order (it stayed before the parent) C{/tmp} and the parent hide it.
    """
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o1777)
    os.chmod(scratch, 0o1777)
    legacy = tmp_path / "legacy.lock"
    legacy.write_text("legacy-lock-content\n")
    os.chmod(legacy, 0o644)
    request = {"mounts": [{"containerPath": "/tmp/vgpulock/legacy.lock",
                           "hostPath": str(legacy)},
                          {"containerPath": "/tmp", "hostPath": str(scratch)}]}
    script = ('echo "legacy $(cat /tmp/vgpulock/legacy.lock 2>/dev/null || echo hidden)"; '
              + query_script(runtime.python.executable))
    with running_broker(node.broker_dir):
        mounts, envs, _ = allocate(node, "1", request)
        assert [m.container_path for m in mounts] == [
            "/tmp", "/tmp/vgpulock", "/tmp/vgpulock/hostpid", "/tmp/vgpulock/legacy.lock"]
        run = runtime.run("legacy lock file after /tmp", mounts, envs, WORKLOAD_UID,
                          ["/bin/sh", "-c", script])
        old_order = (mounts[3], mounts[0], mounts[1], mounts[2])
        hidden = runtime.run("legacy lock file first (old order)", old_order, envs,
                             WORKLOAD_UID, ["/bin/sh", "-c", script])
    assert "legacy legacy-lock-content" in run.stdout.splitlines()
    assert_host_pid_answered(run)
    # Hidden: what the container reads there is the empty mountpoint, not the file.
    assert "legacy legacy-lock-content" not in hidden.stdout.splitlines()


def test_broker_directory_under_another_name_is_not_mounted(runtime: Runtime, node: Node,
                                                            tmp_path: Path) -> None:
    """
    Host paths by identity: a writable mount of the broker directory at another
    container path, through a symlinked alias of its host path.  Kept (the
    old code kept it), a root workload writes into the broker directory,
    where it could replace C{broker.sock}; patched, the mount is gone.
    """
    alias = tmp_path / "alias"
    alias.symlink_to(node.broker_dir)
    request = {"mounts": [{"containerPath": "/safe", "hostPath": str(alias),
                           "readOnly": False}]}
    plant = ["/bin/sh", "-c", "touch /safe/planted && echo planted || echo refused"]
    with running_broker(node.broker_dir):
        mounts, envs, _ = allocate(node, "1", request)
        assert [m.container_path for m in mounts] == ["/tmp/vgpulock", "/tmp/vgpulock/hostpid"]
        run = runtime.run("alias of the broker dir, patched", mounts, envs, 0, plant)
        assert not (node.broker_dir / "planted").exists()
        kept = (*mounts, Mount("/safe", str(alias), False))
        control = runtime.run("alias of the broker dir, kept (old code)", kept, envs, 0, plant)
        planted = (node.broker_dir / "planted").exists()
    assert "planted" not in run.stdout.split()
    assert control.stdout.split() == ["planted"] and planted


class MountHolder:
    """
    A process holding the broker mount on C{<lock parent>/hostpid} in a
    mount namespace of its own, as a running broker-enabled container does;
    it reports, when asked, whether it still sees C{broker.sock} there.
    """

    SCRIPT = (
        "set -e; mount --make-rprivate /; mount --bind \"$1\" \"$2\"; "
        "echo ready; while read _; do "
        "if [ -S \"$2/broker.sock\" ]; then echo visible; else echo gone; fi; done"
    )

    def __init__(self, broker_dir: Path, mountpoint: Path) -> None:
        self.process = subprocess.Popen(
            ["unshare", "--mount", "sh", "-c", self.SCRIPT, "holder", str(broker_dir),
             str(mountpoint)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.ask_raw() == "ready"

    def ask_raw(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def sees_socket(self) -> bool:
        assert self.process.stdin is not None
        self.process.stdin.write("?\n")
        self.process.stdin.flush()
        return self.ask_raw() == "visible"

    def close(self) -> None:
        self.process.kill()
        self.process.communicate()


RMDIR = ["/bin/sh", "-c",
         "rmdir /tmp/vgpulock/hostpid 2>&1 && echo removed || echo refused"]


@pytest.mark.parametrize(("host_mount", "rbind", "immutable"), [
    (False, True, False), (True, True, False), (True, False, False),
    pytest.param(False, True, True, marks=kernel_feature("immutable_tmp")),
])
def test_root_workload_rmdir_of_the_mountpoint(runtime: Runtime, node: Node, host_mount: bool,
                                               rbind: bool, immutable: bool) -> None:
    """
    Measured: a UID 0 workload (no user namespace, no
    capability but CAP_KILL) whose allocation has no broker mount removes
    C{/tmp/vgpulock/hostpid} where it is not immutable (as an older release
    left it); the broker mount of a running container on that mountpoint is
    detached.  With a host-side read-only bind of the broker
    directory on the mountpoint, and the lock parent bound recursively
    (rbind, as containerd's CRI does), the rmdir fails with EBUSY instead;
    bound non-recursively, the container does not get the host-side mount,
    and its rmdir detaches it from the host and from every container.  As
    the allocation leaves it now, immutable, the rmdir fails with EPERM
    (root's ownership no longer decides) and the running container keeps its
    broker mount.
    """
    with running_broker(node.broker_dir):
        allocate(node, "1")
        off_mounts, off_envs, _ = allocate(node, "0")
        mountpoint = node.lock_parent / "hostpid"
        if not immutable:
            release_immutable(mountpoint)
        if host_mount:
            subprocess.run(["mount", "--bind", str(node.broker_dir), str(mountpoint)],
                           check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(mountpoint)], check=True)
        holder = MountHolder(node.broker_dir, mountpoint)
        try:
            assert holder.sees_socket()
            run = runtime.run(f"root rmdir, host mount {host_mount}, rbind {rbind}",
                              off_mounts, off_envs, 0, RMDIR, rbind=rbind)
            still_visible = holder.sees_socket()
        finally:
            holder.close()
            if host_mount:
                subprocess.run(["umount", "-l", str(mountpoint)], check=False)
    print(f"[e2e] host mount {host_mount}, rbind {rbind}, immutable {immutable}: "
          f"{run.stdout.strip()!r}; running "
          f"container still sees broker.sock: {still_visible}")
    if immutable:
        assert "Operation not permitted" in run.stdout and "refused" in run.stdout
        assert still_visible
    elif host_mount and rbind:
        assert "resource busy" in run.stdout and "refused" in run.stdout
        assert still_visible
    else:
        assert run.stdout.split() == ["removed"]
        assert not still_visible, "the kernel detached the other container's broker mount"
