"""
The transaction state machine and the limiting factory, deterministic:
a L{MemoryReactorClock} drives the deadline and a L{StringTransport} collects
the reply.  The transport's handle is one end of a real socketpair, so the
peer credentials come from the kernel (the peer is this process).
"""

from __future__ import annotations

import os
import socket

import pytest
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import Logger

from hostpid import wire
from hostpid.broker.server import BrokerFactory, BrokerProtocol, Outcome, answer
from hostpid.peercred import PeerCredentialsFailed, PeerGone, PeerIdentifier

DEADLINE = 0.5


class SocketStringTransport(StringTransport):
    """A StringTransport whose handle is a real socket, as the server expects."""

    def __init__(self, handle: socket.socket) -> None:
        super().__init__()
        self.handle = handle

    def getHandle(self) -> socket.socket:
        return self.handle


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def factory(clock: MemoryReactorClock) -> BrokerFactory:
    return BrokerFactory(clock, deadline=DEADLINE, maxConnections=4)


def connect(
    factory: BrokerFactory, handle: socket.socket
) -> tuple[BrokerProtocol, SocketStringTransport]:
    protocol = factory.buildProtocol(None)  # type: ignore[arg-type]
    assert protocol is not None
    transport = SocketStringTransport(handle)
    protocol.makeConnection(transport)
    return protocol, transport


def end(protocol: BrokerProtocol) -> None:
    """What the reactor does once the transport has closed."""
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure

    protocol.connectionLost(Failure(ConnectionDone()))


def test_whole_request_gets_own_pid(factory, pair, clock) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST)
    assert transport.value() == wire.encode_ok(os.getpid())
    assert transport.disconnecting
    end(protocol)
    assert factory.counts[Outcome.OK] == 1
    assert factory.active == 0
    assert clock.getDelayedCalls() == []


def test_one_byte_at_a_time(factory, pair, clock) -> None:
    protocol, transport = connect(factory, pair[0])
    for index in range(wire.REQUEST_SIZE - 1):
        protocol.dataReceived(wire.GET_HOST_PID_REQUEST[index : index + 1])
        assert transport.value() == b""
        assert not transport.disconnecting
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[-1:])
    assert transport.value() == wire.encode_ok(os.getpid())
    assert transport.disconnecting


@pytest.mark.parametrize("split", range(1, wire.REQUEST_SIZE))
def test_any_two_fragments(factory, pair, split: int) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[:split])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[split:])
    assert transport.value() == wire.encode_ok(os.getpid())


def test_bytes_after_the_eighth_are_ignored(factory, pair) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST + b"HPID\x00\x01\x00\x02garbage")
    protocol.dataReceived(b"more garbage")
    assert transport.value() == wire.encode_ok(os.getpid())
    assert factory.counts[Outcome.OK] == 1
    assert factory.counts[Outcome.INVALID] == 0


@pytest.mark.parametrize(
    "request_bytes",
    [b"HPIX\x00\x01\x00\x01", b"HPID\x00\x02\x00\x01", b"HPID\x00\x01\x00\x00",
     b"HPID\x00\x01\x00\x02", b"\x00" * 8],
)
def test_invalid_request_gets_status_1_and_close(factory, pair, request_bytes) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(request_bytes)
    assert transport.value() == wire.INVALID_REQUEST_RESPONSE
    assert transport.disconnecting
    assert factory.counts[Outcome.INVALID] == 1


def test_deadline_just_before(factory, pair, clock) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[:4])
    clock.advance(DEADLINE - 0.001)
    assert not transport.disconnected
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[4:])
    assert transport.value() == wire.encode_ok(os.getpid())
    end(protocol)
    assert clock.getDelayedCalls() == []
    assert factory.counts[Outcome.DEADLINE] == 0


def test_deadline_just_after(factory, pair, clock) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[:4])
    clock.advance(DEADLINE)
    assert transport.disconnected, "the deadline aborts the connection"
    assert transport.value() == b""
    assert factory.counts[Outcome.DEADLINE] == 1
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[4:])
    assert transport.value() == b"", "nothing is answered after the deadline"
    end(protocol)
    assert clock.getDelayedCalls() == []
    assert factory.active == 0
    assert factory.counts[Outcome.SHORT] == 0, "one outcome per transaction"


