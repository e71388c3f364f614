"""
A user-namespaced "pod" made with real system calls, as a runtime makes one
for Kubernetes C{hostUsers: false}: a user namespace mapping 0..65535 to
host UIDs 100000..165535 (written by host root into C{/proc/PID/uid_map}),
its own mount and PID namespaces, and the broker's directory mounted into it
read-only, idmapped with the pod's own mapping (C{open_tree(OPEN_TREE_CLONE)},
C{mount_setattr(MOUNT_ATTR_IDMAP)}, C{move_mount}: what runc 1.2 does for an
C{idmap} mount) or, for the other cell, as a plain read-only bind.

Debian 12's runc (1.1.5) and crun (1.8.1) predate idmapped mounts, and the
newer runtimes need a newer glibc, so the namespaces and the mount are made
here with C{ctypes} system calls: nothing stands between the test and the
kernel.

Run as a script:

  - C{pod DIRECTORY}: the pod's first process.  It makes the namespaces,
    says C{unshared PID} on stdout, waits for C{go} on stdin (by then host
    root has written the maps and made the broker mount), becomes the pod's
    root and runs the scenarios as the pod's PID 1, printing one JSON object.
  - C{mount PID SOURCE TARGET idmap|plain}: host root's helper that makes the
    broker mount in the pod's mount namespace.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import struct
import subprocess
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
# The new mount API's numbers are the same on every architecture (424 on).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 0x1
AT_EMPTY_PATH = 0x1000
AT_FDCWD = -100
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_IDMAP = 0x00100000

#: The pod's mapping: what the kubelet gives a pod (65,536 IDs from a base).
POD_BASE = 100000
POD_SIZE = 65536
NOBODY = 65534
FAKE_PID = 4242

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
    return result


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, flags: int) -> None:
    _check(_libc.setns(fd, flags), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    def enc(value: str | None) -> bytes | None:
        return None if value is None else value.encode()

    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def umount(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def open_tree(path: str, flags: int) -> int:
    return _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), ctypes.c_uint(flags)),
                  "open_tree")


def mount_setattr(fd: int, attr_set: int, userns_fd: int = 0) -> None:
    attr = struct.pack("QQQQ", attr_set, 0, 0, userns_fd)
    buffer = ctypes.create_string_buffer(attr, len(attr))
    _check(_libc.syscall(SYS_MOUNT_SETATTR, fd, b"", ctypes.c_uint(AT_EMPTY_PATH), buffer,
                         ctypes.c_size_t(len(attr))), "mount_setattr")


def move_mount(fd: int, target: str) -> None:
    _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(),
                         ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), "move_mount")


def write_maps(pid: int, base: int = POD_BASE) -> None:
    """Host root writes the pod's mapping, as a runtime does."""
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w", encoding="ascii") as out:
            out.write(f"0 {base} {POD_SIZE}\n")


def make_broker_mount(pid: int, source: str, target: str, kind: str) -> None:
    """
    A detached read-only clone of C{source} (idmapped with the pod's user
    namespace for C{idmap}), moved onto C{target} in the pod's mount
    namespace.  Run single-threaded (setns into a mount namespace is refused
    to a threaded process).
    """
    tree = open_tree(source, OPEN_TREE_CLONE | os.O_CLOEXEC)
    if kind == "idmap":
        userns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        mount_setattr(tree, MOUNT_ATTR_RDONLY | MOUNT_ATTR_IDMAP, userns)
        os.close(userns)
    else:
        mount_setattr(tree, MOUNT_ATTR_RDONLY)
    mnt = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    setns(mnt, CLONE_NEWNS)
    move_mount(tree, target)


def drop_capabilities() -> None:
    """Every capability gone (effective, permitted, inheritable), as a pod that adds none."""
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = bytes(24)
    _check(_libc.capset(header, data), "capset")


def make_lock_mount(source: str, target: str, kind: str, pid: int) -> None:
    """A read-write clone of C{source} on C{target}, in the namespace already joined."""
    tree = open_tree(source, OPEN_TREE_CLONE | os.O_CLOEXEC)
    if kind == "idmap":
        userns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        mount_setattr(tree, MOUNT_ATTR_IDMAP, userns)
        os.close(userns)
    move_mount(tree, target)


