"""
The start-time rule of the liveness check without SO_PEERPIDFD, with real
processes: a process that started after the recorded accept time is refused,
one that started before it is not, to the clock tick.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import accepted_from_exited_child, wait_for
from twisted.logger import Logger

from hostpid.peercred import LivenessCheck, PeerCredentialsFailed, PeerGone, PeerIdentifier
from hostpid.starttime import (
    TICK_NS,
    boottime_ns,
    proc_shows_own_namespace,
    start_ticks,
    started_after,
)

pytestmark = pytest.mark.kernel


def next_tick_after(accepted: int) -> None:
    """Wait (bounded) until CLOCK_BOOTTIME is past the tick C{accepted} falls in."""
    wait_for(
        lambda: boottime_ns() // TICK_NS > accepted // TICK_NS,
        "the next clock tick", timeout=1.0,
    )


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process that lives until the test ends."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    yield child
    assert child.stdin is not None
    child.stdin.close()
    child.wait(timeout=10)


def test_start_ticks_agree_with_the_clock() -> None:
    """Our own start is in the past, on the same clock and in the same unit."""
    assert 0 < start_ticks(os.getpid()) <= boottime_ns() // TICK_NS
    assert proc_shows_own_namespace()


def test_start_ticks_parse_a_command_name_with_spaces_and_parentheses() -> None:
    name = "a) b (c) 1 2"
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys\n"
         f"open('/proc/self/comm', 'w').write({name!r})\n"
         "print(flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdout.readline()
        assert Path(f"/proc/{child.pid}/comm").read_text() == name + "\n"
        fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert start_ticks(child.pid) == int(fields[22 - 3])
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_start_ticks_of_no_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        start_ticks(child.pid)


def test_process_started_after_the_accept_time_is_refused() -> None:
    """
    The rule itself, deterministic: the accept time is recorded, the clock
    moves to the next tick, and only then does a real process start.  It is
    refused by the rule and by the identifier (the peer of a real connection);
    this process, started long before, is not.
    """
    accepted = boottime_ns()
    next_tick_after(accepted)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # The child connects for real: a socket of its own to our listener.
    path = f"/tmp/hostpid-starttime-{os.getpid()}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import socket, sys\n"
             "s = socket.socket(socket.AF_UNIX)\n"
             f"s.connect({path!r})\n"
             "sys.stdin.read()\n"],
            stdin=subprocess.PIPE,
        )
        connection, _ = listener.accept()
    finally:
        listener.close()
        os.unlink(path)
    try:
        assert started_after(child.pid, accepted) is True
        assert started_after(os.getpid(), accepted) is False
        identifier = PeerIdentifier(check=LivenessCheck.PIDFD_OPEN)
        assert identifier.check is LivenessCheck.PIDFD_OPEN
        # Allowing for the time the PID space takes to cycle, a process that
        # started so soon after the bound cannot have taken a PID another
        # left since: answered.
        identifier.pidCycleNs = 10 * 10**9
        assert identifier.host_pid(connection, accepted) == child.pid
        # With no allowance (where pid_max cannot be read): refused.
        identifier.pidCycleNs = 0
        with pytest.raises(PeerGone, match="started after the connection could have been made"):
            identifier.host_pid(connection, accepted)
        # The same connection, with its true accept time (now): answered.
        assert identifier.host_pid(connection, boottime_ns()) == child.pid
        # And our own connection, whatever accept time after our start.
        assert identifier.host_pid(left, accepted) == os.getpid()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
        connection.close()
        left.close()
        right.close()


def test_process_started_in_the_accept_tick_is_not_refused(sleeper) -> None:
    """The rule errs towards answering within the tick, never towards refusing the caller."""
    started = start_ticks(sleeper.pid)
    assert started_after(sleeper.pid, started * TICK_NS) is False
    assert started_after(sleeper.pid, started * TICK_NS - 1) is True


def test_pidfd_open_check_refuses_an_exited_peer(tmp_path: Path) -> None:
    connection = accepted_from_exited_child(tmp_path / "s")
    with connection:
        with pytest.raises(PeerGone, match="since exited"):
            PeerIdentifier(check=LivenessCheck.PIDFD_OPEN).host_pid(connection, boottime_ns())


def refused(pid: int) -> int:
    raise OSError(errno.EPERM, os.strerror(errno.EPERM))


def test_refused_pidfd_open_falls_back_to_so_peercred_alone_and_says_so_once(pair) -> None:
    """
    A seccomp filter that refuses pidfd_open (simulated: the call is
    injected) on a kernel without SO_PEERPIDFD: SO_PEERCRED alone, logged
    once, and the check named C{none} for the metrics.
    """

    def no_pidfd(sock: socket.socket) -> int:
        raise OSError(errno.ENOPROTOOPT, os.strerror(errno.ENOPROTOOPT))

    events: list[dict] = []
    identifier = PeerIdentifier(peerPidfd=no_pidfd, pidfdOpen=refused)
    identifier.log = Logger(observer=events.append)
    for _ in range(3):
        assert identifier.host_pid(pair[0]) == os.getpid()
    assert identifier.check is LivenessCheck.NONE
    assert identifier.acceptClock is None
    assert len(events) == 1
    assert "pidfd_open is refused" in events[0]["log_format"]
    assert events[0]["error"] == "EPERM"


def test_forced_pidfd_open_where_it_is_refused_is_none() -> None:
    identifier = PeerIdentifier(check=LivenessCheck.PIDFD_OPEN, pidfdOpen=refused)
    assert identifier.check is LivenessCheck.NONE
    assert isinstance(identifier.pidfdOpenRefused, PermissionError)


def test_pidfd_open_failing_after_the_probe_refuses_the_peer(pair) -> None:
    calls = []

    def fails_later(pid: int) -> int:
        calls.append(pid)
        if len(calls) == 1:
            return os.pidfd_open(pid)
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    identifier = PeerIdentifier(check=LivenessCheck.PIDFD_OPEN, pidfdOpen=fails_later)
    with pytest.raises(PeerCredentialsFailed, match="pidfd_open"):
        identifier.host_pid(pair[0])
