"""
The broker's transaction: one 8-byte request in, one 12-byte reply out.

Two pieces here, and the general path beside them:

  - L{answer}: the rule itself.  Given the 8 request bytes and a way to ask
    the kernel who the peer is, it returns the reply bytes or C{None} (close
    with no reply), and says which L{Outcome} that was.  Both paths go
    through it, so there is one rule.
  - L{BrokerFactory}: the books (slots, a count per outcome, latency; failures
    logged rate-limited) and the fast path, L{BrokerFactory.answerWaiting},
    which the listening port uses for a request that is already waiting when
    its connection is accepted: answered at once, with no reader, timer or
    slot, so silent connections filling every slot cannot starve a real
    client.
  - The general path, for clients that fragment their request, are slow or
    half-close, is L{hostpid.broker.waiting}: a raw socket and a minimal
    reader per connection, one deadline for all, and the fairness rule of
    L{hostpid.broker.fairness} when every slot is held.
"""

from __future__ import annotations

import bisect
import enum
import socket
from collections.abc import Callable

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Factory
from twisted.logger import Logger

from hostpid import defaults, wire
from hostpid.broker.connections import Connection, ConnectionCalls, default_calls
from hostpid.broker.connections import helper as _native
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
    CONNECTOR_GONE = 9

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
    Outcome.CONNECTOR_GONE: "connector_gone",
}


_OK = Outcome.OK
_INVALID = Outcome.INVALID
_REQUEST = wire.GET_HOST_PID_REQUEST
_REQUEST_SIZE = wire.REQUEST_SIZE
_INVALID_REPLY = wire.INVALID_REQUEST_RESPONSE
_PID_MAX = wire.PID_MAX
_OK_PREFIX = wire.OK_PREFIX
_FAST_READ = 256
# Plain ints: the socket module's flags are IntFlag members, and OR-ing two of
# them on every transaction costs more than the send itself.
_RECV_FLAGS = int(socket.MSG_DONTWAIT)
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)

#: The share of the slots one peer may hold waiting, by default: with 512
#: slots, 32.  A real client asks once per process (HAMi-core), so a peer
#: with more than a handful waiting is a process that opens connections and
#: does not send; sixteen such processes are needed to fill every slot, and
#: even then eviction falls on them first.
PER_PEER_SHARE = 16


def max_waiting_per_peer(maxConnections: int) -> int:
    """The default bound on one peer's waiting connections (at least 1)."""
    return max(1, maxConnections // PER_PEER_SHARE)


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
    request: bytes, sock: Connection, identifier: PeerIdentifier, accepted: int = 0
) -> tuple[Outcome, bytes | None]:
    """
    Decide the reply to C{request} (exactly 8 bytes) arriving on C{sock} (a
    socket object, or a fast-path connection: L{hostpid.broker.connections}),
    accepted at C{accepted} (the identifier's L{PeerIdentifier.acceptClock},
    or 0 where it needs none).

    The peer is identified only after the request is known to be valid, and
    anything short of a verified, positive PID closes with no reply: the
    broker never sends a PID the kernel did not give it, nor one whose
    process has gone.

    @return: the outcome, and the reply bytes or C{None} for "close with no
        reply".
    """
    # Module-level names for what wire defines: on Python 3.11 an enum
    # member's attribute access and two module lookups cost more than the
    # comparison itself, and this runs once per transaction.
    if request != _REQUEST:
        return Outcome.INVALID, _INVALID_REPLY
    try:
        pid = identifier.host_pid(sock, accepted)
    except PeerGone:
        return Outcome.PEER_GONE, None
    except PeerUnverified:
        return Outcome.PEER_CREDENTIALS, None
    if not 0 < pid <= _PID_MAX:
        return Outcome.PEER_CREDENTIALS, None
    # wire.encode_ok's reply, its range check made just above (as a clean
    # outcome rather than its ValueError, whatever the identifier returned).
    return _OK, _OK_PREFIX + pid.to_bytes(4, "big")


