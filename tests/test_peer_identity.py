"""
Issue 20: the C{peer-pid} and C{sandbox} checks, and the words C{doctor}
finds for each compatibility cell.

The listener that is the caller itself is made for real: a scripted broker
whose socket this very process C{listen()}s on, so the kernel reports this
process as the listener, which is what gVisor's sentry reports to a client
of a host socket.  Every optional check is turned off, as a caller may
("for tests and unusual nodes"): C{peer-pid} must still refuse, in the
blocking client, the Twisted client and C{hostpid doctor}.  The judgements
themselves are pure functions, tested on the values each runtime reports
(those of gVisor were measured under Debian's C{runsc}; see
C{docs/compatibility.md}).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import pytest_twisted  # type: ignore[import-untyped]
from clienttools import build_c_client, fake_broker, make_directory, response
from support import subprocess_env, wait_for

from hostpid import cli
from hostpid.client import blocking as client
from hostpid.client import peerpid, sandbox, txclient, userns
from hostpid.peercred import PeerCredentials

ENABLED = {"LIBVGPU_HOSTPID_BROKER": "1"}
EVERY_OPTIONAL_CHECK_OFF = tuple(sorted(client.OPTIONAL_CHECKS))


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return make_directory(tmp_path / "hostpid")


def loosest(directory: Path) -> client.TrustPolicy:
    """Every check a caller can turn off, turned off by name."""
    return client.TrustPolicy(socket_path=str(directory / "broker.sock")).without(
        *EVERY_OPTIONAL_CHECK_OFF
    )


# --- The caller itself as the listener, for real. ---


def test_listener_that_is_the_caller_is_refused_with_every_optional_check_off(
    directory: Path,
) -> None:
    with fake_broker(directory, response(pid=4242), listen_here=True) as broker:
        with pytest.raises(client.HostPidUnavailable) as caught:
            client.query_host_pid(loosest(directory), ENABLED)
        assert client.lookup_host_pid(loosest(directory), ENABLED) is None
        wait_for(lambda: len(broker.requests) == 2, "the broker to read both connections")
    assert caught.value.check == "peer-pid"
    assert caught.value.observed.startswith(f"pid {os.getpid()} is this process itself: ")
    assert "sandboxed runtime" in caught.value.observed
    assert broker.requests == [b"", b""], "refused before a byte of the request was sent"


def test_the_same_listener_from_another_process_is_trusted(directory: Path) -> None:
    """Control: only who listened differs, and the answer is then believed."""
    with fake_broker(directory, response(pid=4242)) as broker:
        assert client.query_host_pid(loosest(directory), ENABLED) == 4242
    assert broker.listener_pid != os.getpid()


LISTEN_THEN_EXEC = (
    "import os, socket, sys\n"
    "listener = socket.socket(socket.AF_UNIX)\n"
    "listener.bind(sys.argv[1])\n"
    "listener.listen(8)\n"
    "os.set_inheritable(listener.fileno(), True)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


#: The Python client, read-only-mount turned off by name (a tmp directory).
PYTHON_QUERY = (
    "import sys\n"
    "from hostpid import HostPidUnavailable, TrustPolicy, query_host_pid\n"
    "try:\n"
    "    print(query_host_pid(TrustPolicy(sys.argv[1]).without('read-only-mount')))\n"
    "except HostPidUnavailable as problem:\n"
    "    sys.exit(f'{problem}')\n"
)


@pytest.mark.parametrize("which", ["c", "python"])
def test_a_program_that_inherited_its_own_listener_refuses_it(
    directory: Path, tmp_path: Path, which: str
) -> None:
    """
    A process listens on the broker's path and then becomes the client
    (C{exec}: the same PID), so the kernel names the client itself as the
    listener: the C contract client and C{hostpid query} both refuse with
    C{peer-pid} before sending a byte.  (Before, both sent the request and
    waited out their deadline.)
    """
    socket_path = str(directory / "broker.sock")
    if which == "c":
        client_argv = [str(build_c_client(tmp_path)), "--socket", socket_path,
                       "--without", "read-only-mount"]
        expected = "hostpid_client: peer-pid: pid "
    else:
        client_argv = [sys.executable, "-c", PYTHON_QUERY, socket_path]
        expected = "peer-pid: pid "
    env = subprocess_env(LIBVGPU_HOSTPID_BROKER="1")
    result = subprocess.run(
        [sys.executable, "-c", LISTEN_THEN_EXEC, socket_path, *client_argv],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(expected), result.stderr
    assert "is this process itself" in result.stderr


def test_listener_that_is_a_thread_of_the_caller_is_refused() -> None:
    caller = peerpid.CallerProcess(pid=100, pid_namespace=5, threads=frozenset({100, 101}))
    problem = peerpid.peer_pid_problem(101, caller)
    assert problem is not None and problem.startswith("pid 101 is a thread of this process")


@pytest_twisted.ensureDeferred
async def test_twisted_client_refuses_the_caller_as_listener(
    directory: Path, clean_reactor: None
) -> None:
    with fake_broker(directory, response(pid=4242), listen_here=True) as broker:
        with pytest.raises(client.HostPidUnavailable) as caught:
            await txclient.query_host_pid_deferred(loosest(directory), ENABLED)
        assert await txclient.lookup_host_pid_deferred(loosest(directory), ENABLED) is None
        wait_for(lambda: len(broker.requests) == 2, "the broker to read both connections")
    assert caught.value.check == "peer-pid"
    assert broker.requests == [b"", b""]


def test_doctor_names_the_sandboxed_runtime(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "1")
    with fake_broker(directory, response(pid=4242), listen_here=True) as broker:
        out = io.StringIO()
        status = cli.main(["doctor", "--socket", str(broker.path)], out, io.StringIO())
        wait_for(lambda: len(broker.requests) == 1, "the broker to read the connection")
    lines = {line.split()[0]: line for line in out.getvalue().splitlines()}
    assert status == 1
    assert lines["peer-pid"].startswith(
        f"peer-pid FAIL {broker.path}: pid {os.getpid()} is this process itself: "
        "sandboxed runtime"
    )
    assert lines["peer-uid"] == f"peer-uid ok uid 0 (pid {os.getpid()})"
    assert lines["reply"] == "reply FAIL not tried: peer-pid failed"
    assert broker.requests == [b""]


def test_probe_refuses_a_listener_that_is_the_prober(directory: Path) -> None:
    """
    C{hostpid probe} passes when the broker names the probing process: a
    listener in the prober itself, answering the prober's own PID, is the
    one answer that proves nothing (the old probe called it healthy).
    """
    with fake_broker(directory, response(pid=os.getpid()), listen_here=True):
        with pytest.raises(client.HostPidUnavailable) as caught:
            client.probe(str(directory / "broker.sock"), environ=ENABLED)
    assert caught.value.check == "peer-pid"
    other = make_directory(directory.parent / "other")
    with fake_broker(other, response(pid=os.getpid())):
        report = client.probe(str(other / "broker.sock"), environ=ENABLED)
    assert report.pid == os.getpid(), "control: listened from another process, it passes"


def test_peer_pid_cannot_be_turned_off() -> None:
    with pytest.raises(ValueError, match="'peer-pid' check cannot be turned off"):
        client.TrustPolicy().without("peer-pid")
    with pytest.raises(ValueError, match="'sandbox' check cannot be turned off"):
        client.TrustPolicy().without("sandbox")


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
        (100, HOST_NS, "pid 100 is this process itself"),
        (-1, HOST_NS, "pid -1 is not a PID"),
        (0, OSError(2, "No such file or directory"), None),
        (7, OSError(2, "No such file or directory"), "pid 7: cannot tell whether the listener"),
    ],
)
def test_peer_pid_rule(pid: int, namespace: int | OSError, refused: str | None) -> None:
    caller = peerpid.CallerProcess(pid=100, pid_namespace=namespace, threads=frozenset({100}))
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
        assert peerpid.peer_pid_problem(seen[0], caller) is not None
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
