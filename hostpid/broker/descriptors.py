"""
Descriptors a client passes with C{SCM_RIGHTS}: refused by the kernel where
it can, otherwise received and disposed of without ever blocking the reactor.

Why this matters: a workload can send the broker a descriptor whose last
C{close} blocks, for example a TCP socket with C{SO_LINGER {1, N}} and a full
send queue to a peer that never reads.  Once the workload has closed its own
copy the broker holds the last reference, and wherever that reference is
dropped (a C{recv()} without room for ancillary data discards it, and so
does closing a connection whose receive queue still holds it) the kernel's
C{tcp_close} waits N seconds in the broker's only thread.

Two modes, chosen once when the listener is created (L{DescriptorMode}):

  - I{refused}: Linux 6.16+ has C{SO_PASSRIGHTS}.  Set to 0 on the listening
    socket, it is inherited by every accepted socket and the I{sender's}
    C{sendmsg} with C{SCM_RIGHTS} fails with C{EPERM}: nothing ever arrives,
    and the hot path pays nothing.
  - I{received} (older kernels, C{ENOPROTOOPT}): L{PassedDescriptors} reads
    with C{recvmsg} and an ancillary buffer for C{SCM_MAX_FD} descriptors, so
    the kernel never has to discard (and release, in our thread) a
    descriptor for lack of room; sets C{SO_OOBINLINE} on each connection
    where the kernel has Unix out-of-band data (5.15+, C{CONFIG_AF_UNIX_OOB}),
    or an out-of-band byte carrying descriptors would be discarded by the
    next ordinary read; and closes each connection only after C{shutdown(SHUT_RD)}
    (from then on the peer's C{sendmsg} fails with C{EPIPE}) and a peek that
    finds the queue empty, or else a bounded drain of what was queued.
    Each received descriptor is then made
    safe to close or closed elsewhere: an Internet socket gets C{SO_LINGER
    {1, 0}} (its close resets the connection at once) and is closed here;
    anything else goes to L{BackgroundCloser}, whose threads may block as
    long as the kernel likes.

Room in the descriptor table (both I{received}-mode reads): a C{recvmsg}
whose message carries more descriptors than the table can take installs what
fits, sets C{MSG_CTRUNC} and I{releases the rest in the receiving thread},
lingering sockets included.  So no read with an ancillary buffer is made
unless L{PassedDescriptors.hasRoom}: the soft C{RLIMIT_NOFILE} (read once),
minus the broker's own descriptors (counted once at start, plus the metrics
server's), the connections open and the descriptors the closer still holds,
leaves room for C{SCM_MAX_FD} plus L{ROOM_MARGIN}, I{and} the closer's queue
has room for C{SCM_MAX_FD} more.  Without room a reader stops reading until
the closer has freed enough (L{PassedDescriptors.waitForRoom}), and a
connection being closed is handed to the closer whole, undrained.
"""

from __future__ import annotations

import _socket
import enum
import errno
import os
import queue
import resource
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger

from hostpid import defaults

#: C{SO_PASSRIGHTS} from C{asm-generic/socket.h} (Linux 6.16); Python 3.11 has no constant.
SO_PASSRIGHTS = 83

#: The kernel's C{SCM_MAX_FD}: descriptors one C{SCM_RIGHTS} message can carry.
SCM_MAX_FD = 253

#: Room for one full C{SCM_RIGHTS} message.  A Unix stream read stops after
#: the first message that carries descriptors, so one is all a read returns.
ANCILLARY_SPACE = socket.CMSG_SPACE(SCM_MAX_FD * 4)

_RECV_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)
# Plain ints: C{socket.MSG_CTRUNC} is an C{IntFlag} member, and C{flags &
# socket.MSG_CTRUNC} is a Python-level call costing ~1.7 us on every read.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_SO_OOBINLINE = int(socket.SO_OOBINLINE)
_SHUT_RD = int(socket.SHUT_RD)
_PEEK_FLAGS = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_INTERNET = frozenset({int(socket.AF_INET), int(socket.AF_INET6)})
_LINGER_RESET = struct.pack("ii", 1, 0)

#: Reads at most, after C{shutdown(SHUT_RD)}, before a connection whose queue
#: is still not empty is handed to the background closer whole.
DRAIN_READS = 8
_DRAIN_SIZE = 65536