def become(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _error(error: OSError) -> str:
    return errno.errorcode.get(error.errno or 0, str(error.errno))


def _serve_fake(listener: socket.socket) -> None:
    """Answer every request with a forged PID, as an impersonator would."""
    from hostpid import wire

    while True:
        connection, _ = listener.accept()
        try:
            connection.recv(64)
            connection.sendall(wire.Response(wire.Status.OK, FAKE_PID).encode())
        except OSError:
            pass
        connection.close()


def _in_child(work, uid: int | None = None) -> dict:
    """Run C{work} in a forked child (as C{uid}), return what it wrote as JSON."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            if uid is not None:
                become(uid)
            outcome = work()
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            outcome = {"error": repr(error)}
        os.write(write, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return json.loads(data)


def _query(socket_path: str) -> dict:
    from hostpid.client.blocking import HostPidUnavailable, TrustPolicy, query_host_pid

    try:
        return {"pid": query_host_pid(TrustPolicy(socket_path=socket_path),
                                      {"LIBVGPU_HOSTPID_BROKER": "1"})}
    except HostPidUnavailable as problem:
        return {"check": problem.check, "observed": problem.observed}


def _c_query(c_client: str, socket_path: str) -> dict:
    """
    The C contract client's one line (stdout on success, stderr on refusal)
    and its host PID, read while a barrier holds it: this pod keeps the
    host's procfs, where C{/proc/self} is this process's host entry and its
    C{children} name the client by its host PID.
    """
    if not c_client:
        return {}
    barrier_read, barrier_write = os.pipe()
    client = subprocess.Popen(
        [c_client, "--socket", socket_path, "--barrier-fd", str(barrier_read)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(barrier_read,),
        env={"LIBVGPU_HOSTPID_BROKER": "1"},
    )
    os.close(barrier_read)
    (task,) = os.listdir("/proc/self/task")
    with open(f"/proc/self/task/{task}/children", encoding="ascii") as children:
        host_pids = [int(pid) for pid in children.read().split()]
    os.close(barrier_write)
    out, err = client.communicate(timeout=30)
    return {"line": (out or err).strip(), "ns_pid": client.pid, "host_pids": host_pids}


def _doctor(socket_path: str) -> list[str]:
    import io

    from hostpid import cli

    out = io.StringIO()
    cli._doctor(type("Args", (), {"socket": socket_path})(), out, io.StringIO())
    return out.getvalue().splitlines()


def _fake_broker() -> dict:
    """The test double, run by the pod's root for its own tests: still answers."""
    from hostpid.client.blocking import HostPidUnavailable, query_host_pid
    from hostpid.testing import FakeBroker

    # What is tested is the rule's verdict on the double's listener, not how
    # fast it answers: in a kernel guest under emulation, on a loaded host, a
    # double answering from a thread of this very process can miss the
    # production deadline (0.5 s).  The double's documented way to allow a
    # slow answer is a longer deadline.
    with FakeBroker(pid=FAKE_PID, deadline=30.0) as broker:
        try:
            return {"pid": query_host_pid(broker.policy, broker.environ)}
        except HostPidUnavailable as problem:
            return {"check": problem.check, "observed": problem.observed}


def _listen_at(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(8)
    return listener


def _impersonate_on_tmpfs(target: str, socket_path: str, c_client: str) -> dict:
    """
    The pod's root, with CAP_SYS_ADMIN in its user namespace, mounts a
    tmpfs of its own over the broker's directory in the pod's (and so the
    client's) mount namespace, listens there and makes it read-only.
    """
    mount("tmpfs", target, "tmpfs", 0, "mode=0755")
    listener = _listen_at(socket_path)
    mount(None, target, None, MS_REMOUNT | MS_RDONLY)
    pid = os.fork()
    if pid == 0:
        _serve_fake(listener)
    listener.close()
    try:
        # The client is another process of the pod, as a workload is.
        return _in_child(lambda: {"query": _query(socket_path), "doctor": _doctor(socket_path),
                                  "c_query": _c_query(c_client, socket_path)})
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def _nobody(target: str, nobody_dir: str) -> dict:
    """
    The pod's nobody: cannot put a socket in the broker's directory, nor
    mount; a listener of its own in a directory it owns is refused.
    """
    found: dict = {}
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(os.path.join(target, "forged.sock"))
        found["bind"] = "bound"
    except OSError as error:
        found["bind"] = _error(error)
    probe.close()
    try:
        mount("tmpfs", target, "tmpfs", 0)
        found["mount"] = "mounted"
    except OSError as error:
        found["mount"] = _error(error)
    path = os.path.join(nobody_dir, "broker.sock")
    listener = _listen_at(path)
    pid = os.fork()
    if pid == 0:
        _serve_fake(listener)
    listener.close()
    try:
        found["query"] = _query(path)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.unlink(path)
    return found


def _remount_writable(target: str) -> dict:
    """
    The pod's root with CAP_SYS_ADMIN tries to make the broker mount
    writable and write through it (to the host's directory).
    """
    found: dict = {}
    try:
        mount(None, target, None, MS_REMOUNT | MS_BIND)
        found["remount"] = "writable"
    except OSError as error:
        found["remount"] = _error(error)
    name = os.path.join(target, "written-by-pod")
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        found["owner_here"] = os.fstat(fd).st_uid
        os.close(fd)
        found["write"] = "created"
    except OSError as error:
        found["write"] = _error(error)
    return found


def _load_client() -> None:
    """
    Import everything the pod's processes run before leaving the host's
    user namespace: as the pod's root they can no longer read an interpreter
    or a checkout under a 0700 directory (the host's root is not theirs).
    """
    import encodings.ascii  # noqa: F401
    import io  # noqa: F401

    from hostpid import cli, testing, wire  # noqa: F401
    from hostpid.client import blocking, mountpoint, trust, userns  # noqa: F401


def _lock_parent(lock_mount: str) -> dict:
    """
    The pod's root with no capability at all, on the lock parent mounted
    read-write and idmapped: the host's root-owned directories there show
    as its own.
    """
    drop_capabilities()
    found: dict = {"owner": os.stat(os.path.join(lock_mount, "hostpid")).st_uid}
    try:
        os.rmdir(os.path.join(lock_mount, "hostpid"))
        found["rmdir"] = "removed"
    except OSError as error:
        found["rmdir"] = _error(error)
    return found


def pod(directory: str, c_client: str = "") -> None:
    _load_client()
    target = os.path.join(directory, "mnt", "hostpid")
    socket_path = os.path.join(target, "broker.sock")
    unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID)
    # The pod's mounts must never reach the host's.
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    print(f"unshared {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go from the host")
    become(0)
    read, write = os.pipe()
    init = os.fork()
    if init == 0:
        # The pod's PID 1: the client runs here, and so the host PID it is
        # told must be the one its parent saw fork return.
        os.close(read)
        result = {
            "ns_pid": os.getpid(),
            "uid_map": open("/proc/self/uid_map", encoding="ascii").read().split(),
            "query": _query(socket_path),
            "c_query": _c_query(c_client, socket_path),
            "doctor": _doctor(socket_path),
            "nobody": _in_child(lambda: _nobody(target, os.path.join(directory, "nobody")),
                                uid=NOBODY),
            "remount": _in_child(lambda: _remount_writable(target)),
        }
        result["tmpfs"] = _in_child(lambda: _impersonate_on_tmpfs(target, socket_path, c_client))
        result["fake_broker"] = _in_child(_fake_broker)
        lock_mount = os.path.join(directory, "mnt", "lock")
        if os.path.isdir(os.path.join(lock_mount, "hostpid")):
            result["lock_parent"] = _in_child(lambda: _lock_parent(lock_mount))
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 20):
        data += chunk
    os.waitpid(init, 0)
    result = json.loads(data)
    result["host_pid"] = init
    print(json.dumps(result), flush=True)


