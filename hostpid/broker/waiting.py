"""
Connections still waiting for their request: the broker's general path.

A connection whose 8 bytes were not all there when it was accepted (the
fast path, L{BrokerFactory.answerWaiting}, answers the others) is held here
until its request is complete, it ends, its deadline passes, or it is
evicted.  Under a reconnecting flood almost every connection the broker
accepts is one of these, and the broker can only drain its listen backlog
as fast as it can take them in and shed them: about 80 us was measured
of CPU per such connection when each was a whole Twisted transport (built,
registered, given a deadline, aborted with a new C{Failure}, closed on the
next turn), against a few us in the C yardstick, and real clients starved in
the backlog behind the attackers.

So a waiting connection is the accepted C-level socket and a small
L{WaitingConnection}, registered with the reactor directly as an
C{IReadDescriptor}, its deadline in one L{ArrivalDeadlines}, and closed
synchronously (after C{removeReader}, with its descriptor number forgotten,
so no stale event can reach another connection): no transport, no protocol,
no per-connection timer, no C{Failure}.  The reply is 12 bytes on a fresh
socket whose send buffer is empty, so one non-blocking C{send} writes it
whole, as the fast path already relies on.

L{WaitingRoom} admits them, by the rule of L{hostpid.broker.fairness}:

  - each is keyed by its peer's PID, read once at accept (C{SO_PEERCRED}
    as a C int).  Not the UID: in Kubernetes most workloads run as root in
    the node's user namespace, so every real client of every pod would share
    one key with an attacker running as root, and eviction from the peer
    holding the most would fall on them.  Not the cgroup (the pod), though it
    would be the better unit against a pod that forks many attacker
    processes: it costs a lookup per connection on exactly the path that
    must be cheap (C{PIDFD_GET_INFO} needs Linux 6.13, else a
    C{/proc/PID/cgroup} read of several us), and with eviction from the peer
    holding the most, an attacker that spreads over many processes still
    loses its slots first until it runs one process per slot;
  - a peer already holding L{BrokerFactory.maxPerPeer} waiting connections
    has its newcomer closed at the end of the accept turn (outcome
    C{over_limit}, L{WaitingRoom.closeOverLimit}): as cheap as the C
    yardstick's shedding, so one process cannot take every slot.  Not at
    once: each close wakes a reconnecting attacker, whose next connect
    takes the backlog slot that accept has just freed, so the backlog
    stayed full and a real client retrying its non-blocking connect on
    C{EAGAIN} every few ms could find no room for its whole deadline (1
    to 6 clients of 400 under four reconnecting tenants).  Closed after
    the turn, the turn's slots stay free while it runs;
  - when every slot is held, a newcomer whose connector has already exited
    is closed at once, and otherwise a waiting connection whose connector
    has exited gives up its slot (outcome C{connector_gone} for both): it
    can never be answered, and without this rule an attacker connecting
    each socket from a fresh child that exits at once holds every slot with
    one process, no PID holding two.  Finding one costs the liveness check
    (L{PeerIdentifier.connector_gone}: C{SO_PEERPIDFD} and one
    C{pidfd_send_signal}, or C{pidfd_open} and the start time before Linux
    6.5), asked only while every slot is held and of at most
    L{GONE_CHECKS} waiting connections per newcomer, in the rotating order
    of L{Rotation} so that each is reached in turn; after a round that
    found none, the next rounds are skipped (L{LookBackoff}: 1, 2, 4, ...
    up to 32 newcomers), so a flood from live processes pays for the looks
    on about one newcomer in 33;
  - failing that, the oldest waiting connection of the peer holding the
    most gives up its slot (outcome C{evicted}).  A connection
    that was answered has already left (it closed when answered), so an
    answered connection is never evicted, and a late sender from an
    otherwise idle peer keeps its slot while any peer holds two or more.

Where clients can pass descriptors (mode I{received}), every read and close
goes through L{PassedDescriptors}, as on the fast path: with room in the
descriptor table a read takes any message (descriptors are disposed of);
without it, only bytes that carry none (L{PassedDescriptors.receiveWithoutRoom}),
so reads slow down but never stop.
"""

from __future__ import annotations

import _socket
import socket
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReadDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