#: Threads of the background closer, and descriptors it may hold waiting.
CLOSER_THREADS = 2
CLOSER_QUEUE = 256

#: Descriptors kept free beyond one full message before any read with an
#: ancillary buffer: the connection in hand, a transient pidfd, a log file
#: reopened, a metrics connection accepted meanwhile.
ROOM_MARGIN = 16

#: When the table lacks room even with the closer empty (the connections
#: alone fill it), how often a paused reader looks again.
ROOM_RECHECK = 0.05


class DescriptorMode(enum.Enum):
    """How the broker treats descriptors passed by clients."""

    #: C{SO_PASSRIGHTS} is 0: the kernel refuses them at the sender.
    REFUSED = "refused"
    #: The kernel cannot refuse them: they are received and disposed of.
    RECEIVED = "received"


def refuse_descriptor_passing(sock: _socket.socket) -> bool:
    """
    Set C{SO_PASSRIGHTS} to 0 on C{sock} (a listener, before C{listen}).

    @return: whether the kernel refuses descriptors on C{sock} now; C{False}
        on a kernel without the option.
    @raise OSError: any error other than "no such option".
    """
    try:
        sock.setsockopt(_SOL_SOCKET, SO_PASSRIGHTS, 0)
    except OSError as e:
        if e.errno in (errno.ENOPROTOOPT, errno.EINVAL):
            return False
        raise
    return sock.getsockopt(_SOL_SOCKET, SO_PASSRIGHTS) == 0


class BackgroundCloser:
    """
    Closes descriptors on a few daemon threads, so a close that blocks (a
    lingering socket inside a passed Unix socket's queue, a FUSE file, a
    terminal draining its output) blocks one of them, never the reactor.

    Bounded by admission, not by refusal (refusing a descriptor already
    received would mean closing it here, which is what this class exists to
    avoid): L{PassedDescriptors} reads no message unless L{room} can take a
    full one, so at most C{limit} I{received} descriptors wait.  Connections
    handed over whole (one descriptor each, already counted among the
    connections) may come on top.  L{saturated} also tells the listening port
    to stop accepting.  L{whenPendingAtMost} lets a paused reader be woken
    from a closer thread.  The threads start on first use and are never
    joined: a close that blocks cannot be waited for.
    """

    log = Logger()

    def __init__(self, threads: int = CLOSER_THREADS, limit: int = CLOSER_QUEUE) -> None:
        self.limit = limit
        self._threads = threads
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        #: Descriptors submitted and not yet closed (waiting or being closed).
        self.pending = 0
        self.closed = 0
        self._waiter: tuple[int, Callable[[], None]] | None = None

    @property
    def saturated(self) -> bool:
        return self.pending >= self.limit

    @property
    def room(self) -> int:
        """Descriptors the queue can still take within its bound."""
        return self.limit - self.pending

    def whenPendingAtMost(self, threshold: int, callback: Callable[[], None]) -> bool:
        """
        Call C{callback} I{from a closer thread} once at most C{threshold}
        descriptors are pending (it must be thread-safe, e.g. wrap
        C{reactor.callFromThread}).  One waiter at a time: a new call
        replaces the previous one.

        @return: C{False}, and no call, if that is already the case.
        """
        with self._lock:
            if self.pending <= threshold:
                return False
            self._waiter = (threshold, callback)
            return True

    def submit(self, fd: int) -> None:
        with self._lock:
            self.pending += 1
            if not self._started:
                self._started = True
                for n in range(self._threads):
                    threading.Thread(
                        target=self._run, name=f"hostpid-closer-{n}", daemon=True
                    ).start()
        self._queue.put(fd)

    def _run(self) -> None:
        while True:
            fd = self._queue.get()
            try:
                os.close(fd)
            except OSError:
                pass
            fire = None
            with self._lock:
                self.pending -= 1
                self.closed += 1
                waiter = self._waiter
                if waiter is not None and self.pending <= waiter[0]:
                    self._waiter = None
                    fire = waiter[1]
            if fire is not None:
                fire()


