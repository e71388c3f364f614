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
    anything else goes to L{BackgroundCloser}, which has a disposer
    process close it (L{hostpid.broker.closer}): the broker never does.
    The broker itself goes further and installs none
    (C{takesDescriptors=False}, L{PassedDescriptors.mayReceive}): every
    C{close(2)} of a descriptor, even of a copy, runs the file's C{flush},
    which a FUSE server that never answers turns into an uninterruptible
    wait, so its reads always peek first and a connection that carries
    descriptors goes to the disposer whole.

Room in the descriptor table (both I{received}-mode reads): a C{recvmsg}
whose message carries more descriptors than the table can take installs what
fits, sets C{MSG_CTRUNC} and I{releases the rest in the receiving thread},
lingering sockets included.  So no read with an ancillary buffer is made
unless L{PassedDescriptors.hasRoom}: the soft C{RLIMIT_NOFILE} (read once),
minus the broker's own descriptors (counted once at start, plus the metrics
server's), the connections open and the descriptors the closer still holds,
leaves room for C{SCM_MAX_FD} plus L{ROOM_MARGIN}, I{and} the closer's queue
has room for C{SCM_MAX_FD} more.  Without room, reads do not stop: they peek
first and take only bytes that carry no descriptor
(L{PassedDescriptors.receiveWithoutRoom}); a connection whose queue holds
descriptors is then handed to the closer whole, unread.

The fast path's reads and closes (L{PassedDescriptors.readFirst},
L{PassedDescriptors.releaseDescriptor}) make their system calls through the
C helper C{_hostpid_native} (C{native/}) where it is built: the same calls
in the same order, about 3 us cheaper per connection than through the
socket module, and nothing decided in C.  There the fast path's
connections are bare descriptors (L{hostpid.broker.connections}).  Where
it is not built (no compiler at install) the Python path below makes them,
and is the reference the C one is tested against.

