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
    descriptor for lack of room; sets C{SO_OOBINLINE} on each connection, or
    an out-of-band byte carrying descriptors would be discarded by the next
    ordinary read; and closes each connection only after C{shutdown(SHUT_RD)}
    (from then on the peer's C{sendmsg} fails with C{EPIPE}) and a peek that
    finds the queue empty, or else a bounded drain of what was queued.
    Each received descriptor is then made
    safe to close or closed elsewhere: an Internet socket gets C{SO_LINGER
    {1, 0}} (its close resets the connection at once) and is closed here;
    anything else goes to L{BackgroundCloser}, whose threads may block as
    long as the kernel likes.
"""

from __future__ import annotations

import _socket
import enum
import errno
import os
import queue
import socket
import struct
import threading

from twisted.logger import Logger

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

    Bounded: at most C{limit} descriptors wait.  L{saturated} tells the
    listening port to stop accepting until the threads catch up; descriptors
    that arrive meanwhile on connections already open are still queued (the
    queue never refuses one: refusing would mean closing it here, which is
    what this class exists to avoid).  The threads start on first use and
    are never joined: a close that blocks cannot be waited for.
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

    @property
    def saturated(self) -> bool:
        return self.pending >= self.limit

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
            with self._lock:
                self.pending -= 1
                self.closed += 1


class PassedDescriptors:
    """
    The I{received} mode: reading, and closing, connections whose peer may
    pass descriptors, with no step that can block the reactor thread.

    @ivar received: descriptors received so far (all disposed of).
    """

    def __init__(self, closer: BackgroundCloser | None = None) -> None:
        self.closer = closer if closer is not None else BackgroundCloser()
        self.received = 0

    @staticmethod
    def prepare(sock: _socket.socket) -> None:
        """
        Before the first read: read out-of-band bytes inline.  Otherwise the
        kernel discards an out-of-band message at the next ordinary read,
        releasing any descriptor it carries in the reading thread.
        """
        sock.setsockopt(_SOL_SOCKET, _SO_OOBINLINE, 1)

    def receiveFirst(self, sock: _socket.socket, size: int) -> bytes | None:
        """
        L{prepare} and L{receive} in one, for the fast path's read of a
        connection just accepted: one method call, no tuple built.

        @return: the bytes read, or C{None} if the message carried
            descriptors (disposed of) or its ancillary data was truncated.
        @raise OSError: as C{recvmsg} (C{BlockingIOError}: nothing waiting).
        """
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
        already queued (boundedly), and close; a queue still not empty is
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
