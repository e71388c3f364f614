"""
The broker's transaction: one 8-byte request in, one 12-byte reply out.

Three pieces, from the inside out:

  - L{answer}: the rule itself.  Given the 8 request bytes and a way to ask
    the kernel who the peer is, it returns the reply bytes or C{None} (close
    with no reply), and says which L{Outcome} that was.  Both the general
    path and the fast path below go through it, so there is one rule.
  - L{BrokerProtocol}: the general path, a small state machine for clients
    that fragment their request, are slow, or half-close.  It buffers exactly
    8 bytes, runs one transaction deadline on an injected clock from
    connection to reply, and never outlives that deadline.
  - L{BrokerFactory}: counts active transactions, and when every slot is
    held gives a newcomer the slot of the oldest connection still waiting
    for its request (which is closed with no reply: I{evicted}); counts
    every outcome and logs failures rate-limited.  It also offers
    L{BrokerFactory.answerWaiting}, the fast path the listening port uses for a
    request that is already waiting when its connection is accepted: answered
    at once, with no protocol, transport or timer, and without holding a slot,
    so silent connections filling every slot cannot starve a real client.
"""

from __future__ import annotations

import _socket
import bisect
import enum
import socket
from collections import OrderedDict
from collections.abc import Callable

import attrs
from twisted.internet.interfaces import (
    IAddress,
    IHalfCloseableProtocol,
    IReactorTime,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from hostpid import defaults, wire
from hostpid.broker.deadlines import ArrivalDeadlines
from hostpid.broker.descriptors import PassedDescriptors
from hostpid.peercred import PeerGone, PeerIdentifier, PeerUnverified


class Outcome(enum.IntEnum):
    """
    How a transaction ended; L{label} names it in metrics and logs.

    An C{IntEnum}, not a plain C{Enum}: every transaction counts its outcome,
    and an C{IntEnum} member indexes a list and hashes in C, where a plain
    member's hash is a Python call.
    """

    OK = 0
    INVALID = 1
    SHORT = 2
    DEADLINE = 3
    OVER_LIMIT = 4
    PEER_CREDENTIALS = 5
    PEER_GONE = 6
    EVICTED = 7
    DESCRIPTORS = 8

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    Outcome.OK: "ok",
    Outcome.INVALID: "invalid",
    Outcome.SHORT: "short",
    Outcome.DEADLINE: "deadline",
    Outcome.OVER_LIMIT: "over_limit",
    Outcome.PEER_CREDENTIALS: "peer_credentials_failed",
    Outcome.PEER_GONE: "peer_gone",
    Outcome.EVICTED: "evicted",
    Outcome.DESCRIPTORS: "descriptors",
}


_OK = Outcome.OK
_FAST_READ = 256
# Plain ints: the socket module's flags are IntFlag members, and OR-ing two of
# them on every transaction costs more than the send itself.
_RECV_FLAGS = int(socket.MSG_DONTWAIT)
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)

#: Upper bounds (seconds) of the transaction latency histogram's buckets.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)


@attrs.define
class LatencyHistogram:
    """
    Accept-to-reply latency of answered transactions, in fixed buckets.

    Kept here, as plain counts, so the hot path pays one C{bisect} and no
    lock; the metrics module turns it into a Prometheus histogram at scrape
    time.
    """

    counts: list[int] = attrs.Factory(lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float, count: int = 1) -> None:
        """C{count} transactions, each answered within C{seconds}."""
        seconds = max(seconds, 0.0)
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += count
        self.total += seconds * count


