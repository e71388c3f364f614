"""
The general path (L{hostpid.broker.waiting}), deterministic: a
L{MemoryReactorClock} drives the deadline and stands in for the reactor's
reader set, and every connection is a real socketpair, so reads, replies,
closes and peer credentials are the kernel's (the peer is this process).

The fairness rule needs peers other than this process, so these tests name
each connection's peer themselves (the room's C{peerOf}); the real test with
real processes is C{tests/integration/test_attack_many_tenants.py}.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Iterator

import pytest
from test_server import AcceptTimeIdentifier
from twisted.internet.testing import MemoryReactorClock

from hostpid import wire
from hostpid.broker.descriptors import PassedDescriptors
from hostpid.broker.server import BrokerFactory, Outcome, max_waiting_per_peer
from hostpid.broker.waiting import GONE_CHECKS, WaitingConnection, WaitingRoom, peer_pid
from hostpid.peercred import LivenessCheck, PeerIdentifier

DEADLINE = 0.5
REQUEST = wire.GET_HOST_PID_REQUEST


class Tenants:
    """Connections into a room over real socketpairs, each from a named peer."""

    def __init__(self, room: WaitingRoom) -> None:
        self.room = room
        self.peers: dict[int, int] = {}
        self.clients: list[socket.socket] = []

    def peerOf(self, sock: socket.socket) -> int:
        return self.peers[sock.fileno()]

    def connect(
        self, peer: int = 1, prefix: bytes = b""
    ) -> tuple[WaitingConnection | None, socket.socket]:
        server, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.clients.append(client)
        self.peers[server.fileno()] = peer
        return self.room.admit(server, prefix), client

    def waiting(
        self, peer: int = 1, prefix: bytes = b""
    ) -> tuple[WaitingConnection, socket.socket]:
        connection, client = self.connect(peer, prefix)
        assert connection is not None, "admitted"
        return connection, client

    def sprayed(
        self, listener: socket.socket, peer: int
    ) -> tuple[WaitingConnection | None, socket.socket]:
        """
        A connection as a PID spray makes it: connected by a child that
        exited (and was reaped) at once, its socket kept by this process.
        """
        server, client = connected_by_exited_child(listener)
        self.clients.append(client)
        self.peers[server.fileno()] = peer
        return self.room.admit(server, b""), client

    def close(self) -> None:
        for client in self.clients:
            client.close()


def connected_by_exited_child(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """
    The accepted end, and the connecting end, of a connection that a forked
    child made on this process's socket before exiting: the peer
    credentials name the child, which is gone and reaped.
    """
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            client.connect(listener.getsockname())
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    server, _ = listener.accept()
    return server, client


@pytest.fixture
def listener(tmp_path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(tmp_path / "s"))
    sock.listen(8)
    yield sock
    sock.close()


def closed_unanswered(client: socket.socket) -> bool:
    """The broker closed C{client}'s connection without a byte of reply."""
    client.settimeout(1)
    try:
        return client.recv(64) == b""
    except ConnectionResetError:
        return True


def reply(client: socket.socket) -> bytes:
    """Everything the broker sent before closing."""
    client.settimeout(1)
    data = b""
    while chunk := client.recv(64):
        data += chunk
    return data


def make_room(
    clock: MemoryReactorClock, maxConnections: int = 4, maxPerPeer: int | None = None,
    identifier: PeerIdentifier | None = None,
) -> tuple[BrokerFactory, WaitingRoom, Tenants]:
    factory = BrokerFactory(clock, deadline=DEADLINE, maxConnections=maxConnections,
                            maxPerPeer=maxPerPeer, identifier=identifier)
    tenants: Tenants
    room = WaitingRoom(factory, clock, peerOf=lambda sock: tenants.peerOf(sock))
    tenants = Tenants(room)
    return factory, room, tenants


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def setup(clock) -> Iterator[tuple[BrokerFactory, WaitingRoom, Tenants]]:
    factory, room, tenants = make_room(clock, maxConnections=4, maxPerPeer=4)
    yield factory, room, tenants
    tenants.close()