No passed descriptor is installed or closed in the broker
(L{hostpid.broker.closer}): a connection whose queue holds some goes whole
to the disposer process, which drops them unread, interrupts a release
that waits within milliseconds, and is abandoned if one ignores signals.
The reactor thread's own closes (a connection whose queue is empty; on
kernels before 6.10 any Unix socket close may run the kernel's collector
of in-flight garbage here) are still watched (L{hostpid.broker.closewatch}).
"""

from __future__ import annotations

import _socket
import enum
import errno
import os
import resource
import socket
import struct
from collections.abc import Callable
from typing import Any

from hostpid import defaults
from hostpid.broker.closer import BackgroundCloser
from hostpid.broker.closewatch import Closable, close_watched
from hostpid.broker.connections import NATIVE_MISSING, unix_socket
from hostpid.broker.connections import helper as _native

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
_DONTWAIT = int(socket.MSG_DONTWAIT)
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_INTERNET = frozenset({int(socket.AF_INET), int(socket.AF_INET6)})
_RELEASE_CLOSED = getattr(_native, "RELEASE_CLOSED", 0)
_RELEASE_QUEUED = getattr(_native, "RELEASE_QUEUED", 2)
_LINGER_RESET = struct.pack("ii", 1, 0)

#: Reads at most, after C{shutdown(SHUT_RD)}, before a connection whose queue
#: is still not empty is handed to the background closer whole.
DRAIN_READS = 8
_DRAIN_SIZE = 65536

#: Descriptors kept free beyond one full message before any read with an
#: ancillary buffer: the connection in hand, a transient pidfd, a log file
#: reopened, a metrics connection accepted meanwhile.
ROOM_MARGIN = 16



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


class PassedDescriptors:
    """
    The I{received} mode: reading, and closing, connections whose peer may
    pass descriptors, with no step that can block the reactor thread.

    @ivar received: descriptors received so far (all disposed of).
    @ivar withoutRoom: reads made by peeking first (L{receiveWithoutRoom}),
        because the table or the closer lacked room for a full message.
    @ivar outOfBand: whether this kernel queues out-of-band messages on Unix
        stream sockets, so that each connection needs C{SO_OOBINLINE}.
    @ivar guard: the reactor thread's closes, watched by L{CloseWatch}: on
        kernels before 6.10 closing any Unix socket may run the garbage
        collector, and free someone's in-flight garbage, in this thread.
    """

    def __init__(
        self,
        closer: BackgroundCloser | None = None,
        connections: Callable[[], int] = lambda: 0,
        reactor: Any = None,
        descriptorLimit: int | None = None,
        reserved: int | None = None,
        outOfBand: bool | None = None,
        native: bool | None = None,
        takesDescriptors: bool = True,
    ) -> None:
        """
        @param connections: how many connections the broker holds now (the
            factory's active transactions), asked before each read.
        @param reactor: where the watchdog's log lines are emitted from.
        @param descriptorLimit: the table's size; by default the soft
            C{RLIMIT_NOFILE} now.
        @param reserved: descriptors the broker holds for itself; by default
            those open now plus every metrics connection and L{ROOM_MARGIN}.
        @param outOfBand: by default, asked of the kernel once
            (L{unix_out_of_band_supported}).
        @param native: whether L{readFirst} and L{release} make their system
            calls through the C helper (and L{releaseDescriptor} can be
            used); by default, wherever it is built.
        @param takesDescriptors: whether reads may install passed descriptors
            in this process's table at all (L{mayReceive}).  The broker says
            no: every C{close(2)} of a descriptor, not only of the last
            reference, runs the file's C{flush}, and a FUSE file whose server
            never answers it (or a hard NFS mount) holds the closing thread
            in D state, deaf to every signal.  So not even the broker's own
            copy of a descriptor handed to the disposer may be closed here,
            and no child may be started while the table holds one (the
            child's closes before and at C{exec} flush it too).  Reads then
            always peek first (L{receiveWithoutRoom}) and a connection whose
            queue carries descriptors goes to the disposer whole, unread.
        @raise RuntimeError: C{native} is true and the helper is not built.
        """
        self.outOfBand = unix_out_of_band_supported() if outOfBand is None else outOfBand
        self.takesDescriptors = takesDescriptors
        self.closer = closer if closer is not None else BackgroundCloser(reactor=reactor)
        self.received = 0
        self.withoutRoom = 0
        #: Where L{release}'s peek lands: no bytes object per connection.
        self._peekBuffer = bytearray(1)
        self._connections = connections
        self._descriptorLimit = (
            _soft_descriptor_limit() if descriptorLimit is None else descriptorLimit
        )
        self._reserved = _descriptors_open_now() + defaults.METRICS_MAX_CONNECTIONS \
            if reserved is None else reserved
        #: L{hasRoom}'s two bounds, worked out once (it is asked on every
        #: transaction): the closer's queue may hold at most this many, and
        #: the connections plus what the closer holds at most that many.
        self._closerRoom = self.closer.limit - SCM_MAX_FD
        self._tableRoom = self._descriptorLimit - self._reserved - SCM_MAX_FD - ROOM_MARGIN
        watch = self.closer.watch
        if reactor is not None:
            watch.install(reactor)
        self.guard = watch.guard("the reactor thread")
        if native is None:
            native = _native is not None
        elif native and _native is None:
            raise RuntimeError(f"the C helper _hostpid_native is not built: {NATIVE_MISSING}")
        #: Whether the fast path's calls go through the C helper.
        self.native = native
        if native:
            self.readFirst = self._readFirstNative  # type: ignore[method-assign]
            self.release = self._releaseNative  # type: ignore[method-assign]

    def stop(self) -> None:
        """
        No connection is left to read or close through this instance (its
        listener is closed and its transactions are over): the process-wide
        watch stops looking at L{guard}, so a broker started and stopped
        many times in one process (a test suite, an embedding agent) leaves
        no guard behind.
        """
        self.closer.watch.forget(self.guard)
        self.closer.stop()

    @property
    def descriptorLimit(self) -> int:
        """The descriptor table's size, as read at construction."""
        return self._descriptorLimit

    @property
    def reserved(self) -> int:
        """Descriptors the broker keeps for itself, as counted at construction."""
        return self._reserved

    def hasRoom(self, connections: int | None = None) -> bool:
        """
        Whether a read may carry a full C{SCM_RIGHTS} message: the table has
        room for it (and L{ROOM_MARGIN}), and so has the closer's queue.
        Counters only: no system call.  Without room, reads go through
        L{receiveWithoutRoom}: slower, never stopped.

        @param connections: the connections open now, if the caller knows;
            by default, asked of the C{connections} given at construction.
        """
        if connections is None:
            connections = self._connections()
        pending = self.closer.pending
        return pending <= self._closerRoom and connections + pending <= self._tableRoom

    def mayReceive(self, connections: int | None = None) -> bool:
        """
        Whether a read may install passed descriptors here: only where this
        instance L{takesDescriptors}, and then only while L{hasRoom}.
        """
        return self.takesDescriptors and self.hasRoom(connections)

    def receiveWithoutRoom(self, sock: _socket.socket, size: int) -> tuple[bytes, bool]:
        """
        Read without room for a full message: peek first with no ancillary
        buffer, and read only if the peek met no descriptor.

        A peek never drops a queued descriptor's last reference (see
        L{release}), and with no ancillary buffer it installs none either: the
        kernel sets C{MSG_CTRUNC} and takes its loaned references back.  A
        stream peek stops after the first message that carries descriptors
        and reports it, so bytes peeked without C{MSG_CTRUNC} all come from
        messages without any, and reading exactly that many (we are the only
        reader) cannot reach one.  With C{MSG_CTRUNC} nothing is read, not
        even clean bytes before the message: conservative, and no real
        client passes descriptors.  Two system calls instead of one, only while L{hasRoom}
        says no, so a closer still busy, or a low C{RLIMIT_NOFILE}, slows
        reads down but never stops them.

        @return: the bytes read, and whether descriptors are waiting: then
            nothing was read, and the connection must be closed whole
            (L{release} hands it to the closer with its queue).
        @raise OSError: as C{recvmsg} (C{BlockingIOError}: nothing waiting).
        """
        self.withoutRoom += 1
        data, _ancillary, flags, _ = sock.recvmsg(size, 0, _PEEK_FLAGS)
        if flags & _MSG_CTRUNC:
            return b"", True
        if not data:
            return data, False
        return sock.recv(len(data), _DONTWAIT), False

    def readFirst(self, sock: _socket.socket, size: int, connections: int) -> bytes | None:
        """
        The fast path's read of a connection just accepted (a socket object;
        where L{native}, its descriptor will do), with
        C{connections} open (the factory's count, passed in so that no
        callback is asked on every transaction): L{prepare}, then L{receive}
        with room or L{receiveWithoutRoom} without.

        @return: the bytes read, or C{None} if the message carried (or, read
            without room, has) descriptors, or its ancillary data was truncated.
        @raise OSError: as C{recvmsg} (C{BlockingIOError}: nothing waiting).
        """
        self.prepare(sock)
        if self.mayReceive(connections):
            data, carried = self.receive(sock, size)
        else:
            data, carried = self.receiveWithoutRoom(sock, size)
        return None if carried else data

    def _readFirstNative(
        self, sock: _socket.socket | int, size: int, connections: int
    ) -> bytes | None:
        """L{readFirst}, its system calls made by the C helper (C{read})."""
        room = self.mayReceive(connections)
        if not room:
            self.withoutRoom += 1
        got = _native.read(sock, size, self.outOfBand, room)
        if isinstance(got, bytes):
            return got
        self._disposeDescriptors(got)
        return None

    def prepare(self, sock: _socket.socket) -> None:
        """
        Before the first read: read out-of-band bytes inline.  Otherwise the
        kernel discards an out-of-band message at the next ordinary read,
        releasing any descriptor it carries in the reading thread.  A kernel
        without Unix out-of-band data queues no such message: nothing to do.
        """
        if self.outOfBand:
            sock.setsockopt(_SOL_SOCKET, _SO_OOBINLINE, 1)

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

    def release(self, sock: _socket.socket, reply: bytes | None = None) -> bool:
        """
        Send C{reply}, if any, without blocking (a failure is ignored: the
        client went away, or left no room, and gets no answer either way).
        Then close C{sock}, a connection, without dropping a passed descriptor's
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
        if reply is not None:
            try:
                sock.send(reply, _SEND_FLAGS)
            except OSError:
                pass
        try:
            sock.shutdown(_SHUT_RD)
        except OSError:
            # Not connected any more: what its queue holds is unknown.
            self.closer.submit(sock.detach())
            return False
        try:
            if not sock.recv_into(self._peekBuffer, 1, _PEEK_FLAGS):
                # closeHere, inline: this is every transaction's close.
                guard = self.guard
                guard.closes += 1
                guard.busy = True
                sock.close()
                guard.busy = False
                return False
        except ConnectionResetError:
            # The peer closed without reading our reply: reported once, then
            # the queue reads on.
            pass
        except OSError:
            self.closer.submit(sock.detach())
            return False
        return self._drain(sock)

    def _releaseNative(self, sock: _socket.socket, reply: bytes | None = None) -> bool:
        """L{release} where L{native}: L{releaseDescriptor} of C{sock}'s descriptor."""
        return self.releaseDescriptor(sock.detach(), reply)

    def releaseDescriptor(self, fd: int, reply: bytes | None = None) -> bool:
        """
        L{release} of a connection held as its bare descriptor (the fast
        path's, L{hostpid.broker.connections}), which it takes over; only
        where L{native}.  The common case (the reply, shutdown, peek, close)
        is one call to the C helper, watched as a close: the rest, as rare
        as it is, is L{release}'s own.
        """
        guard = self.guard
        guard.closes += 1
        guard.busy = True
        status = _native.release(fd, reply)
        guard.busy = False
        if status == _RELEASE_CLOSED:
            return False
        if status == _RELEASE_QUEUED:
            return self._drain(unix_socket(fd))
        self.closer.submit(fd)
        return False

    def _drain(self, sock: _socket.socket) -> bool:
        """The rest of L{release}: read the queue out, or hand it over."""
        found = False
        for _ in range(DRAIN_READS):
            if not self.mayReceive():
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
                self.closeHere(sock)
                return found
        self.closer.submit(sock.detach())
        return found

    def closeHere(self, sock: Closable) -> None:
        """
        Close C{sock} in this thread, watched (see L{guard}): a connection,
        or any other Unix socket the thread closes.
        """
        close_watched(self.guard, sock)

    def _dispose(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        for level, kind, payload in ancillary:
            if level != _SOL_SOCKET or kind != _SCM_RIGHTS:
                continue
            count = len(payload) // 4
            self._disposeDescriptors(struct.unpack(f"{count}i", payload[: count * 4]))

    def _disposeDescriptors(self, fds: tuple[int, ...]) -> None:
        """Close what is harmless to close here; the closer takes the rest."""
        for fd in fds:
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