def answer(
    request: bytes, sock: _socket.socket, identifier: PeerIdentifier
) -> tuple[Outcome, bytes | None]:
    """
    Decide the reply to C{request} (exactly 8 bytes) arriving on C{sock}.

    The peer is identified only after the request is known to be valid, and
    anything short of a verified, positive PID closes with no reply: the
    broker never sends a PID the kernel did not give it, nor one whose
    process has gone.

    @return: the outcome, and the reply bytes or C{None} for "close with no
        reply".
    """
    if not wire.is_valid_request(request):
        return Outcome.INVALID, wire.INVALID_REQUEST_RESPONSE
    try:
        pid = identifier.host_pid(sock)
    except PeerGone:
        return Outcome.PEER_GONE, None
    except PeerUnverified:
        return Outcome.PEER_CREDENTIALS, None
    if pid > wire.PID_MAX:
        return Outcome.PEER_CREDENTIALS, None
    return Outcome.OK, wire.encode_ok(pid)


@implementer(IHalfCloseableProtocol)
class BrokerProtocol(Protocol):
    """
    One transaction on the general path.

    States: I{waiting} (fewer than 8 bytes so far: the factory may evict it
    to make room for a newer connection) and I{finished} (replied, refused,
    evicted or timed out; everything after the 8th byte is ignored).  The
    deadline starts in C{connectionMade} (in the factory's
    L{ArrivalDeadlines}, one delayed call for all) and stops when the
    transaction is evicted or the connection is lost, so no timer outlives
    the connections.

    The protocol holds one of the factory's slots from C{buildProtocol} until
    C{connectionLost}, or until it is evicted, whichever comes first.

    Half-close is supported: a client that sends its 8 bytes and shuts down
    its writing side still gets its reply.
    """

    factory: BrokerFactory

    def __init__(self, factory: BrokerFactory) -> None:
        self.factory = factory
        self._buffer = b""
        self._finished = False
        self._holdsSlot = True
        self._started = 0.0

    def connectionMade(self) -> None:
        self._started = self.factory.clock.seconds()
        self.factory.deadlines.start(self)

    def dataReceived(self, data: bytes) -> None:
        if self._finished:
            return
        self._buffer += data
        if len(self._buffer) < wire.REQUEST_SIZE:
            return
        self._finished = True
        self.factory.stopWaiting(self)
        request = self._buffer[: wire.REQUEST_SIZE]
        self._buffer = b""
        outcome, reply = answer(
            request, self.transport.getHandle(), self.factory.identifier  # type: ignore[union-attr]
        )
        self.factory.record(outcome, self._started)
        if reply is not None:
            self.transport.write(reply)  # type: ignore[union-attr]
        self.transport.loseConnection()  # type: ignore[union-attr]

    def readConnectionLost(self) -> None:
        """The client shut down its writing side: only a short request is lost."""
        if not self._finished:
            self._finish(Outcome.SHORT)
            self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        """The reply is written; nothing else to do."""

    def descriptorsReceived(self) -> None:
        """
        The client passed descriptors (already disposed of by the transport):
        no PID for a message that carried them, whatever else it said.
        """
        self.descriptorsFound()
        self.transport.abortConnection()  # type: ignore[union-attr]

    def descriptorsFound(self) -> None:
        """Descriptors were found while closing: count it, unless already finished."""
        if not self._finished:
            self._finish(Outcome.DESCRIPTORS)

    def evict(self) -> None:
        """
        Close this connection, still waiting for its request, with no reply,
        and give up its slot now: the factory hands the slot to a newer
        connection at once, while the descriptor itself is closed on the
        next reactor turn.
        """
        self._finish(Outcome.EVICTED)
        self._cancelDeadline()
        self._releaseSlot()
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def _deadlineExpired(self) -> None:
        """The factory's L{ArrivalDeadlines} found this one's deadline passed."""
        if not self._finished:
            self._finish(Outcome.DEADLINE)
        self.transport.abortConnection()  # type: ignore[union-attr]

    def _finish(self, outcome: Outcome) -> None:
        self._finished = True
        self.factory.stopWaiting(self)
        self.factory.record(outcome)

    def _cancelDeadline(self) -> None:
        self.factory.deadlines.stop(self)

    def _releaseSlot(self) -> None:
        if self._holdsSlot:
            self._holdsSlot = False
            self.factory.transactionEnded()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._cancelDeadline()
        if not self._finished:
            self._finish(Outcome.SHORT)
        self._releaseSlot()


