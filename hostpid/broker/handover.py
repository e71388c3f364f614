"""
Handover: a new broker takes the running one's listening socket and lock,
so that a restart or an upgrade never leaves the socket path without an
accepting listener.

The running broker listens on a control socket beside its broker socket,
C{handover.sock}, root only (mode 0600 in the 0711 directory).  A new broker
that finds the lock held connects there and the two exchange fixed-size,
versioned messages (L{encode}, L{decode}):

  1. new -> old C{ASK};
  2. old -> new C{OFFER} carrying, with C{SCM_RIGHTS}, the listening socket
     and the lock file descriptor, and in its body the socket's identity
     (device, inode) the old broker recorded, and in its text L{KEPT} when
     systemd holds the listener too (socket activation, the descriptor
     store), so that the new owner also leaves the path in place when it
     stops.  A C{flock} belongs to the open file description, which both
     processes now share: the lock is never released in between;
  3. the new broker checks what it received, listens on the same socket (the
     same inode: workloads' read-only mounts see it), starts accepting, and
     once its reactor runs sends C{TAKEN};
  4. the old broker stops accepting, gives up its control socket (removed
     only if still its own), answers C{RELEASED}, answers what it had
     accepted (each within its own deadline) and exits 0, leaving the broker
     socket in place: the new broker owns it now.

Both ends check the other with C{SO_PEERCRED}: the expected UID (root for
the default directory), and a process of this very PID namespace (its
C{/proc/PID/ns/pid} is ours, read while a C{SO_PEERPIDFD} pidfd, where the
kernel has one, proves the PID still names the process that connected).  If
anything fails, the new broker refuses to start as it did before (the lock
is held) and says why in one line, and the old broker keeps serving: it
hands over nothing until C{ASK} from a checked peer, and keeps serving
whatever happens after C{OFFER} until C{TAKEN}.  One handover at a time,
each bounded by L{TIMEOUT}.

The codec and the peer check are plain functions; L{ControlListener} is the
old broker's side on its reactor, L{take_over} the new broker's side, which
runs before its reactor does (twistd starts services first).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid import defaults
from hostpid.broker import fsrules
from hostpid.broker.fsrules import SocketIdentity
from hostpid.peercred import peer_credentials, peer_pidfd, pidfd_alive

MAGIC = b"HPHO"
VERSION = 1
#: Every message is this long: a header, an identity, a reason (NUL-padded).
MESSAGE_SIZE = 128
_HEADER = struct.Struct("!4sHHQQ")
REASON_SIZE = MESSAGE_SIZE - _HEADER.size

#: Seconds one handover may take, each side, from connect to the last message.
TIMEOUT = 5.0

#: Descriptors an offer carries: the listener, then the lock.
OFFERED_DESCRIPTORS = 2

#: An offer's text when systemd keeps the listener too: the path must
#: outlive its owner.  Any other text (an older broker sends none) means it
#: does not.
KEPT = "kept"

#: Connections the control socket queues; more wait in connect or fail.
CONTROL_BACKLOG = 4

#: C{SO_PASSRIGHTS} (Linux 6.16+), as L{hostpid.broker.descriptors} names it.
_SO_PASSRIGHTS = 83


class Kind(enum.IntEnum):
    ASK = 1
    OFFER = 2
    TAKEN = 3
    RELEASED = 4
    REFUSED = 5


class HandoverFailed(Exception):
    """A handover cannot happen; C{str} is the one-line reason."""


@attrs.frozen
class Message:
    kind: Kind
    device: int = 0
    inode: int = 0
    reason: str = ""


def encode(message: Message) -> bytes:
    """Exactly L{MESSAGE_SIZE} bytes; a reason too long is cut."""
    reason = message.reason.encode("utf-8", "replace")[:REASON_SIZE]
    head = _HEADER.pack(MAGIC, VERSION, message.kind, message.device, message.inode)
    return head + reason.ljust(REASON_SIZE, b"\0")


def decode(data: bytes) -> Message:
    """
    @raise HandoverFailed: not exactly one message of this version.
    """
    if len(data) != MESSAGE_SIZE:
        raise HandoverFailed(f"a handover message is {MESSAGE_SIZE} bytes, got {len(data)}")
    magic, version, kind, device, inode = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise HandoverFailed(f"not a hostpid handover peer (magic {magic!r})")
    if version != VERSION:
        raise HandoverFailed(f"handover protocol version {version}, this broker speaks {VERSION}")
    try:
        known = Kind(kind)
    except ValueError:
        raise HandoverFailed(f"unknown handover message kind {kind}") from None
    reason = data[_HEADER.size:].rstrip(b"\0").decode("utf-8", "replace")
    return Message(known, device, inode, reason)


def pid_namespace(pid: int | str = "self") -> int:
    """The inode of C{pid}'s PID namespace (C{/proc/PID/ns/pid})."""
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def peer_problem(sock: socket.socket, expected_uid: int) -> tuple[int, str | None]:
    """
    The peer's PID, and why it may not take part in a handover (or C{None}):
    it must run as C{expected_uid} and in this process's PID namespace.
    """
    try:
        credentials = peer_credentials(sock)
    except OSError as e:
        return 0, f"cannot read SO_PEERCRED: {e.strerror}"
    pid = credentials.pid
    if credentials.uid != expected_uid:
        return pid, f"peer PID {pid} runs as UID {credentials.uid}, not UID {expected_uid}"
    if pid <= 0:
        return pid, "peer is outside this PID namespace (SO_PEERCRED PID 0)"
    try:
        pidfd: int | None = peer_pidfd(sock)
    except OSError:
        pidfd = None  # before Linux 6.5: the PID alone, read while connected
    try:
        try:
            theirs, ours = pid_namespace(pid), pid_namespace()
        except OSError as e:
            return pid, f"cannot read peer PID {pid}'s PID namespace: {e.strerror}"
        if pidfd is not None and not pidfd_alive(pidfd):
            return pid, f"peer PID {pid} exited"
        if theirs != ours:
            return pid, (
                f"peer PID {pid} is in PID namespace pid:[{theirs}], not this broker's "
                f"pid:[{ours}]"
            )
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return pid, None


