"""
Peer identification on real sockets: SO_PEERCRED, SO_PEERPIDFD, and the
fallback when the kernel has no SO_PEERPIDFD.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
from pathlib import Path

import pytest
from kernelfeatures import kernel_feature
from support import accepted_from_exited_child, in_child, require_root
from twisted.logger import Logger

from hostpid.peercred import (
    LivenessCheck,
    PeerCredentialsFailed,
    PeerGone,
    PeerIdentifier,
    peer_credentials,
    peer_pidfd,
    pidfd_alive,
    pidfd_current_pid,
)

pytestmark = pytest.mark.kernel


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_credentials_of_a_socketpair_are_ours(pair) -> None:
    credentials = peer_credentials(pair[0])
    assert (credentials.pid, credentials.uid, credentials.gid) == (
        os.getpid(), os.getuid(), os.getgid(),
    )


@kernel_feature("SO_PEERPIDFD")
def test_pidfd_names_the_peer(pair) -> None:
    pidfd = peer_pidfd(pair[0])
    try:
        assert pidfd_current_pid(pidfd) == os.getpid()
    finally:
        os.close(pidfd)


@kernel_feature("SO_PEERPIDFD")
def test_identifier_vouches_for_a_live_peer_and_leaks_no_descriptor(pair) -> None:
    identifier = PeerIdentifier()
    before = fds()
    for _ in range(100):
        assert identifier.host_pid(pair[0]) == os.getpid()
    assert fds() == before, "every pidfd is closed"
    assert identifier.pidfdSupported is True


@kernel_feature("SO_PEERPIDFD")
@pytest.mark.parametrize("signalCheck", [True, False], ids=["pidfd_send_signal", "ioctl"])
def test_peer_that_exited_is_not_vouched_for(tmp_path: Path, signalCheck: bool) -> None:
    """Both liveness tests: signal 0 (the default here) and the pidfd's current PID."""
    connection = accepted_from_exited_child(tmp_path / "s")
    identifier = PeerIdentifier()
    assert identifier.signalCheck is True, "pidfd_send_signal usable on this kernel"
    identifier.signalCheck = signalCheck
    with connection:
        with pytest.raises(PeerGone):
            identifier.host_pid(connection)


@kernel_feature("SO_PEERPIDFD")
def test_a_live_peer_the_broker_may_not_signal_is_still_vouched_for(pair) -> None:
    """
    C{pidfd_send_signal(pidfd, 0)} answers C{EPERM} for a process the caller
    may not signal: it exists, so its PID is still its own.  Here the
    identifier runs as UID 1000 and its peer is this (root) process.
    """
    require_root()
    server, _client = pair

    def work() -> int:
        pidfd = peer_pidfd(server)
        try:
            signal.pidfd_send_signal(pidfd, 0)
        except PermissionError:
            pass
        else:
            return -2  # no EPERM: the case is not the one this test is about
        finally:
            os.close(pidfd)
        return PeerIdentifier().host_pid(server)

    _, answered = in_child(work, uid=1000)
    assert answered == os.getpid()


def test_pidfd_alive_tells_a_live_process_from_a_reaped_one() -> None:
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os._exit(0)
    pidfd = os.pidfd_open(child)
    try:
        os.waitpid(child, 0)
        assert pidfd_alive(pidfd) is False
    finally:
        os.close(pidfd)
    own = os.pidfd_open(os.getpid())
    try:
        assert pidfd_alive(own) is True
    finally:
        os.close(own)


def test_without_pidfd_the_exited_peer_would_be_answered(tmp_path: Path) -> None:
    """The control: SO_PEERCRED alone still reports the dead client's PID."""
    connection = accepted_from_exited_child(tmp_path / "s")
    with connection:
        assert PeerIdentifier(check=LivenessCheck.NONE).host_pid(connection) > 0


def test_closed_socket_is_a_credentials_failure(pair) -> None:
    pair[0].close()
    with pytest.raises(PeerCredentialsFailed):
        PeerIdentifier().host_pid(pair[0])


def test_kernel_without_so_peerpidfd_falls_back_and_says_so_once(pair) -> None:
    """
    Simulates a kernel before 6.5: SO_PEERPIDFD fails with ENOPROTOOPT.  The
    peer is still served from SO_PEERCRED, the fallback is logged once, and
    the option is not asked for again.
    """
    calls = []

    def no_pidfd(sock: socket.socket) -> int:
        calls.append(sock)
        raise OSError(errno.ENOPROTOOPT, os.strerror(errno.ENOPROTOOPT))

    events: list[dict] = []
    identifier = PeerIdentifier(peerPidfd=no_pidfd)
    identifier.log = Logger(observer=events.append)
    for _ in range(5):
        assert identifier.host_pid(pair[0]) == os.getpid()
    assert identifier.pidfdSupported is False
    assert len(calls) == 1
    assert len(events) == 1
    assert "no SO_PEERPIDFD" in events[0]["log_format"]