def test_deadline_counts_from_connection_not_from_data(factory, pair, clock) -> None:
    protocol, transport = connect(factory, pair[0])
    clock.advance(DEADLINE / 2)
    protocol.dataReceived(b"H")
    clock.advance(DEADLINE / 2)
    assert transport.disconnected


def test_no_delayed_call_left_when_client_goes_away(factory, pair, clock) -> None:
    protocol, _ = connect(factory, pair[0])
    assert len(clock.getDelayedCalls()) == 1
    protocol.dataReceived(b"HP")
    end(protocol)
    assert clock.getDelayedCalls() == []
    assert factory.counts[Outcome.SHORT] == 1
    assert factory.active == 0


def test_half_close_after_request_still_gets_reply(factory, pair) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST)
    protocol.readConnectionLost()
    assert transport.value() == wire.encode_ok(os.getpid())
    assert factory.counts[Outcome.OK] == 1
    assert factory.counts[Outcome.SHORT] == 0


def test_half_close_before_request_is_short(factory, pair, clock) -> None:
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(b"HPID")
    protocol.readConnectionLost()
    assert transport.disconnecting
    assert transport.value() == b""
    assert factory.counts[Outcome.SHORT] == 1
    end(protocol)
    assert factory.counts[Outcome.SHORT] == 1
    assert clock.getDelayedCalls() == []


def test_peer_credential_error_closes_without_reply(factory, pair) -> None:
    handle = pair[0]
    protocol, transport = connect(factory, handle)
    handle.close()  # getsockopt now fails for real (EBADF)
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST)
    assert transport.value() == b""
    assert transport.disconnecting
    assert factory.counts[Outcome.PEER_CREDENTIALS] == 1


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


def test_pid_beyond_the_wire_range_is_never_sent(pair) -> None:
    identifier = RecordingIdentifier(2**31)
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


def test_full_slots_evict_the_oldest_waiting_connection(factory, pair, clock) -> None:
    """
    Every slot held by a connection waiting for its request: a newcomer takes
    the oldest one's slot at once; the oldest is closed with no reply, its
    deadline cancelled, and its later connectionLost frees nothing twice.
    """
    held = [connect(factory, pair[0]) for _ in range(4)]
    newcomer, _ = connect(factory, pair[0])
    oldest, oldestTransport = held[0]
    assert oldestTransport.disconnecting and oldestTransport.value() == b""
    assert factory.counts[Outcome.EVICTED] == 1
    assert factory.counts[Outcome.OVER_LIMIT] == 0
    assert factory.active == 4
    assert len(factory.deadlines) == 4, "the evicted deadline is stopped"
    assert len(clock.getDelayedCalls()) == 1, "one delayed call for every deadline"
    end(oldest)
    assert factory.active == 4, "the evicted slot is not released twice"
    assert factory.counts[Outcome.SHORT] == 0
    oldest.dataReceived(wire.GET_HOST_PID_REQUEST)
    assert oldestTransport.value() == b"", "an evicted connection is never answered"
    clock.advance(DEADLINE)
    assert factory.counts[Outcome.DEADLINE] == 4, "the others' deadlines, not the evicted one's"
    assert factory.counts[Outcome.EVICTED] == 1


def test_eviction_follows_arrival_order(factory, pair) -> None:
    held = [connect(factory, pair[0]) for _ in range(4)]
    for index in range(4):
        connect(factory, pair[0])
        assert [t.disconnecting for _, t in held] == [i <= index for i in range(4)]
    assert factory.counts[Outcome.EVICTED] == 4


def test_a_partial_request_can_be_evicted(factory, pair) -> None:
    held = [connect(factory, pair[0]) for _ in range(4)]
    held[0][0].dataReceived(wire.GET_HOST_PID_REQUEST[:4])
    connect(factory, pair[0])
    assert held[0][1].disconnecting and held[0][1].value() == b""


def test_an_answered_connection_is_never_evicted(factory, pair) -> None:
    """Answered but still closing: not waiting, so the next waiting one goes."""
    held = [connect(factory, pair[0]) for _ in range(4)]
    first, firstTransport = held[0]
    first.dataReceived(wire.GET_HOST_PID_REQUEST)
    connect(factory, pair[0])
    assert firstTransport.value() == wire.encode_ok(os.getpid())
    assert held[1][1].disconnecting and held[1][1].value() == b""
    assert factory.counts[Outcome.EVICTED] == 1


