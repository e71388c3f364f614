"""
The listening port's accept loop, deterministically: resource errors back
off 5 ms doubling to 1 s and recover; other errors are fatal; the log stays
quiet.  A MemoryReactorClock drives time; the listening "socket" is a stand-in
that raises the accept errors the kernel would.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator

import pytest
from support import WAIT_SECONDS
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid import wire
from hostpid.broker.connections import SOCKETS
from hostpid.broker.descriptors import SCM_MAX_FD, BackgroundCloser, PassedDescriptors
from hostpid.broker.fsrules import open_broker_directory
from hostpid.broker.port import (
    BACKOFF_INITIAL,
    BACKOFF_MAX,
    PAUSE_REPORTED_AFTER,
    PAUSE_RESOURCES,
    BrokerPort,
)
from hostpid.broker.server import BrokerFactory, Outcome
from hostpid.peercred import LivenessCheck, PeerIdentifier

pytestmark = pytest.mark.kernel


#: Scripted as an accept: a connection whose request has not arrived.
IDLE = -1


def closed(client: socket.socket) -> bool:
    """Whether the broker has closed the other end of C{client} (never blocks)."""
    try:
        return client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


class ScriptedListener:
    """A listening socket whose accept() fails or succeeds as scripted."""

    def __init__(self) -> None:
        self.errors: list[int] = []
        self.clients: list[socket.socket] = []
        #: At each accept of a connection, how many earlier ones were closed.
        self.closedBeforeAccept: list[int] = []

    def _accept(self) -> tuple[int, str]:
        """What the broker calls: the C-level accept, returning a descriptor."""
        if self.errors:
            code = self.errors.pop(0)
            if code in (0, IDLE):
                server, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                if code == 0:  # a real connection, its request already waiting
                    client.sendall(wire.GET_HOST_PID_REQUEST)
                self.closedBeforeAccept.append(sum(map(closed, self.clients)))
                self.clients.append(client)
                return server.detach(), ""
            raise OSError(code, os.strerror(code))
        raise BlockingIOError(errno.EAGAIN, "nothing waiting")

    def fileno(self) -> int:
        return -1


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def listener() -> Iterator[ScriptedListener]:
    """The scripted listener; its clients' sockets are closed after the test."""
    scripted = ScriptedListener()
    yield scripted
    for client in scripted.clients:
        client.close()


def make_port(
    clock: MemoryReactorClock, listener: ScriptedListener, fatal: list[Failure],
    maxPerPeer: int | None = None,
) -> tuple[BrokerPort, list[dict]]:
    # The stand-in scripts the socket module's accept: the accept loop under
    # test is the same whatever a connection is (connections.py).
    factory = BrokerFactory(clock, calls=SOCKETS, maxPerPeer=maxPerPeer)
    port = BrokerPort("/nonexistent/broker.sock", -1, factory, clock, fatal.append)
    events: list[dict] = []
    port.log = Logger(observer=events.append)
    port.socket = listener  # type: ignore[assignment]
    port.connected = True
    port.startReading()
    return port, events


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM])
def test_resource_error_backs_off_and_recovers(clock, listener, code: int) -> None:
    fatal: list[Failure] = []
    port, events = make_port(clock, listener, fatal)
    port.socket.errors = [code]  # type: ignore[attr-defined]
    port.doRead()
    assert port not in clock.readers, "stopped reading the listener"
    [resume] = clock.getDelayedCalls()
    assert resume.getTime() == pytest.approx(BACKOFF_INITIAL)
    clock.advance(BACKOFF_INITIAL)
    assert port in clock.readers, "resumed by itself"
    assert fatal == []
    assert events[0]["error"] == errno.errorcode[code]


def test_backoff_doubles_to_one_second_and_resets(clock, listener) -> None:
    port, events = make_port(clock, listener, [])
    delays = []
    for _ in range(12):
        port.socket.errors = [errno.ENFILE]  # type: ignore[attr-defined]
        port.doRead()
        [resume] = clock.getDelayedCalls()
        delays.append(round(resume.getTime() - clock.seconds(), 6))
        clock.advance(resume.getTime() - clock.seconds())
    assert delays[:8] == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64]
    assert delays[8:] == [BACKOFF_MAX] * 4
    errors = [e for e in events if "cannot accept" in e["log_format"]]
    assert len(errors) == 4, "logged at the 1st, 2nd, 4th and 8th error only"
    [lasting] = [e for e in events if "not accepting for" in e["log_format"]]
    assert lasting["reason"] == PAUSE_RESOURCES, "a pause that lasts is said once"
    # One successful accept, then the next resource error starts from 5 ms again.
    port.socket.errors = [0, errno.ENFILE]  # type: ignore[attr-defined]
    port.doRead()  # one accepted: the turn ends there
    port.doRead()  # the next turn meets ENFILE
    [client] = port.socket.clients  # type: ignore[attr-defined]
    assert client.recv(64) == wire.encode_ok(os.getpid()), "answered on the fast path"
    [resume] = clock.getDelayedCalls()
    assert resume.getTime() - clock.seconds() == pytest.approx(BACKOFF_INITIAL)