class PassedDescriptors:
    """
    The I{received} mode: reading, and closing, connections whose peer may
    pass descriptors, with no step that can block the reactor thread.

    @ivar received: descriptors received so far (all disposed of).
    @ivar paused: times a read was put off for lack of room.
    @ivar outOfBand: whether this kernel queues out-of-band messages on Unix
        stream sockets, so that each connection needs C{SO_OOBINLINE}.
    """

    def __init__(
        self,
        closer: BackgroundCloser | None = None,
        connections: Callable[[], int] = lambda: 0,
        reactor: Any = None,
        descriptorLimit: int | None = None,
        reserved: int | None = None,
        outOfBand: bool | None = None,
    ) -> None:
        """
        @param connections: how many connections the broker holds now (the
            factory's active transactions), asked before each read.
        @param descriptorLimit: the table's size; by default the soft
            C{RLIMIT_NOFILE} now.
        @param reserved: descriptors the broker holds for itself; by default
            those open now plus every metrics connection and L{ROOM_MARGIN}.
        @param outOfBand: by default, asked of the kernel once
            (L{unix_out_of_band_supported}).
        """
        self.outOfBand = unix_out_of_band_supported() if outOfBand is None else outOfBand
        self.closer = closer if closer is not None else BackgroundCloser()
        self.received = 0
        self.paused = 0
        self._connections = connections
        self._reactor = reactor
        self.descriptorLimit = (
            _soft_descriptor_limit() if descriptorLimit is None else descriptorLimit
        )
        self.reserved = _descriptors_open_now() + defaults.METRICS_MAX_CONNECTIONS \
            if reserved is None else reserved
        self._waiters: list[Callable[[], None]] = []

    def hasRoom(self) -> bool:
        """
        Whether a read may carry a full C{SCM_RIGHTS} message: the table has
        room for it (and L{ROOM_MARGIN}), and so has the closer's queue.
        Counters only: no system call.
        """
        pending = self.closer.pending
        return (
            self.closer.limit - pending >= SCM_MAX_FD
            and self.descriptorLimit - self.reserved - self._connections() - pending
            >= SCM_MAX_FD + ROOM_MARGIN
        )

    def waitForRoom(self, resume: Callable[[], None]) -> None:
        """
        Call C{resume} (in the reactor thread) once the closer has freed
        enough for L{hasRoom} to hold with today's connections; the caller
        has stopped reading meanwhile.  C{resume} should check L{hasRoom}
        again: room may have been taken first by another reader.
        """
        self.paused += 1
        self._waiters.append(resume)
        if len(self._waiters) > 1:
            return  # already registered with the closer
        threshold = min(
            self.closer.limit - SCM_MAX_FD,
            self.descriptorLimit - self.reserved - self._connections()
            - SCM_MAX_FD - ROOM_MARGIN,
        )
        reactor = self._getReactor()
        if threshold < 0 or not self.closer.whenPendingAtMost(
            threshold, lambda: reactor.callFromThread(self._resumeAll)
        ):
            # The closer is not what lacks: connections fill the table.
            reactor.callLater(ROOM_RECHECK, self._resumeAll)

    def _resumeAll(self) -> None:
        waiters, self._waiters = self._waiters, []
        for resume in waiters:
            resume()

    def _getReactor(self) -> Any:
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor
        return self._reactor

    def prepare(self, sock: _socket.socket) -> None:
        """
        Before the first read: read out-of-band bytes inline.  Otherwise the
        kernel discards an out-of-band message at the next ordinary read,
        releasing any descriptor it carries in the reading thread.  A kernel
        without Unix out-of-band data queues no such message: nothing to do.
        """
        if self.outOfBand:
            sock.setsockopt(_SOL_SOCKET, _SO_OOBINLINE, 1)

    def receiveFirst(self, sock: _socket.socket, size: int) -> bytes | None:
        """
        L{prepare} and L{receive} in one, for the fast path's read of a
        connection just accepted: one method call, no tuple built.

        @return: the bytes read, or C{None} if the message carried
            descriptors (disposed of) or its ancillary data was truncated.
        @raise OSError: as C{recvmsg} (C{BlockingIOError}: nothing waiting).
        """
        if self.outOfBand:
            sock.setsockopt(_SOL_SOCKET, _SO_OOBINLINE, 1)
        data, ancillary, flags, _ = sock.recvmsg(size, ANCILLARY_SPACE, _RECV_FLAGS)
        if ancillary:
            self._dispose(ancillary)
            return None
        if flags & _MSG_CTRUNC:
            return None
        return data

    def receive(self, sock: _socket.socket, size: int) -> tuple[bytes, bool]:
        """
        Read up to C{size} bytes without blocking.

        @return: the bytes, and whether the message carried descriptors (or
            ancillary data was truncated, which cannot happen with this
            buffer but would mean the same).  Descriptors are disposed of.
        @raise OSError: as C{recvmsg} (C{BlockingIOError}: nothing waiting).

        Only when L{hasRoom}: the caller checks.
        """
        data, ancillary, flags, _ = sock.recvmsg(size, ANCILLARY_SPACE, _RECV_FLAGS)
        if ancillary:
            self._dispose(ancillary)
            return data, True
        return data, flags & _MSG_CTRUNC != 0

    def release(self, sock: _socket.socket) -> bool:
        """
        Close C{sock}, a connection, without dropping a passed descriptor's
        last reference in this thread: stop the peer sending, read what is
        already queued (boundedly, and only while L{hasRoom}), and close; a
        queue still not empty, or the table without room to drain it, is
        closed by the background closer.

        The common case, a queue already empty, costs one peek: after
        C{SHUT_RD} an empty queue reads as end of file.  A peek can never
        release a queued descriptor: the kernel lends the reader references
        of its own (C{scm_fp_dup}) and, with no room for them, takes those
        back, while the queued message keeps its references until it is
        read.  Anything else (data, a message with descriptors, an error)
        goes to the bounded drain.

        @return: whether descriptors were found while draining.
        """
        try:
            sock.shutdown(_SHUT_RD)
        except OSError:
            # Not connected any more: what its queue holds is unknown.
            self.closer.submit(sock.detach())
            return False
        try:
            if not sock.recv(1, _PEEK_FLAGS):
                sock.close()
                return False
        except ConnectionResetError:
            # The peer closed without reading our reply: reported once, then
            # the queue reads on.
            pass
        except OSError:
            self.closer.submit(sock.detach())
            return False
        return self._drain(sock)

    def _drain(self, sock: _socket.socket) -> bool:
        """The rest of L{release}: read the queue out, or hand it over."""
        found = False
        for _ in range(DRAIN_READS):
            if not self.hasRoom():
                break
            try:
                data, ancillary, _flags, _ = sock.recvmsg(
                    _DRAIN_SIZE, ANCILLARY_SPACE, _RECV_FLAGS
                )
            except ConnectionResetError:
                continue
            except OSError:
                break
            if ancillary:
                found = True
                self._dispose(ancillary)
            elif not data:
                # End of file after SHUT_RD: the queue is empty for good.
                sock.close()
                return found
        self.closer.submit(sock.detach())
        return found

    def _dispose(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        for level, kind, payload in ancillary:
            if level != _SOL_SOCKET or kind != _SCM_RIGHTS:
                continue
            count = len(payload) // 4
            for fd in struct.unpack(f"{count}i", payload[: count * 4]):
                self.received += 1
                if not _close_if_harmless(fd):
                    self.closer.submit(fd)


def unix_out_of_band_supported() -> bool:
    """
    Whether this kernel queues out-of-band data on Unix stream sockets
    (Linux 5.15+ built with C{CONFIG_AF_UNIX_OOB}): asked once, by sending
    an out-of-band byte over a socket pair.  Where the kernel refuses it
    (C{EOPNOTSUPP}) no client can queue such a message either, and each
    connection is spared a C{setsockopt(SO_OOBINLINE)}.  Any other answer
    counts as supported: the check is then kept.
    """
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        left.send(b"!", socket.MSG_OOB | socket.MSG_DONTWAIT)
    except OSError as e:
        return e.errno != errno.EOPNOTSUPP
    finally:
        left.close()
        right.close()
    return True


def _soft_descriptor_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                return int(f.read())
        except (OSError, ValueError):
            return 1 << 20
    return soft


def _descriptors_open_now() -> int:
    """Counted once, at start; a generous guess where /proc is missing."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 48


def _close_if_harmless(fd: int) -> bool:
    """
    Close C{fd} here if its close cannot block: an Internet socket once its
    linger is set to reset.  Leave anything else open and return C{False}.
    """
    try:
        sock = _socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.family not in _INTERNET:
            sock.detach()
            return False
        sock.setsockopt(_SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        sock.detach()
        return False
    sock.close()
    return True