from hostpid import wire
from hostpid.broker.connections import Connection, getsockopt
from hostpid.broker.connections import helper as _native
from hostpid.broker.deadlines import ArrivalDeadlines
from hostpid.broker.fairness import LookBackoff, PeerQueues, Rotation
from hostpid.broker.server import BrokerFactory, Outcome, answer
from hostpid.starttime import boottime_ns

_SOL_SOCKET = int(socket.SOL_SOCKET)
_SO_PEERCRED = int(socket.SO_PEERCRED)
_RECV_FLAGS = int(socket.MSG_DONTWAIT)
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_REQUEST_SIZE = wire.REQUEST_SIZE
#: Read a little more than the request: bytes after the 8th are ignored, and
#: swallowing them means the close does not reset the connection before the
#: client has read its reply.
_READ = 256
_OK = Outcome.OK
_close_all = getattr(_native, "close_all", None)
_SHORT = Outcome.SHORT
_OVER_LIMIT = Outcome.OVER_LIMIT
_CONNECTOR_GONE = Outcome.CONNECTOR_GONE

#: Waiting connections asked whether their connector still exists, at most,
#: for one newcomer when every slot is held, before the fairness rule
#: chooses.  Under a PID spray nearly every one is gone and the first look
#: finds one; under a flood from live processes every look is wasted, and
#: this bounds what that costs a newcomer (a few microseconds each).
GONE_CHECKS = 4


def peer_pid(sock: _socket.socket) -> int:
    """
    The peer's PID as C{SO_PEERCRED} reports it, as a C int (the kernel
    copies as much of C{struct ucred} as the buffer holds; the PID comes
    first); -1 when the kernel refuses.  Only a key for fairness: the answer
    itself is decided by L{hostpid.peercred.PeerIdentifier}.
    """
    try:
        pid: int = sock.getsockopt(_SOL_SOCKET, _SO_PEERCRED)
    except OSError:
        return -1
    return pid


@implementer(IReadDescriptor)
class WaitingConnection:
    """
    One accepted connection whose request is not complete yet: its socket,
    the bytes so far, its peer and when it was accepted.  It holds one of
    the factory's slots until L{finish}.
    """

    __slots__ = ("socket", "fd", "peer", "started", "accepted", "admitted", "finished",
                 "_buffer", "_room")

    def __init__(
        self,
        room: WaitingRoom,
        sock: _socket.socket,
        peer: int,
        prefix: bytes,
        accepted: int = 0,
        admitted: int = 0,
    ) -> None:
        """
        @param accepted: when it was accepted on the identifier's
            L{PeerIdentifier.acceptClock} (the liveness check without
            C{SO_PEERPIDFD} compares the peer's start time with it: a
            lower bound on when it was connected, for the answer), or 0
            where the check needs none.
        @param admitted: when it was admitted (L{boottime_ns}, read after
            its accept: an upper bound on when it was connected, for
            L{PeerIdentifier.connector_gone}), or 0 where the check needs none.
        """
        self._room = room
        self.socket = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.started = 0.0
        self.accepted = accepted
        self.admitted = admitted
        self.finished = False
        self._buffer = prefix

    def fileno(self) -> int:
        return self.fd

    def logPrefix(self) -> str:
        return "hostpid-broker"

    def doRead(self) -> None:
        if self.finished:
            return
        passed = self._room.factory.passed
        try:
            if passed is None:
                data = self.socket.recv(_READ, _RECV_FLAGS)
            else:
                if passed.mayReceive():
                    data, carried = passed.receive(self.socket, _READ)
                else:
                    # A read now could overflow the descriptor table, and the
                    # kernel would release what does not fit here: read only
                    # what carries no descriptor (slower, never stopped).
                    data, carried = passed.receiveWithoutRoom(self.socket, _READ)
                if carried:
                    self.finish(Outcome.DESCRIPTORS)
                    return
        except BlockingIOError:
            return
        except OSError:
            self.finish(_SHORT)
            return
        if not data:
            # End of file (the client went away, or shut down its writing
            # side) before the whole request.
            self.finish(_SHORT)
            return
        request = self._buffer + data
        if len(request) < _REQUEST_SIZE:
            self._buffer = request
            return
        outcome, reply = answer(
            request[:_REQUEST_SIZE], self.socket, self._room.factory.identifier, self.accepted
        )
        if reply is not None:
            try:
                self.socket.send(reply, _SEND_FLAGS)
            except OSError:
                pass
        self.finish(outcome)

    def connectionLost(self, reason: Failure | None = None) -> None:
        """The reactor is letting go of us (it is shutting down)."""
        self.finish(_SHORT)

    def expire(self) -> None:
        """The deadline passed with no whole request."""
        self.finish(Outcome.DEADLINE)

    def finish(self, outcome: Outcome) -> None:
        """
        End the transaction with C{outcome}: leave the waiting set, the
        deadlines and the reactor, give up the slot, close, and count it.
        Once only; the descriptor number is forgotten before anything else
        can be given it.
        """
        if self.finished:
            return
        self.finished = True
        room = self._room
        room.queues.remove(self, self.peer)
        room.rotation.remove(self)
        room.deadlines.stop(self)
        room.reactor.removeReader(self)
        self.fd = -1
        factory = room.factory
        factory.transactionEnded()
        passed = factory.passed
        if passed is None:
            self.socket.close()
        elif passed.release(self.socket) and outcome is _OK:
            # Descriptors arrived after the request: the reply is sent, but
            # the transaction is counted for what the client did.
            outcome = Outcome.DESCRIPTORS
        if outcome is _OK:
            factory.record(outcome, self.started)
        else:
            factory.record(outcome)