def test_whole_request_gets_own_pid_and_leaves(setup, clock) -> None:
    factory, room, tenants = setup
    connection, client = tenants.waiting()
    assert connection in clock.readers, "registered with the reactor directly"
    assert factory.active == 1 and len(room) == 1
    client.sendall(REQUEST)
    connection.doRead()
    assert reply(client) == wire.encode_ok(os.getpid())
    assert factory.counts[Outcome.OK] == 1
    assert factory.active == 0 and len(room) == 0
    assert connection not in clock.readers
    assert connection.fileno() == -1, "the descriptor number is forgotten once closed"
    assert clock.getDelayedCalls() == [], "no timer outlives the connections"
    assert sum(factory.latency.counts) == 1


def test_one_byte_at_a_time(setup) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting()
    for index in range(wire.REQUEST_SIZE - 1):
        client.sendall(REQUEST[index:index + 1])
        connection.doRead()
        assert not connection.finished
    client.sendall(REQUEST[-1:])
    connection.doRead()
    assert reply(client) == wire.encode_ok(os.getpid())


@pytest.mark.parametrize("split", range(1, wire.REQUEST_SIZE))
def test_the_prefix_read_at_accept_is_kept(setup, split: int) -> None:
    _, _, tenants = setup
    connection, client = tenants.waiting(prefix=REQUEST[:split])
    client.sendall(REQUEST[split:])
    connection.doRead()
    assert reply(client) == wire.encode_ok(os.getpid())


def test_a_spurious_wakeup_reads_nothing(setup) -> None:
    _, _, tenants = setup
    connection, _ = tenants.waiting()
    connection.doRead()
    assert not connection.finished


def test_bytes_after_the_eighth_are_ignored(setup) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting()
    client.sendall(REQUEST + b"HPID\x00\x01\x00\x02garbage")
    connection.doRead()
    assert reply(client) == wire.encode_ok(os.getpid())
    assert factory.counts[Outcome.OK] == 1 and factory.counts[Outcome.INVALID] == 0


def test_invalid_request_gets_status_1_and_close(setup) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting()
    client.sendall(b"HPID\x00\x01\x00\x07")
    connection.doRead()
    assert reply(client) == wire.INVALID_REQUEST_RESPONSE
    assert factory.counts[Outcome.INVALID] == 1


def test_deadline_just_before(setup, clock) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting(prefix=REQUEST[:4])
    clock.advance(DEADLINE - 0.001)
    assert not connection.finished
    client.sendall(REQUEST[4:])
    connection.doRead()
    assert reply(client) == wire.encode_ok(os.getpid())
    assert clock.getDelayedCalls() == []
    assert factory.counts[Outcome.DEADLINE] == 0


def test_deadline_just_after(setup, clock) -> None:
    factory, room, tenants = setup
    connection, client = tenants.waiting(prefix=REQUEST[:4])
    clock.advance(DEADLINE)
    assert connection.finished and connection not in clock.readers
    assert closed_unanswered(client)
    assert factory.counts[Outcome.DEADLINE] == 1
    assert factory.active == 0 and len(room) == 0
    connection.doRead()
    assert factory.counts[Outcome.SHORT] == 0, "one outcome per transaction"
    assert clock.getDelayedCalls() == []


def test_deadline_counts_from_accept_not_from_data(setup, clock) -> None:
    _, _, tenants = setup
    connection, client = tenants.waiting()
    clock.advance(DEADLINE / 2)
    client.sendall(b"H")
    connection.doRead()
    clock.advance(DEADLINE / 2)
    assert connection.finished


def test_client_going_away_is_short_and_leaves_no_timer(setup, clock) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting()
    client.sendall(b"HP")
    connection.doRead()
    client.close()
    connection.doRead()
    assert connection.finished
    assert factory.counts[Outcome.SHORT] == 1 and factory.active == 0
    assert clock.getDelayedCalls() == []


def test_half_close_after_request_still_gets_reply(setup) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting()
    client.sendall(REQUEST)
    client.shutdown(socket.SHUT_WR)
    connection.doRead()
    assert reply(client) == wire.encode_ok(os.getpid())
    assert factory.counts[Outcome.OK] == 1 and factory.counts[Outcome.SHORT] == 0