@pytest.mark.parametrize("code", [errno.ECONNABORTED, errno.EPERM, errno.EPROTO, errno.EINTR])
def test_per_connection_errors_are_skipped(clock, listener, code: int) -> None:
    fatal: list[Failure] = []
    port, _ = make_port(clock, listener, fatal)
    port.socket.errors = [code, code]  # type: ignore[attr-defined]
    port.doRead()
    assert fatal == []
    assert port in clock.readers
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize("code", [errno.EBADF, errno.EINVAL, errno.ENOTSOCK])
def test_other_accept_errors_are_fatal(clock, listener, code: int) -> None:
    fatal: list[Failure] = []
    port, _ = make_port(clock, listener, fatal)
    port.socket.errors = [code]  # type: ignore[attr-defined]
    port.doRead()
    assert len(fatal) == 1
    assert fatal[0].value.errno == code


def test_accepts_per_turn_adapt_to_what_is_waiting(clock, listener) -> None:
    """One per turn for a lone client (no failing accept), doubling under load."""
    port, _ = make_port(clock, listener, [])
    listener.errors = [0] * 10  # type: ignore[attr-defined]
    turns = []
    while listener.errors:  # type: ignore[attr-defined]
        before = len(listener.errors)  # type: ignore[attr-defined]
        port.doRead()
        turns.append(before - len(listener.errors))  # type: ignore[attr-defined]
    assert turns == [1, 2, 4, 3]
    port.doRead()  # the queue is empty: EAGAIN, and back to one per turn
    listener.errors = [0, 0]  # type: ignore[attr-defined]
    port.doRead()
    assert len(listener.errors) == 1  # type: ignore[attr-defined]
    for client in listener.clients:  # type: ignore[attr-defined]
        assert client.recv(64) == wire.encode_ok(os.getpid())


def test_a_stopping_port_answers_its_whole_queue_in_one_turn(clock, listener) -> None:
    """
    As the broker stops, what waits in the queue is accepted and answered
    in one turn, however few a turn accepted just before: a client queued
    at that moment is not left to the next broker's start.
    """
    port, _ = make_port(clock, listener, [])
    listener.errors = [0] * 40  # type: ignore[attr-defined]
    port.acceptQueued()
    assert listener.errors == []  # type: ignore[attr-defined]
    for client in listener.clients:  # type: ignore[attr-defined]
        assert client.recv(64) == wire.encode_ok(os.getpid())


def test_a_stopping_port_accepts_no_more_than_its_slots(clock, listener) -> None:
    """One turn of at most the slots there are: a flood of connects cannot delay the stop."""
    factory = BrokerFactory(clock, calls=SOCKETS, maxConnections=8)
    port = BrokerPort("/nonexistent/broker.sock", -1, factory, clock, [].append)
    port.socket = listener  # type: ignore[assignment]
    port.connected = True
    listener.errors = [0] * 20  # type: ignore[attr-defined]
    port.acceptQueued()
    assert len(listener.errors) == 12  # type: ignore[attr-defined]


def test_connections_over_their_peers_share_are_closed_when_the_turn_ends(
    clock, listener
) -> None:
    """
    A connection turned away (its peer holds its share) is closed after the
    turn's last accept, not at its own: each close lets a reconnecting
    attacker take the backlog slot that accept just freed, ahead of a real
    client that retries its connect every few ms.
    """
    port, _ = make_port(clock, listener, [], maxPerPeer=1)
    port._acceptsPerTurn = 8
    listener.errors = [IDLE] * 4  # type: ignore[attr-defined]
    port.doRead()
    assert listener.closedBeforeAccept == [0, 0, 0, 0], "none closed while the turn ran"
    assert [closed(client) for client in listener.clients] == [False, True, True, True]
    assert port.factory.counts[Outcome.OVER_LIMIT] == 3
    assert port.room.overLimit == []


def test_pending_resume_is_cancelled_when_the_port_closes(clock, listener, tmp_path) -> None:
    port, _ = make_port(clock, listener, [])
    port.socket.errors = [errno.EMFILE]  # type: ignore[attr-defined]
    port.doRead()
    assert clock.getDelayedCalls()
    port.socket = socket.socket(socket.AF_UNIX)  # something closable for the base class
    port.fileno = port.socket.fileno  # type: ignore[method-assign]
    port.connectionLost(Failure(Exception("stopped")))
    assert clock.getDelayedCalls() == []


def test_answers_at_accept_are_timed_once_per_accept_batch(clock, listener) -> None:
    """
    The fast path reads no clock per answer: the port observes the batch's
    answers at its end, each with the batch's duration (an upper bound).
    """
    port, _ = make_port(clock, listener, [])
    port._acceptsPerTurn = 4
    port.socket.errors = [0, 0, 0]  # type: ignore[attr-defined]
    port.doRead()
    factory = port.factory
    assert factory.counts[0] == 3
    assert factory.answeredAtAccept == 0
    assert sum(factory.latency.counts) == 3
    assert factory.latency.counts[0] == 3, "a MemoryReactorClock batch takes no time"
    for client in port.socket.clients:  # type: ignore[attr-defined]
        assert client.recv(64) == wire.encode_ok(os.getpid())
        client.close()