def allow_descriptor_passing(sock: socket.socket) -> None:
    """
    C{SO_PASSRIGHTS} back to 1 on a listener handed over by a broker that had
    set it to 0: the descriptor mode is the new broker's own.  Nothing to do
    on a kernel without the option.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_PASSRIGHTS, 1)
    except OSError as e:
        if e.errno not in (errno.ENOPROTOOPT, errno.EINVAL):
            raise


# --- The new broker's side: blocking, bounded, before its reactor runs. ---


@attrs.define
class Takeover:
    """
    What a new broker received: the listener, the lock, the socket's
    identity, and the control connection on which it says C{TAKEN}.
    """

    connection: socket.socket
    listener: socket.socket
    lockFd: int
    identity: SocketIdentity
    peerPid: int
    #: Whether systemd keeps the listener too (the offer said L{KEPT}).
    kept: bool = False

    def abandon(self) -> None:
        """Close all of it: the old broker sees the connection end and keeps serving."""
        self.connection.close()
        self.listener.close()
        os.close(self.lockFd)


def _receive(sock: socket.socket) -> tuple[Message, list[int]]:
    """One message and the descriptors that came with its first byte."""
    data, fds, flags, _ = socket.recv_fds(
        sock, MESSAGE_SIZE, OFFERED_DESCRIPTORS + 1, socket.MSG_CMSG_CLOEXEC
    )
    try:
        if flags & socket.MSG_CTRUNC:
            raise HandoverFailed("the offer carried more descriptors than a listener and a lock")
        while data and len(data) < MESSAGE_SIZE:
            more = sock.recv(MESSAGE_SIZE - len(data))
            if not more:
                break
            data += more
        if not data:
            raise HandoverFailed("the running broker closed the control connection")
        return decode(data), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _check_listener(listener: socket.socket) -> None:
    if listener.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) != socket.AF_UNIX:
        raise HandoverFailed("the descriptor offered as the listener is not an AF_UNIX socket")
    if listener.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
        raise HandoverFailed("the descriptor offered as the listener is not a stream socket")
    if not listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise HandoverFailed("the descriptor offered as the listener is not listening")
    name = listener.getsockname()
    if not isinstance(name, str) or os.path.basename(name) != defaults.SOCKET_NAME:
        raise HandoverFailed(f"the listener offered is bound to {name!r}, not a broker socket")


def _check_socket_path(directory_fd: int, identity: SocketIdentity, expected_uid: int) -> None:
    info = fsrules.identify_socket(directory_fd)
    if info is None or not identity.matches(info):
        raise HandoverFailed(
            "the socket path does not name the socket the running broker offered"
        )
    if info.st_uid != expected_uid or stat.S_IMODE(info.st_mode) != defaults.SOCKET_MODE:
        raise HandoverFailed(
            f"the socket offered is UID {info.st_uid} mode {stat.S_IMODE(info.st_mode):04o}, "
            f"not UID {expected_uid} mode {defaults.SOCKET_MODE:04o}"
        )


def _check_lock(directory_fd: int, lock_fd: int) -> None:
    held = os.fstat(lock_fd)
    try:
        named = os.stat(defaults.LOCK_NAME, dir_fd=directory_fd, follow_symlinks=False)
    except OSError as e:
        raise HandoverFailed(f"cannot look at the lock file: {e.strerror}") from None
    if not stat.S_ISREG(held.st_mode) or (held.st_dev, held.st_ino) != (
        named.st_dev, named.st_ino
    ):
        raise HandoverFailed("the descriptor offered as the lock is not this directory's lock")
    try:
        # The same open file description already holds it: this succeeds at
        # once, and proves the offered descriptor is the lock's holder.
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise HandoverFailed("the descriptor offered as the lock does not hold the lock") from None


def take_over(
    directory_fd: int, directory: str, expected_uid: int, timeout: float = TIMEOUT
) -> Takeover:
    """
    Ask the running broker for its listener and lock (steps 1-2), and check
    both.  The caller listens on the listener, then L{complete}s.

    @raise HandoverFailed: no handover; the running broker keeps serving.
    """
    info = fsrules.identify_socket(directory_fd, defaults.HANDOVER_NAME)
    path = os.path.join(directory, defaults.HANDOVER_NAME)
    if info is None:
        raise HandoverFailed(f"{path}: no control socket (the running broker cannot hand over)")
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != expected_uid or stat.S_IMODE(
        info.st_mode
    ) != defaults.HANDOVER_MODE:
        raise HandoverFailed(
            f"{path}: not a socket of UID {expected_uid} with mode "
            f"{defaults.HANDOVER_MODE:04o}; not used"
        )
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    connection.settimeout(timeout)
    try:
        try:
            connection.connect(fsrules.descriptor_path(directory_fd, directory,
                                                       defaults.HANDOVER_NAME))
        except OSError as e:
            raise HandoverFailed(
                f"{path}: cannot connect ({errno.errorcode.get(e.errno or 0, e.errno)}): "
                "the running broker does not answer handovers"
            ) from None
        pid, problem = peer_problem(connection, expected_uid)
        if problem is not None:
            raise HandoverFailed(f"{path}: {problem}")
        try:
            connection.sendall(encode(Message(Kind.ASK)))
        except OSError:
            pass  # refused at once: the refusal, already sent, says why
        try:
            message, fds = _receive(connection)
        except OSError as e:
            raise HandoverFailed(f"{path}: no offer: {e.strerror or e}") from None
        return _accept_offer(connection, message, fds, pid, directory_fd, expected_uid)
    except BaseException:
        connection.close()
        raise


def _accept_offer(
    connection: socket.socket, message: Message, fds: list[int], pid: int,
    directory_fd: int, expected_uid: int,
) -> Takeover:
    try:
        if message.kind is Kind.REFUSED:
            raise HandoverFailed(f"the running broker (PID {pid}) refused: {message.reason}")
        if message.kind is not Kind.OFFER:
            raise HandoverFailed(f"expected an offer, got {message.kind.name}")
        if len(fds) != OFFERED_DESCRIPTORS:
            raise HandoverFailed(f"the offer carried {len(fds)} descriptors, not 2")
        listener = socket.socket(fileno=fds[0])
        fds[0] = -1
        try:
            _check_listener(listener)
            identity = SocketIdentity(message.device, message.inode)
            _check_socket_path(directory_fd, identity, expected_uid)
            _check_lock(directory_fd, fds[1])
        except BaseException:
            listener.close()
            raise
    except BaseException:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        raise
    listener.setblocking(False)
    return Takeover(connection, listener, fds[1], identity, pid, kept=message.reason == KEPT)


def complete(
    takeover: Takeover, reactor: Any, done: Callable[[str | None], None],
    timeout: float = TIMEOUT,
) -> None:
    """
    Step 3's end, once this broker accepts on the listener (its reactor
    runs): say C{TAKEN}, wait (on the reactor, bounded) for C{RELEASED}, and
    call C{done} with C{None}, or what went wrong (this broker serves either
    way: the listener is its own now).
    """
    connection = takeover.connection
    try:
        connection.settimeout(None)
        connection.setblocking(False)
        connection.send(encode(Message(Kind.TAKEN)))
    except OSError as e:
        connection.close()
        done(f"could not tell the old broker: {e.strerror}")
        return
    _Reader(connection, reactor, timeout, done).start()


# --- The running broker's side, on its reactor. ---


@attrs.define(eq=False)
class _Reader:
    """
    Reads one message from a non-blocking control connection on the reactor,
    bounded by C{timeout}; calls C{done} once, with C{None} for C{RELEASED}
    or what went wrong.  Used by the new broker after C{TAKEN}.
    """

    sock: socket.socket
    reactor: Any
    timeout: float
    done: Callable[[str | None], None]
    _buffer: bytes = b""
    _timer: IDelayedCall | None = None

    def start(self) -> None:
        self._timer = self.reactor.callLater(self.timeout, self._finish, "no RELEASED in time")
        self.reactor.addReader(self)

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:
        return "hostpid-handover"

    def doRead(self) -> None:
        try:
            data = self.sock.recv(MESSAGE_SIZE - len(self._buffer))
        except BlockingIOError:
            return
        except OSError as e:
            self._finish(f"control connection failed: {e.strerror}")
            return
        if not data:
            self._finish("the old broker closed the control connection before RELEASED")
            return
        self._buffer += data
        if len(self._buffer) < MESSAGE_SIZE:
            return
        try:
            message = decode(self._buffer)
        except HandoverFailed as e:
            self._finish(str(e))
            return
        self._finish(None if message.kind is Kind.RELEASED else f"got {message.kind.name}")

    def connectionLost(self, reason: Failure) -> None:
        self._finish("control connection lost")

    def _finish(self, problem: str | None) -> None:
        if self.sock.fileno() < 0:
            return
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self.reactor.removeReader(self)
        self.sock.close()
        self.done(problem)


@attrs.frozen
class Offer:
    """What the running broker hands over."""

    listenerFd: int
    lockFd: int
    identity: SocketIdentity
    #: Whether systemd keeps the listener too.
    kept: bool = False


class ControlListener:
    """
    The running broker's control socket: one handover session at a time,
    each bounded by L{TIMEOUT}.

    @param offer: what to hand over now, or why not (a string).
    @param handedOver: called once the new broker (its PID) said C{TAKEN}
        and this control socket is gone; the service stops accepting.
    """

    log = Logger()

    def __init__(
        self,
        directoryFd: int,
        directory: str,
        expectedUid: int,
        reactor: Any,
        offer: Callable[[], Offer | str],
        handedOver: Callable[[int], None],
        timeout: float = TIMEOUT,
    ) -> None:
        self.directoryFd = directoryFd
        self.directory = directory
        self.path = os.path.join(directory, defaults.HANDOVER_NAME)
        self.expectedUid = expectedUid
        self.reactor = reactor
        self.offer = offer
        self.handedOver = handedOver
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.identity: SocketIdentity | None = None
        self.session: _Session | None = None
        #: Refused handover attempts, by reason (for tests and the log).
        self.refused: list[str] = []

    def open(self) -> str | None:
        """
        Bind the control socket (after removing a stale one, by the broker
        socket's rules), 0600 from birth.  Returns why not, or C{None}.
        """
        try:
            fsrules.clear_socket_path(
                self.directoryFd, self.directory, self.expectedUid, defaults.HANDOVER_NAME
            )
            bindPath = fsrules.descriptor_path(
                self.directoryFd, self.directory, defaults.HANDOVER_NAME
            )
        except fsrules.BrokerStartupError as e:
            return str(e)
        sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        old = os.umask(0o777 & ~defaults.HANDOVER_MODE)
        try:
            sock.bind(bindPath)
        except OSError as e:
            sock.close()
            return f"{self.path}: cannot bind: {e.strerror}"
        finally:
            os.umask(old)
        info = fsrules.identify_socket(self.directoryFd, defaults.HANDOVER_NAME)
        if (
            info is None or not stat.S_ISSOCK(info.st_mode) or info.st_uid != self.expectedUid
            or stat.S_IMODE(info.st_mode) != defaults.HANDOVER_MODE
        ):
            sock.close()
            return f"{self.path}: is not the socket just bound"
        self.identity = SocketIdentity.of(info)
        sock.listen(CONTROL_BACKLOG)
        self.sock = sock
        self.reactor.addReader(self)
        return None

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    def logPrefix(self) -> str:
        return "hostpid-handover"

    def connectionLost(self, reason: Failure) -> None:
        self.close()

    def doRead(self) -> None:
        for _ in range(CONTROL_BACKLOG):
            if self.sock is None:
                return
            try:
                connection, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.log.warn("hostpid-broker: handover: accept failed: {error}", error=e.strerror)
                return
            connection.setblocking(False)
            if self.session is not None:
                self._refuse(connection, "a handover is already in progress")
                continue
            pid, problem = peer_problem(connection, self.expectedUid)
            if problem is not None:
                self._refuse(connection, problem)
                continue
            self.session = _Session(self, connection, pid)
            self.session.start()

    def _refuse(self, connection: socket.socket, reason: str) -> None:
        self.refused.append(reason)
        self.log.warn("hostpid-broker: handover refused: {reason}", reason=reason)
        try:
            connection.send(encode(Message(Kind.REFUSED, reason=reason)), socket.MSG_NOSIGNAL)
        except OSError:
            pass
        connection.close()

    def close(self) -> None:
        """Stop listening; remove the control socket only if it is still ours."""
        if self.session is not None:
            self.session.end(None)
        sock, self.sock = self.sock, None
        if sock is None:
            return
        self.reactor.removeReader(self)
        sock.close()
        if self.identity is not None:
            try:
                fsrules.remove_socket_if_ours(
                    self.directoryFd, self.identity, defaults.HANDOVER_NAME
                )
            except OSError as e:
                self.log.error("hostpid-broker: could not remove {path}: {error}",
                               path=self.path, error=e.strerror)
            self.identity = None


class _Session:
    """One handover, from a checked peer's C{ASK} to its C{TAKEN}."""

    def __init__(self, control: ControlListener, sock: socket.socket, pid: int) -> None:
        self.control = control
        self.sock = sock
        self.pid = pid
        self.offered = False
        self.buffer = b""
        self.timer: IDelayedCall | None = None

    def start(self) -> None:
        self.timer = self.control.reactor.callLater(
            self.control.timeout, self.end, "timed out; still serving"
        )
        self.control.reactor.addReader(self)

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:
        return "hostpid-handover"

    def connectionLost(self, reason: Failure) -> None:
        self.end("control connection lost; still serving")

    def doRead(self) -> None:
        try:
            data = self.sock.recv(MESSAGE_SIZE - len(self.buffer))
        except BlockingIOError:
            return
        except OSError as e:
            self.end(f"control connection failed ({e.strerror}); still serving")
            return
        if not data:
            self.end(f"PID {self.pid} went away before taking over; still serving")
            return
        self.buffer += data
        if len(self.buffer) < MESSAGE_SIZE:
            return
        data, self.buffer = self.buffer, b""
        try:
            message = decode(data)
        except HandoverFailed as e:
            self.end(f"{e}; still serving")
            return
        if message.kind is Kind.ASK and not self.offered:
            self._offer()
        elif message.kind is Kind.TAKEN and self.offered:
            self._taken()
        else:
            self.end(f"unexpected {message.kind.name}; still serving")

    def _offer(self) -> None:
        offer = self.control.offer()
        if isinstance(offer, str):
            self._send(Message(Kind.REFUSED, reason=offer))
            self.end(f"nothing to offer: {offer}")
            return
        message = Message(
            Kind.OFFER, offer.identity.device, offer.identity.inode,
            reason=KEPT if offer.kept else "",
        )
        try:
            socket.send_fds(self.sock, [encode(message)], [offer.listenerFd, offer.lockFd])
        except OSError as e:
            self.end(f"could not send the offer ({e.strerror}); still serving")
            return
        self.offered = True
        self.control.log.info(
            "hostpid-broker: handover: listener and lock offered to PID {pid}", pid=self.pid
        )

    def _taken(self) -> None:
        control = self.control
        self._stopReading()
        control.session = None
        control.close()
        # The service stops accepting (and passes systemd the main PID, on a
        # reload) before the new broker hears RELEASED: what RELEASED says
        # is then already true.
        control.handedOver(self.pid)
        self._send(Message(Kind.RELEASED))
        self.sock.close()

    def _send(self, message: Message) -> None:
        try:
            self.sock.send(encode(message), socket.MSG_NOSIGNAL)
        except OSError:
            pass

    def _stopReading(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        if self.sock.fileno() >= 0:
            self.control.reactor.removeReader(self)

    def end(self, problem: str | None) -> None:
        """End this session without a handover; the broker keeps serving."""
        if self.control.session is not self:
            return
        self.control.session = None
        self._stopReading()
        self.sock.close()
        if problem is not None:
            self.control.refused.append(problem)
            self.control.log.warn("hostpid-broker: handover abandoned: {problem}",
                                  problem=problem)