def test_half_close_before_request_is_short(setup) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting()
    client.sendall(b"HPID")
    client.shutdown(socket.SHUT_WR)
    connection.doRead()
    connection.doRead()
    assert closed_unanswered(client)
    assert factory.counts[Outcome.SHORT] == 1


def test_reactor_letting_go_counts_short(setup, clock) -> None:
    factory, _, tenants = setup
    connection, client = tenants.waiting()
    connection.connectionLost(None)
    assert closed_unanswered(client)
    assert factory.counts[Outcome.SHORT] == 1 and factory.active == 0
    assert clock.getDelayedCalls() == []


# --- Fairness when every slot is held. ---


def test_the_peer_holding_the_most_loses_its_oldest_first(setup, clock) -> None:
    """
    Four slots: peer 1 holds three, peer 2 (a late sender) one.  Newcomers
    from other peers take peer 1's slots, oldest first, while peer 2 keeps
    its own; its request, sent late, is answered.
    """
    factory, room, tenants = setup
    flood = [tenants.waiting(peer=1) for _ in range(3)]
    late, lateClient = tenants.waiting(peer=2, prefix=REQUEST[:3])
    for index in range(2):
        tenants.waiting(peer=10 + index)
        assert [c.finished for c, _ in flood] == [i <= index for i in range(3)]
        assert not late.finished
    assert all(closed_unanswered(client) for _, client in flood[:2])
    assert factory.counts[Outcome.EVICTED] == 2
    assert factory.active == 4
    assert len(room.deadlines) == 4, "an evicted connection's deadline is stopped"
    assert len(clock.getDelayedCalls()) == 1, "one delayed call for every deadline"
    lateClient.sendall(REQUEST[3:])
    late.doRead()
    assert reply(lateClient) == wire.encode_ok(os.getpid())


def test_a_single_late_sender_keeps_its_slot_through_a_flood(clock) -> None:
    """
    One peer reconnecting as fast as it is closed, far beyond the slots:
    the late sender's slot is never taken, and it is answered.
    """
    factory, room, tenants = make_room(clock, maxConnections=8, maxPerPeer=8)
    try:
        late, lateClient = tenants.waiting(peer=2)
        for _ in range(100):
            tenants.connect(peer=1)
        assert not late.finished
        assert factory.counts[Outcome.EVICTED] == 100 - 7
        assert room.queues.count(1) == 7
        lateClient.sendall(REQUEST)
        late.doRead()
        assert reply(lateClient) == wire.encode_ok(os.getpid())
    finally:
        tenants.close()


def test_ties_go_to_the_peer_that_reached_the_count_first(setup) -> None:
    _, _, tenants = setup
    a = [tenants.waiting(peer=1)[0] for _ in range(2)]
    b = [tenants.waiting(peer=2)[0] for _ in range(2)]
    tenants.waiting(peer=3)
    assert a[0].finished and not any(c.finished for c in [a[1], *b])
    tenants.waiting(peer=4)
    assert b[0].finished, "peer 2 now holds the most"
    tenants.waiting(peer=5)
    assert a[1].finished, "every peer holds one: the longest-waiting goes (arrival order)"


def test_every_peer_holding_one_evicts_in_arrival_order(setup) -> None:
    _, _, tenants = setup
    held = [tenants.waiting(peer=index)[0] for index in range(4)]
    for index in range(4):
        tenants.waiting(peer=100 + index)
        assert [c.finished for c in held] == [i <= index for i in range(4)]


def test_an_answered_connection_has_left_and_is_never_evicted(setup) -> None:
    factory, _, tenants = setup
    first, firstClient = tenants.waiting(peer=1)
    others = [tenants.waiting(peer=1) for _ in range(3)]
    firstClient.sendall(REQUEST)
    first.doRead()
    assert factory.active == 3, "answered: its slot is free at once"
    tenants.waiting(peer=5)
    assert factory.counts[Outcome.EVICTED] == 0
    tenants.waiting(peer=6)
    assert others[0][0].finished and factory.counts[Outcome.EVICTED] == 1
    assert reply(firstClient) == wire.encode_ok(os.getpid())