@pytest.mark.usefixtures("reads")
def test_a_lasting_pause_fails_readiness_and_is_said_once(clock, listener) -> None:
    """
    A pause that lasts must show.  Past PAUSE_REPORTED_AFTER the port names
    it (readiness fails on that), logs one line, and says when accepting
    resumes.
    """
    port, events = make_port(clock, listener, [])
    while clock.seconds() < PAUSE_REPORTED_AFTER + BACKOFF_MAX:
        port.socket.errors = [errno.EMFILE]  # type: ignore[attr-defined]
        port.doRead()
        clock.advance(BACKOFF_MAX)
    port.socket.errors = [errno.EMFILE]  # type: ignore[attr-defined]
    port.doRead()
    problem = port.pauseProblem()
    assert problem is not None and PAUSE_RESOURCES in problem, problem
    assert [e["reason"] for e in events if "not accepting for" in e["log_format"]] == [
        PAUSE_RESOURCES
    ]
    clock.advance(BACKOFF_MAX)
    listener.errors = [0]
    port.doRead()
    assert port.pauseProblem() is None and port.pauseReason is None
    assert any("accepting again" in e["log_format"] for e in events)
    listener.clients[0].close()


@pytest.mark.usefixtures("reads")
def test_a_saturated_closer_does_not_pause_accepting(clock, listener) -> None:
    """
    Mode received: while the closer holds as many passed descriptors as its
    bound (a disposer stuck on a tenant's descriptors), the port still
    accepts, and a client that passes nothing is answered at once.  Before,
    accepting paused until the queue drained, and a tenant that kept it
    full kept every client out.
    """
    port, events = make_port(clock, listener, [])
    closer = BackgroundCloser(limit=SCM_MAX_FD)
    closer.pending = SCM_MAX_FD  # as if that many descriptors were stuck closing
    port.factory.receiveDescriptors(PassedDescriptors(closer, descriptorLimit=1 << 16))
    listener.errors = [0]  # a client with its request waiting
    port.doRead()
    assert listener.errors == [], "accepted"
    assert port.pauseReason is None
    [client] = listener.clients
    client.settimeout(WAIT_SECONDS)
    assert client.recv(64) == wire.encode_ok(os.getpid()), "answered with the closer full"


def test_a_closed_port_leaves_no_guard_in_the_watch(clock, listener) -> None:
    """
    Mode received: the reactor thread's guard is forgotten by the
    process-wide watch once the port is closed and its transactions are
    over (before, every listener started in a process left one behind).
    """
    port, _ = make_port(clock, listener, [])
    passed = PassedDescriptors(BackgroundCloser(limit=SCM_MAX_FD), descriptorLimit=1 << 16)
    port.factory.receiveDescriptors(passed)
    watch = passed.closer.watch
    assert passed.guard in watch._guards
    port.factory.transactionStarted()  # one connection still in flight
    port.socket = socket.socket(socket.AF_UNIX)  # something closable for the base class
    port.fileno = port.socket.fileno  # type: ignore[method-assign]
    port.connectionLost(Failure(Exception("stopped")))
    assert passed.guard in watch._guards, "a connection in flight may still be closed"
    port.factory.transactionEnded()
    assert passed.guard not in watch._guards


def test_the_markers_close_is_watched_where_descriptors_may_be_passed(tmp_path) -> None:
    """
    The backlog marker is a Unix socket the reactor thread closes every
    10 ms while start times are compared (kernels before 6.5, all in mode
    received).  On kernels before 6.10 any Unix socket's release may run the
    collector of in-flight garbage and free a tenant's lingering socket in
    the closing thread: unwatched, that froze the broker for the linger
    time (in the 5.10 guest, a client unanswered for 60 s under the nested
    lingering-socket attack).  So it is watched like a connection's close.
    """
    directory = tmp_path / "broker"
    fd = open_broker_directory(str(directory), os.geteuid())
    clock = MemoryReactorClock()
    factory = BrokerFactory(
        clock, 0.5, 4, identifier=PeerIdentifier(check=LivenessCheck.PIDFD_OPEN)
    )
    fatal: list[Failure] = []
    port = BrokerPort(str(directory / "broker.sock"), fd, factory, clock, fatal.append,
                      receiveDescriptors=True)
    port.startListening()
    try:
        passed = factory.passed
        assert passed is not None and factory.identifier.acceptClock is not None
        before = passed.guard.closes
        port._insertMarker()
        assert len(factory.markers) == 1, "a marker was put in the backlog"
        assert passed.guard.closes == before + 1, "its close was watched"
        assert not passed.guard.busy
        assert fatal == []
    finally:
        port._stopFloorRefresh()
        port.socket.close()  # type: ignore[union-attr]
        if factory.passed is not None:
            factory.passed.stop()
        os.close(fd)
