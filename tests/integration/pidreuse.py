"""
A real PID reuse, made on purpose: run as PID 1 of a new PID namespace with
its own C{/proc} (C{unshare --pid --fork --mount-proc}), where
C{/proc/sys/kernel/ns_last_pid} chooses the next PID.

A client process connects to a listener here and exits; it is reaped; then
another process is started with the very same PID.  The server side of the
connection is then shown to L{PeerIdentifier} with each liveness check, and
what each answered is printed as one JSON line.

  - C{after-accept}: the connection is accepted (and the accept time read)
    while the client lives; the PID is reused one clock tick later.
  - C{before-accept}: the PID is reused before the connection is accepted
    (the window that the check without SO_PEERPIDFD leaves open).

Usage: pidreuse.py (after-accept|before-accept)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time

from hostpid.peercred import LivenessCheck, PeerGone, PeerIdentifier, PeerUnverified
from hostpid.starttime import TICK_NS, boottime_ns


def fork_with_pid(pid: int) -> int:
    """Start a process that waits on a pipe, with PID C{pid}; return the pipe to end it."""
    with open("/proc/sys/kernel/ns_last_pid", "w") as last:
        last.write(str(pid - 1))
    stop_read, stop_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(stop_write)
        os.read(stop_read, 1)
        os._exit(0)
    os.close(stop_read)
    if child != pid:
        raise SystemExit(f"wanted PID {pid}, got {child}")
    return stop_write


def client_that_exits(path: str) -> int:
    """A process that connects to C{path} and exits at once (not reaped yet)."""
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        os._exit(0)
    return child


def next_tick() -> None:
    now = boottime_ns() // TICK_NS
    deadline = time.monotonic() + 1
    while boottime_ns() // TICK_NS <= now:
        if time.monotonic() > deadline:
            raise SystemExit("CLOCK_BOOTTIME did not move")
        time.sleep(0.001)


def verdict(identifier: PeerIdentifier, connection: socket.socket, accepted: int) -> object:
    try:
        return identifier.host_pid(connection, accepted)
    except PeerGone:
        return "peer_gone"
    except PeerUnverified:
        return "peer_credentials_failed"


def main(case: str) -> None:
    assert os.getpid() == 1, "run as PID 1 of a new PID namespace"
    directory = tempfile.mkdtemp(prefix="hostpid-pidreuse-")
    path = os.path.join(directory, "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    try:
        listener.listen(1)
        client = client_that_exits(path)
        run(case, listener, client)
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(directory)


def run(case: str, listener: socket.socket, client: int) -> None:
    if case == "after-accept":
        connection, _ = listener.accept()
        accepted = boottime_ns()
        os.waitpid(client, 0)
        next_tick()
        stop = fork_with_pid(client)
    else:
        os.waitpid(client, 0)
        stop = fork_with_pid(client)
        connection, _ = listener.accept()
        accepted = boottime_ns()
    checks: dict[str, object] = {}
    for check in LivenessCheck:
        identifier = PeerIdentifier(check=None if check is LivenessCheck.PEERPIDFD else check)
        # The reuse here is chosen with ns_last_pid (root), not made by
        # cycling the PID space as a tenant must: no allowance for a cycle.
        identifier.pidCycleNs = 0
        checks[check.value] = verdict(identifier, connection, accepted)
        if check is LivenessCheck.PEERPIDFD:
            checks["peerpidfd_in_force"] = identifier.check is LivenessCheck.PEERPIDFD
    without = PeerIdentifier(check=LivenessCheck.PIDFD_OPEN)
    without.startTimes = False
    without.pidCycleNs = 0
    checks["pidfd_open_without_start_time"] = verdict(without, connection, accepted)
    print(json.dumps({"reused_pid": client, "checks": checks}), flush=True)
    os.close(stop)
    os.wait()


if __name__ == "__main__":
    main(sys.argv[1])