def test_connections_whose_connector_is_gone_give_up_their_slots_first(
    setup, listener
) -> None:
    """
    A PID spray: every slot but one held by connections whose connector has
    exited, each under its own PID.  The live late sender is the oldest of
    many one-connection peers, which the fairness rule alone would evict
    first; those that can never be answered go first instead.
    """
    factory, room, tenants = setup
    late, lateClient = tenants.waiting(peer=1)
    sprayed = [tenants.sprayed(listener, peer=10 + index) for index in range(3)]
    assert all(connection is not None for connection, _ in sprayed), "room to spare: admitted"
    newcomer, _ = tenants.waiting(peer=2)
    assert not late.finished and not newcomer.finished
    assert [connection.finished for connection, _ in sprayed] == [True, False, False]
    assert factory.counts[Outcome.CONNECTOR_GONE] == 1
    assert factory.counts[Outcome.EVICTED] == 0
    assert closed_unanswered(sprayed[0][1])
    assert len(room.rotation) == len(room) == 4
    lateClient.sendall(REQUEST)
    late.doRead()
    assert reply(lateClient) == wire.encode_ok(os.getpid())


def test_a_newcomer_whose_connector_is_gone_takes_no_slot_when_every_slot_is_held(
    setup, listener
) -> None:
    factory, room, tenants = setup
    held = [tenants.waiting(peer=index) for index in range(4)]
    connection, client = tenants.sprayed(listener, peer=99)
    assert connection is None, "closed at accept"
    assert closed_unanswered(client)
    assert factory.counts[Outcome.CONNECTOR_GONE] == 1
    assert factory.counts[Outcome.EVICTED] == 0
    assert not any(c.finished for c, _ in held) and factory.active == 4


def test_with_every_connector_alive_the_fairness_rule_chooses(setup) -> None:
    """The looks find nothing gone: eviction falls where it did without them."""
    factory, room, tenants = setup
    held = [tenants.waiting(peer=index) for index in range(4)]
    tenants.waiting(peer=99)
    assert [c.finished for c, _ in held] == [True, False, False, False]
    assert factory.counts[Outcome.EVICTED] == 1
    assert factory.counts[Outcome.CONNECTOR_GONE] == 0


def test_looks_are_bounded_and_reach_every_connection_in_turn(clock, listener) -> None:
    """
    At most L{GONE_CHECKS} waiting connections are asked per newcomer, and
    those found alive go to the back: the one gone behind them is reached
    by a later newcomer, not never.
    """
    factory, room, tenants = make_room(clock, maxConnections=GONE_CHECKS + 2, maxPerPeer=8)
    try:
        alive = [tenants.waiting(peer=1)[0] for _ in range(GONE_CHECKS + 1)]
        gone, _ = tenants.sprayed(listener, peer=50)
        assert gone is not None
        asked: list[WaitingConnection] = []
        original = factory.identifier.connector_gone

        def counting(sock: socket.socket, accepted: int = 0) -> bool:
            asked.extend(c for c in [*alive, gone] if c.socket is sock)
            return original(sock, accepted)

        factory.identifier.connector_gone = counting  # type: ignore[method-assign]
        tenants.waiting(peer=2)
        # The newcomer itself, then GONE_CHECKS of the oldest, all alive:
        # the fairness rule evicts the oldest of peer 1.
        assert asked == alive[:GONE_CHECKS]
        assert alive[0].finished and not gone.finished
        assert factory.counts[Outcome.EVICTED] == 1
        asked.clear()
        tenants.waiting(peer=3)
        assert asked == [] and not gone.finished, "after a round that found none, one skipped"
        assert factory.counts[Outcome.EVICTED] == 2
        tenants.waiting(peer=4)
        assert gone.finished, "reached on the next round, not never"
        assert factory.counts[Outcome.CONNECTOR_GONE] == 1
        assert 1 <= len(asked) <= GONE_CHECKS
    finally:
        tenants.close()


def test_without_a_liveness_check_no_connector_is_known_gone(clock, listener) -> None:
    """With C{SO_PEERCRED} alone nothing tells a gone connector: the fairness rule alone."""
    factory, room, tenants = make_room(clock, identifier=PeerIdentifier(check=LivenessCheck.NONE))
    try:
        held = [tenants.sprayed(listener, peer=index)[0] for index in range(4)]
        tenants.waiting(peer=99)
        assert [c is not None and c.finished for c in held] == [True, False, False, False]
        assert factory.counts[Outcome.EVICTED] == 1
        assert factory.counts[Outcome.CONNECTOR_GONE] == 0
    finally:
        tenants.close()