class BrokerFactory(Factory):
    """
    Builds L{BrokerProtocol}s, at most C{maxConnections} at a time, and keeps
    the books: active transactions and a count per L{Outcome}.

    When every slot is held, a new connection takes the slot of the oldest
    one still waiting for its request, which is closed with no reply
    (L{Outcome.EVICTED}); only when every slot holds a finished transaction
    whose connection is still closing is the newcomer itself refused
    (L{Outcome.OVER_LIMIT}).  So silent connections, static or reconnecting,
    can delay a real client's slot by at most their own lifetime, which
    under a reconnecting flood is about C{maxConnections / attack rate}
    seconds instead of zero: a client slow to send between C{connect} and
    C{send} is answered unless the flood outpaces it by the whole limit.
    The waiting connections are kept in arrival order in an C{OrderedDict},
    so finding, evicting and forgetting one are each O(1).

    Failures are logged only when their count reaches a power of two, so a
    flood of bad clients costs a handful of log lines, not one per
    connection, and the counts in the log still tell how big it was.
    """

    log = Logger()
    noisy = False

    def __init__(
        self,
        clock: IReactorTime,
        deadline: float = defaults.DEADLINE,
        maxConnections: int = defaults.MAX_CONNECTIONS,
        identifier: PeerIdentifier | None = None,
    ) -> None:
        self.clock = clock
        self.identifier = identifier if identifier is not None else PeerIdentifier()
        self.deadline = deadline
        self.maxConnections = maxConnections
        self.active = 0
        #: Finished transactions, indexed by L{Outcome}.
        self.counts: list[int] = [0] * len(Outcome)
        self.latency = LatencyHistogram()
        self._idle: list[Callable[[], None]] = []
        #: Answers given at accept (fast path) since the last L{observeAccepted}.
        self.answeredAtAccept = 0
        #: Set by L{receiveDescriptors} where the kernel cannot refuse them.
        self.passed: PassedDescriptors | None = None
        #: Protocols still waiting for their request, oldest first.
        self._waiting: OrderedDict[BrokerProtocol, None] = OrderedDict()
        #: Every open transaction's deadline, behind one delayed call: they
        #: all have the same length, so they expire in arrival order.
        self.deadlines: ArrivalDeadlines[BrokerProtocol] = ArrivalDeadlines(
            clock, deadline, BrokerProtocol._deadlineExpired
        )

    def buildProtocol(self, addr: IAddress) -> BrokerProtocol | None:  # type: ignore[override]
        if self.active >= self.maxConnections:
            if not self._waiting:
                self.record(Outcome.OVER_LIMIT)
                return None
            oldest, _ = self._waiting.popitem(last=False)
            oldest.evict()
        self.active += 1
        protocol = BrokerProtocol(self)
        self._waiting[protocol] = None
        return protocol

    @property
    def waiting(self) -> int:
        """How many connections hold a slot while still waiting for their request."""
        return len(self._waiting)

    def stopWaiting(self, protocol: BrokerProtocol) -> None:
        """C{protocol} has its request, or is finished: it can no longer be evicted."""
        self._waiting.pop(protocol, None)

    def transactionEnded(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle:
            waiting, self._idle = self._idle, []
            for callback in waiting:
                callback()

    def whenIdle(self, callback: Callable[[], None]) -> None:
        """Call C{callback} once no transaction is active (now, if none is)."""
        if self.active == 0:
            callback()
        else:
            self._idle.append(callback)

    def record(self, outcome: Outcome, started: float | None = None) -> None:
        """
        Count a finished transaction; for an answered one, C{started} (on
        C{self.clock}) gives its latency.
        """
        count = self.counts[outcome] + 1
        self.counts[outcome] = count
        if outcome is Outcome.OK:
            if started is not None:
                self.latency.observe(self.clock.seconds() - started)
        elif count & (count - 1) == 0:
            self.log.warn(
                "hostpid-broker: {outcome} transactions so far: {count}",
                outcome=outcome.label,
                count=count,
            )

    def receiveDescriptors(self, passed: PassedDescriptors) -> None:
        """
        The kernel cannot refuse passed descriptors on this listener: read
        and close every connection through C{passed} from now on.  The fast
        path becomes L{answerWaitingReceiving}; the port's transport does the
        same on the general path.
        """
        self.passed = passed
        self.answerWaiting = self.answerWaitingReceiving  # type: ignore[method-assign]

    def answerWaiting(self, sock: _socket.socket) -> bytes | None:
        """
        The fast path, for a connection just accepted, where the kernel
        refuses passed descriptors (so a plain C{recv} cannot meet one).

        If its whole request is already waiting, answer it now and close the
        socket: return C{None}.  Otherwise return the bytes read so far (maybe
        none) for the general path to continue from.  Never blocks.
        """
        try:
            # Read a little more than the request: bytes after the 8th are
            # ignored, and swallowing them here means closing the socket does
            # not reset the connection before the client reads its reply.
            data = sock.recv(_FAST_READ, _RECV_FLAGS)
        except BlockingIOError:
            return b""
        except OSError:
            sock.close()
            self.record(Outcome.SHORT)
            return None
        if len(data) < wire.REQUEST_SIZE:
            if data:
                return data
            # End of file before any byte: the client went away.
            sock.close()
            self.record(Outcome.SHORT)
            return None
        outcome, reply = answer(data[: wire.REQUEST_SIZE], sock, self.identifier)
        if reply is not None:
            try:
                sock.send(reply, _SEND_FLAGS)
            except OSError:
                pass
        sock.close()
        if outcome is _OK:
            # Counted here, timed per accept batch by the port (observeAccepted):
            # no clock read and no histogram work per answer.
            self.counts[_OK] += 1
            self.answeredAtAccept += 1
        else:
            self.record(outcome)
        return None

    def observeAccepted(self, started: float) -> None:
        """
        The port's accept batch that began at C{started} (on C{self.clock})
        is over: the answers it gave at accept each took at most the batch's
        duration from accept to reply, and are observed as that.  One clock
        read and one bucket per batch instead of two and one per answer.
        """
        count, self.answeredAtAccept = self.answeredAtAccept, 0
        self.latency.observe(self.clock.seconds() - started, count)

    def answerWaitingReceiving(self, sock: _socket.socket) -> bytes | None:
        """
        L{answerWaiting} where clients can pass descriptors: read with room
        for them, answer no message that carried any (outcome
        L{Outcome.DESCRIPTORS}), and close through L{PassedDescriptors} so
        that no descriptor's last reference is dropped in this thread.
        Without room in the descriptor table for a full message
        (L{PassedDescriptors.hasRoom}) the read peeks first and takes only
        bytes that carry no descriptor.
        """
        passed = self.passed
        assert passed is not None
        try:
            data = passed.readFirst(sock, _FAST_READ)
        except BlockingIOError:
            return b""
        except OSError:
            passed.release(sock)
            self.record(Outcome.SHORT)
            return None
        if data is None:
            passed.release(sock)
            self.record(Outcome.DESCRIPTORS)
            return None
        if len(data) < wire.REQUEST_SIZE:
            if data:
                return data
            passed.release(sock)
            self.record(Outcome.SHORT)
            return None
        outcome, reply = answer(data[: wire.REQUEST_SIZE], sock, self.identifier)
        if reply is not None:
            try:
                sock.send(reply, _SEND_FLAGS)
            except OSError:
                pass
        if passed.release(sock):
            # Descriptors arrived after the request: the reply is already
            # sent, but the transaction is counted for what the client did.
            outcome = Outcome.DESCRIPTORS
        if outcome is _OK:
            self.counts[_OK] += 1
            self.answeredAtAccept += 1
        else:
            self.record(outcome)
        return None