def test_over_limit_only_when_no_connection_is_waiting(factory, pair) -> None:
    """
    Every slot held by an answered connection still closing: nothing can be
    evicted, so the newcomer is refused; once one closes, its slot is free.
    """
    held = [connect(factory, pair[0]) for _ in range(4)]
    for protocol, _ in held:
        protocol.dataReceived(wire.GET_HOST_PID_REQUEST)
    assert factory.buildProtocol(None) is None  # type: ignore[arg-type]
    assert factory.counts[Outcome.OVER_LIMIT] == 1
    end(held[0][0])
    assert factory.active == 3
    assert factory.buildProtocol(None) is not None  # type: ignore[arg-type]


def test_finished_connections_leave_the_waiting_set(factory, pair, clock) -> None:
    """Deadline, half-close and loss all take a connection out of the eviction order."""
    expired, _ = connect(factory, pair[0])
    clock.advance(DEADLINE)
    halfClosed, _ = connect(factory, pair[0])
    halfClosed.readConnectionLost()
    lost, _ = connect(factory, pair[0])
    end(lost)
    assert factory.waiting == 0
    end(expired)
    end(halfClosed)
    assert factory.active == 0


def test_when_idle(factory, pair) -> None:
    protocol, _ = connect(factory, pair[0])
    called = []
    factory.whenIdle(lambda: called.append(1))
    assert called == []
    end(protocol)
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


class TestFastPath:
    """L{BrokerFactory.answerWaiting}, on real sockets."""

    def test_waiting_request_is_answered_without_a_slot(self, factory, pair) -> None:
        server, client = pair
        client.sendall(wire.GET_HOST_PID_REQUEST)
        assert factory.answerWaiting(server) is None
        assert client.recv(64) == wire.encode_ok(os.getpid())
        assert client.recv(64) == b"", "closed after the reply"
        assert factory.active == 0
        assert factory.counts[Outcome.OK] == 1

    def test_waiting_invalid_request(self, factory, pair) -> None:
        server, client = pair
        client.sendall(b"HPID\x00\x01\x00\x07")
        assert factory.answerWaiting(server) is None
        assert client.recv(64) == wire.INVALID_REQUEST_RESPONSE

    def test_nothing_waiting_goes_to_general_path(self, factory, pair) -> None:
        assert factory.answerWaiting(pair[0]) == b""

    def test_partial_request_is_handed_on(self, factory, pair) -> None:
        server, client = pair
        client.sendall(b"HPI")
        assert factory.answerWaiting(server) == b"HPI"

    def test_client_already_gone(self, factory, pair) -> None:
        server, client = pair
        client.close()
        assert factory.answerWaiting(server) is None
        assert factory.counts[Outcome.SHORT] == 1


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


def test_the_accept_time_is_read_at_connection_and_given_to_the_check(clock, pair) -> None:
    """
    The general path reads the identifier's accept clock when the
    connection is made, not when the request completes (possibly much
    later), and the check gets that reading.
    """
    identifier = AcceptTimeIdentifier()
    factory = BrokerFactory(clock, deadline=DEADLINE, identifier=identifier)
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[:3])
    clock.advance(DEADLINE / 2)
    next(identifier.readings)  # time passes on the accept clock too
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST[3:])
    assert transport.value() == wire.encode_ok(7)
    assert identifier.accepted == [1000]


def test_the_fast_path_reads_the_accept_time_before_the_request(pair) -> None:
    identifier = AcceptTimeIdentifier()
    factory = BrokerFactory(MemoryReactorClock(), deadline=DEADLINE, identifier=identifier)
    pair[1].sendall(wire.GET_HOST_PID_REQUEST)
    assert factory.answerWaiting(pair[0]) is None
    assert pair[1].recv(64) == wire.encode_ok(7)
    assert identifier.accepted == [1000]


def test_no_accept_clock_no_reading(clock, pair) -> None:
    """Where the check needs no accept time (SO_PEERPIDFD), none is read: 0 is passed."""
    identifier = AcceptTimeIdentifier()
    identifier.acceptClock = None
    factory = BrokerFactory(clock, deadline=DEADLINE, identifier=identifier)
    protocol, transport = connect(factory, pair[0])
    protocol.dataReceived(wire.GET_HOST_PID_REQUEST)
    assert transport.value() == wire.encode_ok(7)
    assert identifier.accepted == [0]