class BrokerFactory(Factory):
    """
    The books of the broker's transactions: the slots (at most
    C{maxConnections} active at once, at most C{maxPerPeer} of them waiting
    for one peer's requests), a count per L{Outcome} and the latency
    histogram; and the fast path, L{answerWaiting}.

    The connections that hold slots, and the rule of who gives one up when
    every slot is held, are L{hostpid.broker.waiting.WaitingRoom}'s.

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
        maxPerPeer: int | None = None,
        calls: ConnectionCalls | None = None,
    ) -> None:
        """
        @param maxPerPeer: waiting connections one peer (PID) may hold; by
            default L{max_waiting_per_peer} of C{maxConnections}.
        @param calls: what the fast path's connections are and the calls
            made on them; by default descriptors where the C helper is
            built (L{hostpid.broker.connections.default_calls}).
        """
        self.clock = clock
        self.identifier = identifier if identifier is not None else PeerIdentifier()
        self.deadline = deadline
        self.maxConnections = maxConnections
        self.maxPerPeer = (
            max_waiting_per_peer(maxConnections) if maxPerPeer is None else maxPerPeer
        )
        self.active = 0
        #: Finished transactions, indexed by L{Outcome}.
        self.counts: list[int] = [0] * len(Outcome)
        self.latency = LatencyHistogram()
        self._idle: list[Callable[[], None]] = []
        #: Answers given at accept (fast path) since the last L{observeAccepted}.
        self.answeredAtAccept = 0
        #: The listening port's backlog markers (L{hostpid.broker.port}):
        #: each one's 8 bytes, and the moment it was connected.  A marker is
        #: not a transaction: it is recognized where an invalid request
        #: would be answered, so valid requests pay nothing for it.
        self.markers: dict[bytes, int] = {}
        self.markerSeen: Callable[[int], None] | None = None
        #: Set by L{receiveDescriptors} where the kernel cannot refuse them.
        self.passed: PassedDescriptors | None = None
        #: What the port accepts, and what L{answerWaiting} is given.
        self.calls = calls if calls is not None else default_calls()
        # Bound once: the fast path makes these calls on every transaction.
        self._recv = self.calls.recv
        self._send = self.calls.send
        self._close = self.calls.close
        self._release: Callable[[Connection, bytes | None], bool] | None = None
        #: The C helper's send-then-close, where connections are descriptors.
        self._replyClose: Callable[[int, bytes | None], None] | None = (
            getattr(_native, "reply_close", None) if self.calls.native else None
        )

    def transactionStarted(self) -> None:
        """A connection took a slot."""
        self.active += 1

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

    def recordMany(self, outcome: Outcome, count: int) -> None:
        """
        Count C{count} finished transactions that ended in C{outcome} (not
        L{Outcome.OK}), as L{record} would one by one: logged once if the
        count passed a power of two meanwhile.
        """
        before = self.counts[outcome]
        after = self.counts[outcome] = before + count
        if after.bit_length() > before.bit_length():
            self.log.warn(
                "hostpid-broker: {outcome} transactions so far: {count}",
                outcome=outcome.label,
                count=after,
            )

    def receiveDescriptors(self, passed: PassedDescriptors) -> None:
        """
        The kernel cannot refuse passed descriptors on this listener: read
        and close every connection through C{passed} from now on.  The fast
        path becomes L{answerWaitingReceiving}; the general path
        (L{hostpid.broker.waiting}) reads and closes through C{passed} too.
        """
        if self.calls.native and not passed.native:
            raise ValueError("connections held as descriptors need the C helper's release")
        self.passed = passed
        self._release = passed.releaseDescriptor if self.calls.native else passed.release
        self.answerWaiting = self.answerWaitingReceiving  # type: ignore[method-assign]
        self._answerRead = self._answerReadReceiving  # type: ignore[method-assign]

    def answerWaiting(self, sock: Connection) -> bytes | None:
        """
        The fast path, for a connection just accepted (of the kind
        L{calls} makes), where the kernel refuses passed descriptors (so a
        plain C{recv} cannot meet one).

        If its whole request is already waiting, answer it now and close the
        connection: return C{None}.  Otherwise return the bytes read so far
        (maybe none) for the general path to continue from, the connection
        still open.  Never blocks.
        """
        acceptClock = self.identifier.acceptClock
        accepted = acceptClock() if acceptClock is not None else 0
        try:
            # Read a little more than the request: bytes after the 8th are
            # ignored, and swallowing them here means closing the socket does
            # not reset the connection before the client reads its reply.
            data = self._recv(sock, _FAST_READ, _RECV_FLAGS)
        except BlockingIOError:
            return b""
        except OSError:
            self._close(sock)
            self.record(Outcome.SHORT)
            return None
        return self._answerRead(sock, data, accepted)

    def answerAccepted(self, conn: Connection, data: bytes | tuple[()] | int) -> bytes | None:
        """
        L{answerWaiting} (or L{answerWaitingReceiving}) of a connection the
        port's batch accepted and read (L{hostpid.broker.port}): C{data} is
        what that first read gave, the bytes, or an C{int} errno if it
        failed, or C{()} if descriptors are waiting (mode I{received}).
        Never given a connection with nothing waiting yet: the port admits
        those to the waiting room itself.
        """
        if type(data) is bytes:
            acceptClock = self.identifier.acceptClock
            return self._answerRead(
                conn, data, acceptClock() if acceptClock is not None else 0
            )
        release = self._release
        if release is None:
            self._close(conn)
        else:
            release(conn, None)
        self.record(Outcome.SHORT if type(data) is int else Outcome.DESCRIPTORS)
        return None

    def _answerRead(self, sock: Connection, data: bytes, accepted: int) -> bytes | None:
        """
        The fast path once the first read gave C{data} (mode I{refused}):
        answer a whole request and close, or return the bytes so far for
        the general path.
        """
        if len(data) < _REQUEST_SIZE:
            if data:
                return data
            # End of file before any byte: the client went away.
            self._close(sock)
            self.record(Outcome.SHORT)
            return None
        outcome, reply = answer(data[:_REQUEST_SIZE], sock, self.identifier, accepted)
        if outcome is _INVALID and self.markers and self._isMarker(data):
            self._close(sock)
            return None
        replyClose = self._replyClose
        if replyClose is not None and type(sock) is int:
            # Where connections are descriptors: the send and the close in
            # one call to the C helper.
            replyClose(sock, reply)
        else:
            if reply is not None:
                try:
                    self._send(sock, reply, _SEND_FLAGS)
                except OSError:
                    pass
            self._close(sock)
        if outcome is _OK:
            # Counted here, timed per accept batch by the port (observeAccepted):
            # no clock read and no histogram work per answer.
            self.counts[_OK] += 1
            self.answeredAtAccept += 1
        else:
            self.record(outcome)
        return None

    def _isMarker(self, data: bytes) -> bool:
        """
        Whether C{data}, an invalid request, is one of the port's backlog
        markers: if so, every connection accepted from now on was made after
        that marker was, and the port is told (L{markerSeen}).
        """
        made = self.markers.pop(bytes(data[:_REQUEST_SIZE]), None)
        if made is None:
            return False
        if self.markerSeen is not None:
            self.markerSeen(made)
        return True

    def observeAccepted(self, started: float) -> None:
        """
        The port's accept batch that began at C{started} (on C{self.clock})
        is over: the answers it gave at accept each took at most the batch's
        duration from accept to reply, and are observed as that.  One clock
        read and one bucket per batch instead of two and one per answer.
        """
        count, self.answeredAtAccept = self.answeredAtAccept, 0
        self.latency.observe(self.clock.seconds() - started, count)

    def answerWaitingReceiving(self, sock: Connection) -> bytes | None:
        """
        L{answerWaiting} where clients can pass descriptors: read with room
        for them, answer no message that carried any (outcome
        L{Outcome.DESCRIPTORS}), and close through L{PassedDescriptors} so
        that no descriptor's last reference is dropped in this thread.
        Without room in the descriptor table for a full message
        (L{PassedDescriptors.hasRoom}) the read peeks first and takes only
        bytes that carry no descriptor.
        """
        passed, release = self.passed, self._release
        assert passed is not None and release is not None
        acceptClock = self.identifier.acceptClock
        accepted = acceptClock() if acceptClock is not None else 0
        try:
            data = passed.readFirst(sock, _FAST_READ, self.active)
        except BlockingIOError:
            return b""
        except OSError:
            release(sock, None)
            self.record(Outcome.SHORT)
            return None
        if data is None:
            release(sock, None)
            self.record(Outcome.DESCRIPTORS)
            return None
        return self._answerReadReceiving(sock, data, accepted)

    def _answerReadReceiving(self, sock: Connection, data: bytes, accepted: int) -> bytes | None:
        """L{_answerRead} where clients can pass descriptors: closes go through the release."""
        release = self._release
        assert release is not None
        if len(data) < _REQUEST_SIZE:
            if data:
                return data
            release(sock, None)
            self.record(Outcome.SHORT)
            return None
        outcome, reply = answer(data[:_REQUEST_SIZE], sock, self.identifier, accepted)
        if outcome is _INVALID and self.markers and self._isMarker(data):
            release(sock, None)
            return None
        # The reply is sent by the release, in the same call to the C helper.
        if release(sock, reply):
            # Descriptors arrived after the request: the reply is already
            # sent, but the transaction is counted for what the client did.
            outcome = Outcome.DESCRIPTORS
        if outcome is _OK:
            self.counts[_OK] += 1
            self.answeredAtAccept += 1
        else:
            self.record(outcome)
        return None