def neighbour(role: str, target: str) -> None:
    """
    One of two pods on one node, each with its own user namespace and its
    own broker mount of the same host directory.  The C{forger} (root with
    CAP_SYS_ADMIN in its user namespace) makes its broker mount writable,
    replaces the broker's socket in the host's directory with its own and
    serves a forged PID until told to stop; the C{asker} asks.
    """
    _load_client()
    unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    print(f"unshared {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go from the host")
    become(0)
    init = os.fork()
    if init == 0:
        socket_path = os.path.join(target, "broker.sock")
        if role == "asker":
            print(json.dumps({"query": _query(socket_path)}), flush=True)
            os._exit(0)
        steps: dict = {}
        try:
            mount(None, target, None, MS_REMOUNT | MS_BIND)
            steps["remount"] = "writable"
            os.unlink(socket_path)
            steps["unlink"] = "done"
            listener = _listen_at(socket_path)
            steps["listen"] = "done"
        except OSError as error:
            steps["error"] = _error(error)
            print(json.dumps(steps), flush=True)
            os._exit(0)
        server = os.fork()
        if server == 0:
            _serve_fake(listener)
        print(json.dumps(steps), flush=True)
        sys.stdin.readline()
        os.kill(server, 9)
        os._exit(0)
    os.waitpid(init, 0)


def main(argv: list[str]) -> None:
    if argv[0] == "pod":
        pod(*argv[1:3])
    elif argv[0] == "neighbour":
        neighbour(argv[1], argv[2])
    elif argv[0] == "mount":
        make_broker_mount(int(argv[1]), argv[2], argv[3], argv[4])
        if len(argv) > 5:
            # The lock parent, read-write, mounted the same way (a second
            # detached tree, then into the namespace this helper is in now).
            make_lock_mount(argv[5], argv[6], argv[4], int(argv[1]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
