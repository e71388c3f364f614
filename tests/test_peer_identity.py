"""
The C{peer-pid} and C{sandbox} checks (which keep a sandboxed runtime's
answer, the gofer's PID, from being believed), and the words C{doctor}
finds for each compatibility cell.

The judgements are pure functions, tested here on the values each runtime
reports (gVisor's measured under Debian's C{runsc}; see
C{docs/compatibility.md}), and on this machine, in the host PID namespace,
where a listener in the caller's own process is a broker embedded in it.
The listener that is the caller itself inside a private PID namespace (what
gVisor reports) is made for real in
C{tests/integration/test_peer_in_pid_namespace.py}, and every runtime cell in
C{tests/e2e/test_compatibility.py}.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from clienttools import fake_broker, make_directory, response

from hostpid.client import blocking as client
from hostpid.client import peerpid, sandbox, userns
from hostpid.peercred import PeerCredentials

ENABLED = {"LIBVGPU_HOSTPID_BROKER": "1"}


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return make_directory(tmp_path / "hostpid")


# --- In the host PID namespace: a broker embedded in the caller. ---


def test_a_listener_in_the_caller_is_trusted_in_the_host_pid_namespace(directory: Path) -> None:
    """
    Here (the host PID namespace) the listener that is this very process is
    a broker embedded in it (C{docs/examples/broker-with-web.tac}): the
    kernel's word, trusted.  The same in a private PID namespace is refused:
    C{tests/integration/test_peer_in_pid_namespace.py}.
    """
    assert peerpid.this_process().in_host_pid_namespace
    policy = client.TrustPolicy(socket_path=str(directory / "broker.sock")).without(
        "read-only-mount"
    )
    with fake_broker(directory, response(pid=os.getpid())):
        assert client.query_host_pid(policy, ENABLED) == os.getpid()
        [result] = [r for r in client.doctor(policy, ENABLED) if r.name == "peer-pid"]
    assert result.ok
    assert result.observed == (
        f"pid {os.getpid()}: this process, in the host PID namespace (a broker embedded in it)"
    )


def test_only_peer_pid_of_the_new_checks_can_be_turned_off_and_only_by_name() -> None:
    with pytest.raises(ValueError, match="'sandbox' check cannot be turned off"):
        client.TrustPolicy().without("sandbox")
    assert not client.TrustPolicy().without("peer-pid").enforces("peer-pid")
    assert client.TrustPolicy().without("read-only-mount").enforces("peer-pid")
    assert client.STRICT.enforces("peer-pid") and client.STRICT.enforces("sandbox")


# --- The rule, over what each place reports. ---

HOST_NS = peerpid.PROC_PID_INIT_INO
CONTAINER_NS = 4026532500


@pytest.mark.parametrize(
    ("pid", "namespace", "refused"),
    [
        (0, CONTAINER_NS, None),  # a container: the broker is outside, PID 0
        (4321, HOST_NS, None),  # the host or a hostPID pod: the broker's own PID
        (0, HOST_NS, "pid 0 in the host PID namespace"),
        (7, CONTAINER_NS, "pid 7 is inside this process's PID namespace pid:[4026532500]"),
        (100, CONTAINER_NS, "pid 100 is this process itself"),  # gVisor
        (101, CONTAINER_NS, "pid 101 is a thread of this process"),
        (100, HOST_NS, None),  # a broker embedded in this process
        (100, OSError(2, "No such file or directory"), "pid 100 is this process itself"),
        (-1, HOST_NS, "pid -1 is not a PID"),
        (0, OSError(2, "No such file or directory"), None),
        (7, OSError(2, "No such file or directory"), "pid 7: cannot tell whether the listener"),
    ],
)
def test_peer_pid_rule(pid: int, namespace: int | OSError, refused: str | None) -> None:
    caller = peerpid.CallerProcess(
        pid=100, pid_namespace=namespace, threads=frozenset({100, 101})
    )
    problem = peerpid.peer_pid_problem(pid, caller)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(refused), problem


def test_this_process_is_read_from_the_kernel() -> None:
    caller = peerpid.this_process()
    assert caller.pid == os.getpid()
    assert caller.pid_namespace == os.stat("/proc/self/ns/pid").st_ino
    seen: list[int] = []
    ready, done = threading.Event(), threading.Event()

    def hold() -> None:
        seen.append(threading.get_native_id())
        ready.set()
        done.wait(10)

    worker = threading.Thread(target=hold)
    worker.start()
    try:
        assert ready.wait(10)
        assert caller.has_thread(seen[0]), "a live thread of ours, from /proc/self/task"
        in_a_container = caller.replace(pid_namespace=CONTAINER_NS)
        problem = peerpid.peer_pid_problem(seen[0], in_a_container)
        assert problem is not None and "is a thread of this process" in problem
    finally:
        done.set()
        worker.join()
    assert not caller.has_thread(1), "PID 1 is not a thread of a test process"


def test_credentials_that_cannot_be_read_fail_peer_pid() -> None:
    result = client.check_peer_pid(OSError(9, "Bad file descriptor"))
    assert (result.name, result.ok) == ("peer-pid", False)
    assert client.check_peer_pid(PeerCredentials(0, 0, 0), peerpid.CallerProcess(
        pid=1, pid_namespace=CONTAINER_NS)).ok


# Measured under Debian's runsc 20221219 (uname and fstatfs of the broker
# directory), and what gVisor's source gives from 2026 (LinuxRelease).
GVISOR_2022 = sandbox.SandboxSignals("4.4.0", "#1 SMP Sun Jan 10 15:06:54 PST 2016", 0x01021997)
GVISOR_2026 = sandbox.SandboxSignals("4.19.0-gvisor", "#1 SMP PREEMPT_DYNAMIC", None)
NINE_P = sandbox.SandboxSignals("6.1.0-13-amd64", "#1 SMP PREEMPT_DYNAMIC Debian", 0x01021997)
HOST = sandbox.SandboxSignals("6.1.0-13-amd64", "#1 SMP PREEMPT_DYNAMIC Debian", 0x01021994)


@pytest.mark.parametrize(
    ("signals", "named"),
    [
        (GVISOR_2022, "gVisor (runsc) detected"),
        (GVISOR_2026, "gVisor (runsc) detected"),
        (NINE_P, "the broker directory is on a 9p filesystem"),
        (HOST, None),
    ],
)
def test_sandbox_rule(signals: sandbox.SandboxSignals, named: str | None) -> None:
    result = client.check_sandbox(signals)
    assert result.name == "sandbox"
    if named is None:
        assert result.ok and result.observed.startswith("not sandboxed: kernel 6.1.0-13-amd64")
    else:
        assert not result.ok
        assert result.observed.startswith(named) and "sandboxed runtime" in result.observed


def test_sandbox_signals_of_this_machine(directory: Path) -> None:
    fd = os.open(directory, os.O_PATH | os.O_CLOEXEC)
    try:
        signals = sandbox.read_signals(fd)
    finally:
        os.close(fd)
    assert signals.kernel_release == os.uname().release
    assert signals.mount_type is not None and signals.mount_type != sandbox.V9FS_MAGIC
    assert client.check_sandbox(signals).ok


def test_overflow_owner_in_the_initial_user_namespace_gets_no_hint() -> None:
    """Here (no user namespace) a 65534 owner is just a wrong owner."""
    assert userns.in_user_namespace() is False
    assert userns.owner_hint(65534) == ""