class WaitingRoom:
    """
    Admits accepted connections whose request is not complete yet, within
    the factory's limits, and evicts by the fairness rule (see the module
    docstring).

    @ivar queues: the waiting connections by peer.
    @ivar deadlines: every waiting connection's deadline, behind one delayed
        call.
    @ivar rotation: the waiting connections in the order they are asked
        whether their connector still exists.
    @ivar backoff: when those questions are skipped (after rounds that
        found nothing).
    """

    def __init__(
        self,
        factory: BrokerFactory,
        reactor: Any,
        peerOf: Callable[[_socket.socket], int] = peer_pid,
    ) -> None:
        """
        @param reactor: an C{IReactorFDSet} and C{IReactorTime} (the
            factory's clock, normally).
        @param peerOf: the key of a connection's peer (for tests; by default
            its PID).
        """
        self.factory = factory
        self.reactor = reactor
        self._peerOf = peerOf
        self.queues: PeerQueues[WaitingConnection, int] = PeerQueues(factory.maxPerPeer)
        #: The peers (PIDs) that hold their share of waiting connections, for
        #: the port's accept turn (L{admitAccepted}'s first test, without a
        #: call); C{None} where peers are keyed otherwise (C{peerOf}).
        self.peersAtShare: dict[int, None] | None = (
            self.queues.atBound if peerOf is peer_pid else None
        )
        #: Connections turned away at admission, closed at the end of the turn.
        self.overLimit: list[Connection] = []
        self.rotation: Rotation[WaitingConnection] = Rotation()
        self.backoff = LookBackoff()
        self.deadlines: ArrivalDeadlines[WaitingConnection] = ArrivalDeadlines(
            reactor, factory.deadline, WaitingConnection.expire
        )

    def __len__(self) -> int:
        """How many connections are waiting for their request."""
        return len(self.queues)

    def admitAccepted(
        self, conn: Connection, prefix: bytes, peer: int | None = None
    ) -> WaitingConnection | None:
        """
        L{admit} for a connection as the port accepted it (of the kind the
        factory's L{ConnectionCalls} make: a bare descriptor where the C
        helper is built), with its peer's PID if the accept read it
        (C{SO_PEERCRED}; -1 where the kernel refused).  A newcomer of a
        peer that holds its share already, the common case under a flood,
        is set aside as it is, with no socket object made for it; only a
        connection admitted becomes one.
        """
        if self._peerOf is not peer_pid:
            return self.admit(self.factory.calls.socketOf(conn), prefix)
        if peer is None:
            try:
                peer = getsockopt(conn, _SOL_SOCKET, _SO_PEERCRED)
            except OSError:
                peer = -1
        if self.queues.count(peer) >= self.factory.maxPerPeer:
            self.overLimit.append(conn)
            return None
        return self.admit(self.factory.calls.socketOf(conn), prefix, peer)

    def admit(
        self, sock: _socket.socket, prefix: bytes, peer: int | None = None
    ) -> WaitingConnection | None:
        """
        Hold C{sock}, just accepted with C{prefix} (fewer than 8 bytes, maybe
        none) of its request read, until its request is complete; or, if its
        peer holds its share already, close it when this accept turn ends
        (L{closeOverLimit}).

        @return: the waiting connection, or C{None} if it was closed.
        """
        factory = self.factory
        if peer is None:
            peer = self._peerOf(sock)
        queues = self.queues
        if queues.count(peer) >= factory.maxPerPeer:
            # The common case under a flood: as cheap as it can be made.
            self.overLimit.append(sock)
            return None
        # As the port accepts it: the accept time the liveness check without
        # SO_PEERPIDFD compares start times with when it answers (the port's
        # bound on when the connection was made, which lags while the
        # backlog stays full), and, for the question whether its connector
        # is gone, now: after the accept, so after the connect.  A process
        # that started after now cannot be the connector; one that started
        # between the two bounds may be (the bound lagged), and asked with
        # the lagging one it was taken for gone: a live client, shed at
        # admission or evicted while it wrote (outcome connector_gone), many
        # a run of the PID spray test on a loaded machine.
        acceptClock = factory.identifier.acceptClock
        if acceptClock is not None:
            accepted = acceptClock()
            admitted = boottime_ns()
        else:
            accepted = admitted = 0
        if factory.active >= factory.maxConnections:
            looking = self.backoff.due()
            if looking and factory.identifier.connector_gone(sock, admitted):
                # It could never be answered: it takes no one's slot.
                self.backoff.looked(True)
                self._shed(sock, _CONNECTOR_GONE)
                return None
            if not looking or not self._evictGone():
                victim = queues.victim()
                if victim is None:
                    # Every slot is held by something that is not waiting: not
                    # reachable today (an answered connection leaves at once).
                    self._shed(sock)
                    return None
                victim[0].finish(Outcome.EVICTED)
        connection = WaitingConnection(self, sock, peer, prefix, accepted, admitted)
        factory.transactionStarted()
        queues.add(connection, peer)
        self.rotation.add(connection)
        connection.started = self.deadlines.start(connection)
        self.reactor.addReader(connection)
        return connection

    def closeOverLimit(self) -> None:
        """
        Close the connections L{admit} turned away this accept turn (see
        the module docstring for why not at once).  The port calls this at
        the end of every turn, however it ended.
        """
        over, self.overLimit = self.overLimit, []
        descriptors = [conn for conn in over if type(conn) is int]
        if descriptors:
            self._shedAccepted(descriptors)
        if len(descriptors) < len(over):
            for conn in over:
                if type(conn) is not int:
                    self._shed(conn)

    def _evictGone(self) -> bool:
        """
        Ask up to L{GONE_CHECKS} waiting connections, in turn, whether their
        connector has exited; close the first that has (outcome
        C{connector_gone}).

        @return: whether a slot was freed.
        """
        rotation = self.rotation
        connectorGone = self.factory.identifier.connector_gone
        for _ in range(min(GONE_CHECKS, len(rotation))):
            connection = rotation.next()
            assert connection is not None
            if connectorGone(connection.socket, connection.admitted):
                connection.finish(_CONNECTOR_GONE)
                self.backoff.looked(True)
                return True
        self.backoff.looked(False)
        return False

    def _shedAccepted(self, fds: list[int]) -> None:
        """
        L{_shed} of connections still held as their descriptors
        (L{admitAccepted}): in mode I{refused} closed in one call to the C
        helper; in mode I{received} each released and watched as every
        close of a connection is.
        """
        factory = self.factory
        passed = factory.passed
        if passed is None and _close_all is not None:
            _close_all(fds)
        elif passed is None:
            for fd in fds:
                factory.calls.close(fd)
        else:
            for fd in fds:
                passed.releaseDescriptor(fd)
        factory.recordMany(_OVER_LIMIT, len(fds))

    def _shed(self, sock: _socket.socket, outcome: Outcome = _OVER_LIMIT) -> None:
        factory = self.factory
        if factory.passed is not None:
            # Maybe part-read: its queue may hold descriptors.
            factory.passed.release(sock)
        else:
            sock.close()
        factory.record(outcome)