def test_other_pidfd_errors_refuse_the_peer(pair) -> None:
    def broken(sock: socket.socket) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    with pytest.raises(PeerCredentialsFailed, match="SO_PEERPIDFD"):
        PeerIdentifier(peerPidfd=broken).host_pid(pair[0])


def test_so_peerpidfd_einval_of_a_reaped_peer_is_peer_gone(pair) -> None:
    """
    Linux 6.5-6.15 answer SO_PEERPIDFD for a peer that exited and was reaped
    with EINVAL (pidfd_prepare() finds no thread-group task on its struct
    pid); 6.16 and later return a pidfd, which the liveness question then
    finds gone.  Simulated here (this kernel returns a pidfd): the outcome is
    peer_gone, not a credentials failure, and SO_PEERPIDFD is known to be in
    force (a kernel without it says ENOPROTOOPT).
    """
    from hostpid import wire
    from hostpid.broker.server import Outcome, answer

    def reaped(sock: socket.socket) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    identifier = PeerIdentifier(peerPidfd=reaped)
    with pytest.raises(PeerGone, match="reaped"):
        identifier.host_pid(pair[0])
    assert identifier.check is LivenessCheck.PEERPIDFD
    assert identifier.acceptClock is None
    assert answer(wire.GET_HOST_PID_REQUEST, pair[0], identifier) == (Outcome.PEER_GONE, None)


@pytest.mark.parametrize("error", [errno.ENODATA, errno.ESRCH, errno.ENOENT, errno.EMFILE])
def test_other_so_peerpidfd_errors_stay_credentials_failures(pair, error: int) -> None:
    """Only the errno a release gives for a reaped peer is mapped; ENODATA is "no peer"."""

    def failing(sock: socket.socket) -> int:
        raise OSError(error, os.strerror(error))

    with pytest.raises(PeerCredentialsFailed, match="SO_PEERPIDFD"):
        PeerIdentifier(peerPidfd=failing).host_pid(pair[0])


def test_fallback_check_is_pidfd_open_and_named(pair) -> None:
    """Without SO_PEERPIDFD the identifier moves to pidfd_open, and asks for accept times."""

    def no_pidfd(sock: socket.socket) -> int:
        raise OSError(errno.ENOPROTOOPT, os.strerror(errno.ENOPROTOOPT))

    identifier = PeerIdentifier(peerPidfd=no_pidfd)
    assert identifier.check is None and identifier.acceptClock is not None
    assert identifier.host_pid(pair[0]) == os.getpid()
    assert identifier.check is LivenessCheck.PIDFD_OPEN
    assert identifier.acceptClock is not None
    assert PeerIdentifier().host_pid(pair[0]) == os.getpid()


@pytest.mark.parametrize("check", [None, LivenessCheck.PIDFD_OPEN], ids=["best", "pidfd_open"])
def test_connector_gone_tells_an_exited_connector_from_a_live_one(
    tmp_path: Path, pair, check: LivenessCheck | None
) -> None:
    """
    What the waiting room asks of connections when every slot is held: the
    best check the kernel has, or C{pidfd_open} as before Linux 6.5.
    """
    identifier = PeerIdentifier(check=check)
    with accepted_from_exited_child(tmp_path / "s") as connection:
        assert identifier.connector_gone(connection) is True
    assert identifier.connector_gone(pair[0]) is False


def test_connector_gone_cannot_tell_without_a_liveness_check(tmp_path: Path) -> None:
    identifier = PeerIdentifier(check=LivenessCheck.NONE)
    with accepted_from_exited_child(tmp_path / "s") as connection:
        assert identifier.connector_gone(connection) is False


@pytest.mark.parametrize("check", [LivenessCheck.PEERPIDFD, LivenessCheck.PIDFD_OPEN])
def test_a_connector_whose_pid_names_no_process_is_gone_without_a_pidfd(
    tmp_path: Path, check: LivenessCheck
) -> None:
    """
    Under a PID spray every newcomer's connector is reaped: C{kill(pid, 0)}
    failing with C{ESRCH} proves it gone for 0.65 us, where the check in
    force made a pidfd first (C{SO_PEERPIDFD}: 4.2 us measured), on the
    path that must shed connections faster than the attacker makes them.
    """

    armed = False

    def no_pidfd(target: object) -> int:
        if armed:
            raise AssertionError("a pidfd was made")
        return os.pidfd_open(target) if isinstance(target, int) else peer_pidfd(target)

    identifier = PeerIdentifier(check=check, peerPidfd=no_pidfd, pidfdOpen=no_pidfd)
    armed = True
    with accepted_from_exited_child(tmp_path / "s") as connection:
        assert identifier.connector_gone(connection) is True
