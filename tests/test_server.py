"""
The transaction rule (L{answer}) and the factory's books and fast path, on
real sockets: the peer credentials come from the kernel (the peer is this
process).  The general path, for connections still waiting for their
request, is tested in C{test_waiting.py}.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Iterator

import pytest
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import Logger

from hostpid import wire
from hostpid.broker.connections import Connection, descriptor_calls
from hostpid.broker.descriptors import BackgroundCloser, PassedDescriptors
from hostpid.broker.server import BrokerFactory, Outcome, answer
from hostpid.peercred import PeerCredentialsFailed, PeerGone, PeerIdentifier

DEADLINE = 0.5


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def factory(clock: MemoryReactorClock) -> BrokerFactory:
    return BrokerFactory(clock, deadline=DEADLINE, maxConnections=4)


def test_peer_credential_error_gets_no_reply(pair) -> None:
    handle = pair[0]
    handle.close()  # getsockopt now fails for real (EBADF)
    assert answer(wire.GET_HOST_PID_REQUEST, handle, PeerIdentifier()) == (
        Outcome.PEER_CREDENTIALS, None,
    )


class RecordingIdentifier(PeerIdentifier):
    """An identifier that reports what it was asked, then answers or fails as told."""

    def __init__(self, result: int | Exception) -> None:
        super().__init__()
        self.result = result
        self.asked = 0

    def host_pid(self, sock: socket.socket, accepted: int = 0) -> int:
        self.asked += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize(
    "failure, outcome",
    [
        (PeerCredentialsFailed("PID 0"), Outcome.PEER_CREDENTIALS),
        (PeerGone("connected as PID 7, now None"), Outcome.PEER_GONE),
    ],
)
def test_unverified_peer_gets_no_reply(pair, failure, outcome) -> None:
    identifier = RecordingIdentifier(failure)
    assert answer(wire.GET_HOST_PID_REQUEST, pair[0], identifier) == (outcome, None)


@pytest.mark.parametrize("pid", [2**31, 0, -1])
def test_pid_beyond_the_wire_range_is_never_sent(pair, pid: int) -> None:
    identifier = RecordingIdentifier(pid)
    assert answer(wire.GET_HOST_PID_REQUEST, pair[0], identifier) == (
        Outcome.PEER_CREDENTIALS, None,
    )


def test_peer_is_identified_only_after_a_valid_request(pair) -> None:
    identifier = RecordingIdentifier(7)
    assert answer(b"HPID\x00\x01\x00\x02", pair[0], identifier)[0] is Outcome.INVALID
    assert identifier.asked == 0
    assert answer(wire.GET_HOST_PID_REQUEST, pair[0], identifier) == (
        Outcome.OK, wire.encode_ok(7),
    )
    assert identifier.asked == 1


def test_when_idle(factory) -> None:
    factory.transactionStarted()
    called = []
    factory.whenIdle(lambda: called.append(1))
    assert called == []
    factory.transactionEnded()
    assert called == [1]
    factory.whenIdle(lambda: called.append(2))
    assert called == [1, 2]


def test_failure_logs_are_rate_limited(clock) -> None:
    events: list[dict] = []
    factory = BrokerFactory(clock)
    factory.log = Logger(observer=events.append)
    for _ in range(1000):
        factory.record(Outcome.DEADLINE)
    for _ in range(100):
        factory.record(Outcome.OK)
    assert factory.counts[Outcome.DEADLINE] == 1000
    # 1, 2, 4, ..., 512: ten lines for a thousand failures, none for successes.
    assert [event["count"] for event in events] == [2**n for n in range(10)]


def held(factory: BrokerFactory, sock: socket.socket) -> Connection:
    """
    C{sock} as the factory's fast path holds a connection just accepted: its
    bare descriptor where the C helper is in use (the socket object gives it
    up, so the test's own close of it is a no-op), else the socket object.
    """
    return sock.detach() if factory.calls.native else sock


@pytest.mark.usefixtures("reads")
class TestFastPath:
    """
    L{BrokerFactory.answerWaiting}, on real sockets, held both ways: as
    descriptors by the C helper's calls, as socket objects by the socket
    module's.
    """

    @pytest.fixture
    def factory(self, reads: str, clock: MemoryReactorClock) -> BrokerFactory:
        made = BrokerFactory(clock, deadline=DEADLINE, maxConnections=4)
        assert made.calls.native is (reads == "c")
        return made

    def test_waiting_request_is_answered_without_a_slot(self, factory, pair) -> None:
        server, client = pair
        client.sendall(wire.GET_HOST_PID_REQUEST)
        assert factory.answerWaiting(held(factory, server)) is None
        assert client.recv(64) == wire.encode_ok(os.getpid())
        assert client.recv(64) == b"", "closed after the reply"
        assert factory.active == 0
        assert factory.counts[Outcome.OK] == 1

    def test_waiting_invalid_request(self, factory, pair) -> None:
        server, client = pair
        client.sendall(b"HPID\x00\x01\x00\x07")
        assert factory.answerWaiting(held(factory, server)) is None
        assert client.recv(64) == wire.INVALID_REQUEST_RESPONSE

    def test_a_backlog_marker_is_recognized_and_not_answered(self, factory, pair) -> None:
        """
        The port's own marker (8 random bytes it noted, which are no valid
        request) tells the port when it was made, gets no reply, and is no
        transaction.
        """
        server, client = pair
        nonce = b"\x01marker!"
        seen: list[int] = []
        factory.markers[nonce] = 12345
        factory.markerSeen = seen.append
        client.sendall(nonce)
        assert factory.answerWaiting(held(factory, server)) is None
        assert client.recv(64) == b"", "closed with no reply"
        assert seen == [12345] and not factory.markers
        assert factory.counts[Outcome.INVALID] == 0

    def test_a_client_cannot_pass_for_a_marker_it_does_not_know(self, factory, pair) -> None:
        """Other invalid bytes are an invalid request, whatever markers are out."""
        server, client = pair
        seen: list[int] = []
        factory.markers[b"\x01marker!"] = 12345
        factory.markerSeen = seen.append
        client.sendall(b"\x01marker?")
        assert factory.answerWaiting(held(factory, server)) is None
        assert client.recv(64) == wire.INVALID_REQUEST_RESPONSE
        assert seen == [] and factory.markers
        assert factory.counts[Outcome.INVALID] == 1

    def test_nothing_waiting_goes_to_general_path(self, factory, pair) -> None:
        conn = held(factory, pair[0])
        assert factory.answerWaiting(conn) == b""
        # Still open, for the general path: the client can still be answered.
        pair[1].sendall(wire.GET_HOST_PID_REQUEST)
        assert factory.answerWaiting(conn) is None
        assert pair[1].recv(64) == wire.encode_ok(os.getpid())

    def test_partial_request_is_handed_on(self, factory, pair) -> None:
        server, client = pair
        conn = held(factory, server)
        client.sendall(b"HPI")
        assert factory.answerWaiting(conn) == b"HPI"
        factory.calls.socketOf(conn).close()

    def test_client_already_gone(self, factory, pair) -> None:
        server, client = pair
        conn = held(factory, server)
        client.close()
        assert factory.answerWaiting(conn) is None
        assert factory.counts[Outcome.SHORT] == 1
        if factory.calls.native:
            with pytest.raises(OSError):  # closed: the descriptor is not open any more
                os.fstat(conn)
        else:
            assert conn.fileno() == -1, "closed"


class TestReceivingFastPath(TestFastPath):
    """
    The same, in mode received (L{BrokerFactory.answerWaitingReceiving}):
    reads with room for passed descriptors, releases through
    L{PassedDescriptors}; and a message that carried a descriptor gets no
    reply, the descriptor disposed of.
    """

    @pytest.fixture
    def factory(self, reads: str, clock: MemoryReactorClock) -> Iterator[BrokerFactory]:
        made = BrokerFactory(clock, deadline=DEADLINE, maxConnections=4)
        passed = PassedDescriptors(BackgroundCloser(), native=made.calls.native)
        made.receiveDescriptors(passed)
        yield made
        passed.stop()

    def test_a_passed_descriptor_gets_no_reply(self, factory, pair) -> None:
        server, client = pair
        read, write = os.pipe()
        client.sendmsg([wire.GET_HOST_PID_REQUEST], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                      array.array("i", [read]))])
        os.close(read)
        assert factory.answerWaiting(held(factory, server)) is None
        assert client.recv(64) == b"", "no reply"
        assert factory.counts[Outcome.DESCRIPTORS] == 1
        assert factory.passed is not None and factory.passed.received == 1
        os.close(write)


def test_descriptor_connections_need_the_helpers_release(reads: str, clock) -> None:
    """
    A factory holding descriptors cannot be given the Python path's release
    (it would be handed ints it cannot close); one holding socket objects
    takes it.
    """
    passed = PassedDescriptors(BackgroundCloser(), native=False)
    if reads == "c":
        factory = BrokerFactory(clock, calls=descriptor_calls())
        with pytest.raises(ValueError, match="need the C helper's release"):
            factory.receiveDescriptors(passed)
        assert factory.passed is None
    else:
        factory = BrokerFactory(clock)
        factory.receiveDescriptors(passed)
        assert factory.passed is passed
    passed.stop()


class AcceptTimeIdentifier(RecordingIdentifier):
    """Records the accept time each check was given; its accept clock is a counter."""

    def __init__(self) -> None:
        super().__init__(7)
        self.readings = iter(range(1000, 2000))
        self.acceptClock = lambda: next(self.readings)
        self.accepted: list[int] = []

    def host_pid(self, sock: socket.socket, accepted: int = 0) -> int:
        self.accepted.append(accepted)
        return super().host_pid(sock, accepted)


def test_the_fast_path_reads_the_accept_time_before_the_request(pair) -> None:
    identifier = AcceptTimeIdentifier()
    factory = BrokerFactory(MemoryReactorClock(), deadline=DEADLINE, identifier=identifier)
    pair[1].sendall(wire.GET_HOST_PID_REQUEST)
    assert factory.answerWaiting(held(factory, pair[0])) is None
    assert pair[1].recv(64) == wire.encode_ok(7)
    assert identifier.accepted == [1000]