def test_one_peer_cannot_hold_more_than_its_share(clock) -> None:
    """
    Beyond its share a peer's newcomer is closed when the accept turn ends
    (C{over_limit}), holding no slot, whether or not slots are free; other
    peers are admitted.
    """
    factory, room, tenants = make_room(clock, maxConnections=8, maxPerPeer=3)
    try:
        held = [tenants.waiting(peer=1) for _ in range(3)]
        shed, client = tenants.connect(peer=1)
        assert shed is None and factory.active == 3
        client.setblocking(False)
        with pytest.raises(BlockingIOError):
            client.recv(1)  # still open while the turn runs: its slot is not refilled yet
        room.closeOverLimit()
        assert closed_unanswered(client) and room.overLimit == []
        assert factory.counts[Outcome.OVER_LIMIT] == 1
        assert factory.active == 3 and room.queues.count(1) == 3
        assert not any(c.finished for c, _ in held), "its own connections stay"
        assert tenants.connect(peer=2)[0] is not None
        held[0][1].sendall(REQUEST)
        held[0][0].doRead()
        assert tenants.connect(peer=1)[0] is not None, "room again once one left"
    finally:
        tenants.close()


def test_the_default_share_is_a_sixteenth_of_the_slots() -> None:
    assert max_waiting_per_peer(512) == 32
    assert max_waiting_per_peer(1024) == 64
    assert max_waiting_per_peer(4) == 1
    assert BrokerFactory(MemoryReactorClock(), maxConnections=512).maxPerPeer == 32


def test_the_peer_is_the_connecting_process(pair) -> None:
    assert peer_pid(pair[0]) == os.getpid()
    closed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    closed.close()
    assert peer_pid(closed) == -1


# --- Mode received: reads and closes through PassedDescriptors. ---


@pytest.mark.usefixtures("reads")
def test_passed_descriptors_end_the_transaction_unanswered(clock) -> None:
    factory, room, tenants = make_room(clock)
    factory.receiveDescriptors(PassedDescriptors(
        connections=lambda: factory.active, reactor=clock,
        descriptorLimit=4096, reserved=64,
    ))
    passed = factory.passed
    assert passed is not None
    try:
        connection, client = tenants.waiting()
        carried = os.open("/dev/null", os.O_RDONLY)
        try:
            client.sendmsg([REQUEST], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [carried]))])
        finally:
            os.close(carried)
        connection.doRead()
        assert connection.finished and closed_unanswered(client)
        assert factory.counts[Outcome.DESCRIPTORS] == 1 and factory.counts[Outcome.OK] == 0
        assert passed.received == 1
        other, otherClient = tenants.waiting()
        otherClient.sendall(REQUEST)
        other.doRead()
        assert reply(otherClient) == wire.encode_ok(os.getpid())
    finally:
        tenants.close()


