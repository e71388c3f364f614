"""
The broker's listening Unix port.

Twisted's L{twisted.internet.unix.Port} breaks three of the design's rules
(see C{notes/twisted-pitfalls.md}; checked against Twisted 26.10):

  - its C{connectionLost} unlinks the bound path unconditionally, deleting
    whatever file replaced the socket, and raises before closing the
    listener when the path is already gone;
  - it binds and then C{chmod}s, following the path, with a window between;
  - its accept loop answers C{ENFILE}/C{ENOBUFS}/C{ENOMEM} by retrying on the
    next reactor turn (a busy loop that floods the log while the listener
    stays readable) and C{EMFILE} by accepting and closing every waiting
    client, which sends real workloads to their slow path.

L{BrokerPort} keeps the rest of the machinery (the transport class, the
reactor integration) and replaces exactly those parts: it binds under a
umask that yields 0666 directly, records the socket's identity, removes the
path on close only if that identity still matches, backs off on resource
errors (5 ms doubling to 1 s, then recovers by itself), treats any other
accept error as fatal to the broker, and gives every accepted connection to
the factory's fast path, and what that does not answer to the waiting room
(L{hostpid.broker.waiting}), with no Twisted transport.

It also decides how descriptors passed by clients are met (see
L{hostpid.broker.descriptors}): refused by the kernel through
C{SO_PASSRIGHTS} on the listener, or, where the kernel lacks it, received
through L{PassedDescriptors} on the general path and by the factory's
receiving fast path.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Callable
from typing import Any

from twisted.internet import tcp, unix
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid import defaults, wire
from hostpid.broker.connections import Connection
from hostpid.broker.connections import helper as _native
from hostpid.broker.descriptors import (
    DescriptorMode,
    PassedDescriptors,
    refuse_descriptor_passing,
)
from hostpid.broker.fsrules import (
    BrokerStartupError,
    SocketIdentity,
    descriptor_path,
    identify_socket,
    remove_socket_if_ours,
)
from hostpid.broker.handover import allow_descriptor_passing
from hostpid.broker.server import BrokerFactory
from hostpid.broker.waiting import WaitingRoom
from hostpid.starttime import boottime_ns

#: Accept errors that mean "out of a resource for now": back off and retry.
RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: Accept errors that concern one connection only: skip it.
CONNECTION_ERRORS = frozenset({errno.ECONNABORTED, errno.EPERM, errno.EPROTO, errno.EINTR})


BACKOFF_INITIAL = 0.005
BACKOFF_MAX = 1.0

#: Connections accepted per reactor turn at most, so that timers and other
#: sockets are served even under a flood.
ACCEPTS_PER_TURN = 128

#: The fast path's first read of a connection (as L{BrokerFactory.answerWaiting}'s).
_FAST_READ = 256
_native_accept_batch = getattr(_native, "accept_batch", None)

#: Why accepting may pause (L{BrokerPort.pauseReason}).
PAUSE_RESOURCES = "out of descriptors or memory (accept fails with EMFILE/ENFILE/ENOBUFS/ENOMEM)"
#: Where callers are checked by start time (no C{SO_PEERPIDFD}), how often
#: the port puts a marker in its own backlog (L{BrokerPort._insertMarker}),
#: so that the bound on when a connection was made stays recent, idle or
#: flooded: a caller that started less than this (plus a clock tick) before
#: connecting may be refused, and falls back.  See L{BrokerPort.emptyAt}.
FLOOR_REFRESH = 0.01

#: Backlog markers outstanding at most, and how long one is waited for
#: (nanoseconds) before it is forgotten.
MARKERS_OUTSTANDING = 64
MARKER_LIFETIME_NS = 5 * 10**9

#: A pause this long (seconds) is logged once and fails readiness.
PAUSE_REPORTED_AFTER = 1.0


class BrokerPort(unix.Port):
    """
    A Unix listening port for the broker's socket inside its directory.

    @ivar identity: the created socket's (device, inode), once listening.
    """

    log = Logger()

    def __init__(
        self,
        path: str,
        directoryFd: int,
        factory: BrokerFactory,
        reactor: Any,
        onFatal: Callable[[Failure], None],
        backlog: int = defaults.LISTEN_BACKLOG,
        expectedUid: int | None = None,
        receiveDescriptors: bool = False,
        listener: socket.socket | None = None,
        identity: SocketIdentity | None = None,
    ) -> None:
        """
        @param listener: a listening socket handed over by the broker that
            served before (L{hostpid.broker.handover}), with the C{identity}
            it recorded: listened on instead of binding a new one.
        """
        super().__init__(path.encode(), factory, backlog=backlog, reactor=reactor)
        self._handedListener = listener
        self._handedIdentity = identity
        #: Whether to skip C{SO_PASSRIGHTS} and receive passed descriptors,
        #: as on a kernel without it (for tests of that mode).
        self._receiveDescriptors = receiveDescriptors
        #: How passed descriptors are met, once listening.
        self.descriptorMode: DescriptorMode | None = None
        self.path = path
        self.factory: BrokerFactory = factory
        self._directoryFd = directoryFd
        self._onFatal = onFatal
        self._clock: IReactorTime = reactor
        self._expectedUid = os.geteuid() if expectedUid is None else expectedUid
        self.identity: SocketIdentity | None = None
        #: The connections still waiting for their request (the general path).
        self.room = WaitingRoom(factory, reactor)
        self._backoff = BACKOFF_INITIAL
        self._acceptsPerTurn = 1
        self._resume: IDelayedCall | None = None
        self.resourceErrors = 0
        #: While accepting is paused: since when (on the reactor's clock), and why.
        self.pausedSince: float | None = None
        self.pauseReason: str | None = None
        self._pauseReported = False
        self._acceptOne: Callable[[], Connection] | None = None
        #: The last moment (L{boottime_ns}) the backlog was seen empty: every
        #: connection accepted since was made after it.  Read at the start of
        #: an accept batch that ended finding nothing more (a moment before
        #: the kernel's look, so never later than the truth).  The peer
        #: identifier compares callers' start times with it where it must
        #: (L{hostpid.peercred.PeerIdentifier.useConnectFloor}).
        self.emptyAt = 0
        self._floorRefresh: Any = None

    def startListening(self) -> None:
        """
        Bind, verify, listen.  The bind goes through the directory's
        descriptor (C{/proc/self/fd/N/broker.sock}), so a path swapped above
        the directory cannot make it create the socket anywhere else.  The
        umask is set for the bind alone so the socket is born 0666 (no
        bind-then-chmod window), and the path is then checked by C{lstat} to
        be the socket just created, owned by us.
        """
        if self._handedListener is not None:
            # A listener handed over (or passed by systemd) may hold
            # connections made before this broker existed: no bound is known
            # until the backlog is first seen empty or a marker comes back.
            # Until then the bound is the boot (1 ns, not 0, which would mean
            # "no rule"): a caller checked by start time is refused and falls
            # back rather than risk a PID reused while it waited.
            self.emptyAt = 1
            skt = self._adopt(self._handedListener)
        else:
            # Before the listener exists: no connection can have been made earlier.
            self.emptyAt = boottime_ns()
            skt = self._bind()
        try:
            refused = not self._receiveDescriptors and refuse_descriptor_passing(skt)
            if not refused and self._handedListener is not None:
                allow_descriptor_passing(skt)
        except OSError as e:
            skt.close()
            raise BrokerStartupError(
                self.path, f"cannot set SO_PASSRIGHTS on the socket: {e.strerror}"
            ) from None
        if refused:
            self.descriptorMode = DescriptorMode.REFUSED
        else:
            self.descriptorMode = DescriptorMode.RECEIVED
            factory = self.factory
            self.factory.receiveDescriptors(
                PassedDescriptors(
                    connections=lambda: factory.active,
                    reactor=self.reactor,
                    native=factory.calls.native,
                    takesDescriptors=False,
                )
            )
        skt.listen(self.backlog)
        self.factory.doStart()
        self.connected = True
        self.socket = skt
        self.fileno = skt.fileno  # type: ignore[method-assign]
        # Bound to this listener on the first accept (it holds its number).
        self._acceptOne = None
        self.factory.identifier.useConnectFloor(self._connectFloor)
        self.startReading()
        self._startFloorRefresh()

    def _connectFloor(self) -> int:
        return self.emptyAt

    def _startFloorRefresh(self) -> None:
        """
        While callers may be checked by start time, put a marker in the
        backlog every L{FLOOR_REFRESH} (see L{emptyAt}); stops by itself once
        the check in force needs no start time (C{SO_PEERPIDFD}).
        """
        if self.factory.identifier.acceptClock is None:
            return
        self.factory.markerSeen = self._markerSeen
        self._floorRefresh = LoopingCall(self._insertMarker)
        self._floorRefresh.clock = self._clock
        self._floorRefresh.start(FLOOR_REFRESH, now=False)

    def _insertMarker(self) -> None:
        """
        Connect to our own listener and send 8 random bytes that are no
        valid request, noting when (L{boottime_ns}, read before the
        connect).  The backlog is first in, first out (C{unix_stream_connect}
        queues each new connection at the tail of the listener's queue;
        C{accept} takes the head), so every connection accepted after the
        marker was made after that moment, however long the backlog stays
        full: the moment becomes L{emptyAt} when the marker is accepted
        (L{_markerSeen}).  An idle listener wakes for it, finds the backlog
        empty after it, and so keeps L{emptyAt} recent too.

        The bytes are random so that no client can pass for a marker (and
        move the bound past connections made before it); a marker the
        backlog cannot take (full) is not sent, and one that never comes
        back is forgotten after L{MARKER_LIFETIME}.
        """
        factory = self.factory
        if factory.identifier.acceptClock is None:
            self._stopFloorRefresh()
            return
        if not self.connected:
            return
        now = boottime_ns()
        markers = factory.markers
        for nonce, made in list(markers.items()):
            if now - made > MARKER_LIFETIME_NS:
                del markers[nonce]
        if len(markers) >= MARKERS_OUTSTANDING:
            return
        nonce = os.urandom(wire.REQUEST_SIZE)
        while nonce.startswith(wire.MAGIC):
            nonce = os.urandom(wire.REQUEST_SIZE)
        path = descriptor_path(
            self._directoryFd, os.path.dirname(self.path), defaults.SOCKET_NAME
        )
        try:
            marker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        except OSError:
            return
        try:
            made = boottime_ns()
            marker.connect(path)
            markers[nonce] = made
            marker.send(nonce)
        except OSError:
            # The backlog is full (EAGAIN), or out of resources: no marker
            # this time; L{emptyAt} stays where it is (only ever too early).
            markers.pop(nonce, None)
        finally:
            # Watched where clients can pass descriptors: this is a Unix
            # socket's release, which on kernels before 6.10 may free a
            # tenant's in-flight garbage (a lingering socket) right here.
            passed = factory.passed
            if passed is None:
                marker.close()
            else:
                passed.closeHere(marker)

    def _markerSeen(self, made: int) -> None:
        """A marker made at C{made} was accepted: see L{_insertMarker}."""
        if made > self.emptyAt:
            self.emptyAt = made

    def _stopFloorRefresh(self) -> None:
        if self._floorRefresh is not None and self._floorRefresh.running:
            self._floorRefresh.stop()
        self._floorRefresh = None

    def _bind(self) -> socket.socket:
        """A new socket bound at the path, born 0666, its identity recorded."""
        directory = os.path.dirname(self.path)
        bindPath = descriptor_path(self._directoryFd, directory, defaults.SOCKET_NAME)
        skt = self.createInternetSocket()
        oldUmask = os.umask(0o777 & ~defaults.SOCKET_MODE)
        try:
            skt.bind(bindPath)
        except OSError as e:
            skt.close()
            raise BrokerStartupError(
                self.path, f"cannot bind the socket: {e.strerror or e}"
            ) from None
        finally:
            os.umask(oldUmask)
        info = identify_socket(self._directoryFd)
        if (
            info is None
            or not stat.S_ISSOCK(info.st_mode)
            or info.st_uid != self._expectedUid
            or info.st_mode & 0o777 != defaults.SOCKET_MODE
        ):
            skt.close()
            raise BrokerStartupError(
                self.path, "is not the socket just bound (replaced during startup?)"
            )
        self.identity = SocketIdentity.of(info)
        return skt

    def _adopt(self, skt: socket.socket) -> socket.socket:
        """
        A listener handed over: the path must still name it (the identity
        its first owner recorded), owned as the rules require.  From here on
        every lifecycle rule is this broker's: the path is removed at close
        only if it still names this socket.
        """
        info = identify_socket(self._directoryFd)
        if (
            info is None
            or self._handedIdentity is None
            or not self._handedIdentity.matches(info)
            or info.st_uid != self._expectedUid
            or info.st_mode & 0o777 != defaults.SOCKET_MODE
        ):
            raise BrokerStartupError(
                self.path, "no longer names the socket handed over (replaced during startup?)"
            )
        self.identity = self._handedIdentity
        return skt

    def acceptQueued(self) -> None:
        """
        One last turn as the broker stops: accept what waits in the queue, at
        most as many as there are slots.  A connection whose request is
        there is answered at once; any other waits out its deadline as every
        accepted one does.  Without this turn a client queued at the moment
        of the stop would be reset with the listener, or, where systemd
        keeps the listener, wait for the next broker's start (a Python
        start: a third of a client's half-second deadline or more).  One
        turn only, so that no flood of connects can delay the stop.
        """
        if not self.connected or self.pausedSince is not None:
            return
        self._acceptsPerTurn = self.factory.maxConnections
        self.doRead()

    def handOverPath(self) -> None:
        """
        The listener now belongs to the broker that took over: this one stops
        accepting but never removes the path at close, and closes its
        descriptor without C{shutdown}: Twisted's port shuts a listener down
        before closing it, which on a Unix socket makes every later connect
        fail with C{ECONNREFUSED}, for the new owner too.
        """
        self.identity = None
        self._shouldShutdown = False

    def doRead(self) -> None:
        """
        Accept what is waiting, each connection fast path first.

        Connections are accepted as the factory's L{ConnectionCalls} make
        them (bare descriptors where the C helper is built, C-level socket
        objects where not): under a flood the broker accepts every
        connection only to close most of them, so what one costs is what
        the flood costs.  One that the fast path does not answer goes to the
        waiting room as a socket object.

        How many to accept this turn adapts, as Twisted's own port does: as
        many as last turn found waiting, doubling while the queue does not
        run dry.  The listener is level-triggered, so anything left is
        accepted on the next turn; and a lone client is accepted without a
        second C{accept} that fails with EAGAIN.
        """
        factory = self.factory
        started = self._clock.seconds()
        try:
            self._acceptBatch(factory)
        finally:
            if self.room.overLimit:
                self.room.closeOverLimit()
            if factory.answeredAtAccept:
                factory.observeAccepted(started)

    def _acceptBatch(self, factory: BrokerFactory) -> None:
        """
        One turn's accepts (see L{doRead}).  Everything the loop uses is a
        local, and what concerns the batch rather than one connection (the
        end of a pause, the backoff's reset) is done once, after the first
        accept that succeeds.
        """
        if self._batched(factory):
            self._acceptBatchNative(factory)
            return
        accept = self._acceptOne
        if accept is None:
            accept = self._acceptOne = factory.calls.acceptorFor(self.socket)
        # One clock read a batch, and only where start times are compared.
        started = boottime_ns() if factory.identifier.acceptClock is not None else 0
        admit = self.room.admit
        answerWaiting = factory.answerWaiting
        socketOf = factory.calls.socketOf
        turn = self._acceptsPerTurn
        accepted = 0
        for _ in range(turn):
            try:
                conn = accept()
            except BlockingIOError:
                self._acceptsPerTurn = max(1, accepted)
                if started > self.emptyAt:
                    self.emptyAt = started
                if self.pausedSince is not None:
                    self._pauseEnded()
                return
            except OSError as e:
                if e.errno in RESOURCE_ERRORS:
                    self._pauseAccepting(e)
                    return
                if e.errno in CONNECTION_ERRORS:
                    continue
                self._onFatal(Failure())
                return
            if not accepted:
                if self.pausedSince is not None:
                    self._pauseEnded()
                self._backoff = BACKOFF_INITIAL
            accepted += 1
            prefix = answerWaiting(conn)
            if prefix is not None:
                admit(socketOf(conn), prefix)
        self._acceptsPerTurn = min(turn * 2, ACCEPTS_PER_TURN)

    def _batched(self, factory: BrokerFactory) -> bool:
        """
        Whether this turn's accepts and first reads are made by one call to
        the C helper (L{_acceptBatchNative}): where connections are
        descriptors, and in mode I{received} only while reads install no
        descriptor (the broker's own L{PassedDescriptors}, which takes none):
        then every first read is the same peek, whatever the counts.
        """
        if not factory.calls.native or _native_accept_batch is None:
            return False
        passed = factory.passed
        return passed is None or not passed.takesDescriptors

    def _acceptBatchNative(self, factory: BrokerFactory) -> None:
        """
        L{_acceptBatch} with its system calls made in one call to the C
        helper (C{accept_batch}): each connection accepted and read once, in
        the order the backlog holds them, and for one with nothing waiting
        its peer's PID.  What each is then is decided here, as before: a
        whole request answered (L{BrokerFactory.answerAccepted}), the rest
        to the waiting room (L{WaitingRoom.admitAccepted}), whose newcomers
        over their peer's share are closed after the turn.  Under a flood
        almost every connection is one of those, and none of them costs a
        Python call into the kernel, a socket object or an exception.
        """
        passed = factory.passed
        started = boottime_ns() if factory.identifier.acceptClock is not None else 0
        turn = self._acceptsPerTurn
        assert _native_accept_batch is not None
        items, ended = _native_accept_batch(
            self.socket.fileno(), turn, _FAST_READ, passed is not None,
            passed is not None and passed.outOfBand,
        )
        if items:
            if passed is not None:
                passed.withoutRoom += len(items)
            if self.pausedSince is not None:
                self._pauseEnded()
            self._backoff = BACKOFF_INITIAL
            room = self.room
            admit = room.admitAccepted
            answerAccepted = factory.answerAccepted
            # L{WaitingRoom.admitAccepted}'s first test made here, the common
            # case under a flood: a newcomer of a peer that holds its share
            # is set aside for the close after the turn, with no call.
            atShare = room.peersAtShare if room.peersAtShare is not None else {}
            overLimit = room.overLimit
            for fd, data, peer in items:
                if data is None:
                    if peer in atShare:
                        overLimit.append(fd)
                    else:
                        admit(fd, b"", peer)
                else:
                    prefix = answerAccepted(fd, data)
                    if prefix is not None:
                        admit(fd, prefix)
        if ended == errno.EAGAIN:
            self._acceptsPerTurn = max(1, len(items))
            if started > self.emptyAt:
                self.emptyAt = started
            if self.pausedSince is not None:
                self._pauseEnded()
        elif not ended:
            self._acceptsPerTurn = min(turn * 2, ACCEPTS_PER_TURN)
        elif ended in RESOURCE_ERRORS:
            self._pauseAccepting(OSError(ended, os.strerror(ended)))
        else:
            self._onFatal(Failure(OSError(ended, os.strerror(ended))))

    def _pauseAccepting(self, error: OSError) -> None:
        """
        Out of descriptors or memory: stop reading the listener and look again
        after a delay that doubles up to a second.  Waiting clients stay in the
        accept queue instead of being accepted only to be closed.
        """
        self.resourceErrors += 1
        if self.resourceErrors & (self.resourceErrors - 1) == 0:
            self.log.warn(
                "hostpid-broker: cannot accept ({error}); retrying in {delay:.3f}s "
                "(resource errors so far: {count})",
                error=errno.errorcode.get(error.errno or 0, str(error.errno)),
                delay=self._backoff,
                count=self.resourceErrors,
            )
        self._paused(PAUSE_RESOURCES)
        self.stopReading()
        self._resume = self._clock.callLater(self._backoff, self._resumeAccepting)
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def _paused(self, reason: str) -> None:
        """Accepting is paused for C{reason}; say so once it lasts."""
        now = self._clock.seconds()
        if self.pausedSince is None or self.pauseReason != reason:
            self.pausedSince, self.pauseReason, self._pauseReported = now, reason, False
        elif not self._pauseReported and now - self.pausedSince >= PAUSE_REPORTED_AFTER:
            self._pauseReported = True
            self.log.warn(
                "hostpid-broker: not accepting for {seconds:.1f}s: {reason}; not ready "
                "until accepting again",
                seconds=now - self.pausedSince, reason=reason,
            )

    def _pauseEnded(self) -> None:
        if self._pauseReported:
            self.log.info(
                "hostpid-broker: accepting again after {seconds:.1f}s ({reason})",
                seconds=self._clock.seconds() - (self.pausedSince or 0.0),
                reason=self.pauseReason,
            )
        self.pausedSince, self.pauseReason, self._pauseReported = None, None, False

    def pauseProblem(self) -> str | None:
        """
        Why accepting has been paused for L{PAUSE_REPORTED_AFTER} or more
        (readiness fails then), or C{None}.
        """
        if self.pausedSince is None:
            return None
        seconds = self._clock.seconds() - self.pausedSince
        if seconds < PAUSE_REPORTED_AFTER:
            return None
        return f"not accepting for {seconds:.1f}s: {self.pauseReason}"

    def _resumeAccepting(self) -> None:
        self._resume = None
        if self.connected and not self.disconnecting:
            self.startReading()

    def logPrefix(self) -> str:
        """
        A constant: the reactor asks for it on every readiness event, and the
        base class computes the factory's qualified name each time.
        """
        return "hostpid-broker"

    def _logConnectionLostMsg(self) -> None:
        """The service logs the lifecycle; nothing here."""

    def connectionLost(self, reason: Failure) -> None:
        """
        Close the listener; remove the path only if it is still our socket.
        Never raises on the path, so the listener is always closed and the
        factory always stopped.
        """
        if self._resume is not None and self._resume.active():
            self._resume.cancel()
        self._resume = None
        self._acceptOne = None
        self._stopFloorRefresh()
        passed = self.factory.passed
        if passed is not None:
            # Its guard watches the reactor's closes of connections: forgotten
            # once the last of them (answered or still waiting) is over.
            self.factory.whenIdle(passed.stop)
        self.removed = False
        if self.identity is not None:
            try:
                self.removed = remove_socket_if_ours(self._directoryFd, self.identity)
            except OSError as e:
                self.log.error(
                    "hostpid-broker: could not remove {path}: {error}",
                    path=self.path,
                    error=e.strerror,
                )
        tcp.Port.connectionLost(self, reason)