@pytest.mark.usefixtures("reads")
def test_without_room_reads_go_on_and_meet_no_descriptor(clock) -> None:
    """
    No room in the descriptor table for a full message: a request is still
    read (by peeking first) and answered; a message carrying a descriptor is
    not read at all, and the connection ends unanswered (C{descriptors}).
    """
    factory, room, tenants = make_room(clock)
    factory.receiveDescriptors(PassedDescriptors(
        connections=lambda: factory.active, reactor=clock,
        descriptorLimit=64, reserved=64,
    ))
    passed = factory.passed
    assert passed is not None and not passed.hasRoom()
    try:
        connection, client = tenants.waiting()
        client.sendall(REQUEST)
        connection.doRead()
        assert reply(client) == wire.encode_ok(os.getpid())
        other, otherClient = tenants.waiting()
        carried = os.open("/dev/null", os.O_RDONLY)
        try:
            otherClient.sendmsg([REQUEST], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", [carried]))])
        finally:
            os.close(carried)
        other.doRead()
        assert other.finished
        assert factory.counts[Outcome.DESCRIPTORS] == 1 and factory.counts[Outcome.OK] == 1
        assert passed.received == 0, "nothing carrying a descriptor was read here"
        assert passed.withoutRoom >= 2
    finally:
        tenants.close()


def test_the_accept_time_is_read_at_accept_and_given_to_the_check(clock) -> None:
    """
    The general path reads the identifier's accept clock when the connection
    is admitted, not when its request completes (possibly much later), and
    the check gets that reading.
    """
    identifier = AcceptTimeIdentifier()
    _, _, tenants = make_room(clock, identifier=identifier)
    try:
        connection, client = tenants.waiting(prefix=REQUEST[:3])
        clock.advance(DEADLINE / 2)
        next(identifier.readings)  # time passes on the accept clock too
        client.sendall(REQUEST[3:])
        connection.doRead()
        assert reply(client) == wire.encode_ok(7)
        assert identifier.accepted == [1000]
    finally:
        tenants.close()


def test_no_accept_clock_no_reading(clock) -> None:
    """Where the check needs no accept time (SO_PEERPIDFD), none is read: 0 is passed."""
    identifier = AcceptTimeIdentifier()
    identifier.acceptClock = None
    _, _, tenants = make_room(clock, identifier=identifier)
    try:
        connection, client = tenants.waiting()
        client.sendall(REQUEST)
        connection.doRead()
        assert reply(client) == wire.encode_ok(7)
        assert identifier.accepted == [0]
    finally:
        tenants.close()


def lagging_identifier() -> PeerIdentifier:
    """
    The start-time check (no C{SO_PEERPIDFD}) with its bound on when a
    connection was made lagging far behind, as under a full backlog: every
    process of this test started after the bound plus the PID space's cycle.
    """
    identifier = PeerIdentifier(check=LivenessCheck.PIDFD_OPEN)
    if identifier.check is not LivenessCheck.PIDFD_OPEN or not identifier.startTimes:
        pytest.skip(f"no start-time check here: pidfd_open refused "
                    f"({identifier.pidfdOpenRefused}) or /proc not this PID namespace's")
    identifier.useConnectFloor(lambda: 1)
    return identifier


def test_a_live_connector_is_not_gone_when_the_bound_lags(clock) -> None:
    """
    With the start-time check, whether a connector is gone is asked against
    a moment after its connect (its admission), not against the lagging
    lower bound the answer uses: a live client that started after that
    bound is refused an answer at most (it falls back), never shed at
    admission or evicted as gone.  Before, a room full of live clients shed
    every live newcomer as connector_gone (the PID spray test's
    unexplained closes on a loaded machine, with no peer_gone logged).
    """
    factory, room, tenants = make_room(clock, maxConnections=4, maxPerPeer=8,
                                       identifier=lagging_identifier())
    try:
        held = [tenants.waiting(peer=index) for index in range(4)]
        newcomer, newcomerClient = tenants.connect(peer=99)
        assert newcomer is not None, "a live newcomer is admitted"
        assert factory.counts[Outcome.CONNECTOR_GONE] == 0
        assert factory.counts[Outcome.EVICTED] == 1 and held[0][0].finished
        # The answer still uses the lagging bound: refused, with no reply.
        newcomerClient.sendall(REQUEST)
        newcomer.doRead()
        assert closed_unanswered(newcomerClient)
        assert factory.counts[Outcome.PEER_GONE] == 1
    finally:
        tenants.close()


def test_a_gone_connector_waiting_is_found_with_the_start_time_check(clock, listener) -> None:
    """A gone connector is still found gone (its PID names no process) while the bound lags."""
    factory, room, tenants = make_room(clock, maxConnections=4, maxPerPeer=8,
                                       identifier=lagging_identifier())
    try:
        late, _ = tenants.waiting(peer=1)
        sprayed = [tenants.sprayed(listener, peer=10 + index)[0] for index in range(3)]
        tenants.waiting(peer=2)
        assert not late.finished
        assert [c is not None and c.finished for c in sprayed] == [True, False, False]
        assert factory.counts[Outcome.CONNECTOR_GONE] == 1
        assert factory.counts[Outcome.EVICTED] == 0
    finally:
        tenants.close()
