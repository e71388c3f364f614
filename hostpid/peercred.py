"""
Reading the kernel's word on who is at the other end of a Unix socket.

C{SO_PEERCRED} reports the peer's PID, UID and GID as they were when it called
C{connect()}, translated into the reader's PID namespace.  Twisted exposes no
wrapper, so this module is the one place that knows the C{struct ucred} layout.

Credentials are fixed at connect time.  If the process that connected has
since handed the connection on and exited, its PID may already name another
process.  C{SO_PEERPIDFD} (Linux 6.5+) gives a pidfd for the very process that
connected, and C{pidfd_send_signal(pidfd, 0)} (Linux 5.1+) tells whether
that process still exists, which is what makes its PID still its own:
L{PeerIdentifier} answers only then.  Where that system call is refused (a
seccomp filter), C{PIDFD_GET_INFO} (Linux 6.13+, else C{/proc/self/fdinfo})
gives the pidfd's current PID instead, which must equal the one reported.
"""

from __future__ import annotations

import _socket
import errno
import fcntl
import os
import signal
import socket
import struct
from collections.abc import Callable

import attrs
from twisted.logger import Logger

_UCRED = struct.Struct("3i")
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SO_PEERCRED = int(socket.SO_PEERCRED)

#: C{SO_PEERPIDFD} from C{asm-generic/socket.h}; Python 3.11 has no constant.
SO_PEERPIDFD = 77
#: C{_IOWR(PIDFS_IOCTL_MAGIC, 11, struct pidfd_info)} with the 64-byte version 0.
PIDFD_GET_INFO = 0xC040FF0B
PIDFD_INFO_PID = 1
_PIDFD_INFO = struct.Struct("QQI")
_PIDFD_INFO_SIZE = 64


@attrs.frozen
class PeerCredentials:
    """C{struct ucred}: the peer's PID, UID and GID."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """
    The credentials of C{sock}'s peer.

    A PID of 0 means the peer is not visible in this process's PID namespace;
    callers must treat C{pid <= 0} as a failure, never as an answer.

    @raise OSError: the kernel refused (for example the socket is closed).
    """
    return PeerCredentials(*_UCRED.unpack(sock.getsockopt(_SOL_SOCKET, _SO_PEERCRED, _UCRED.size)))


def peer_pidfd(sock: _socket.socket) -> int:
    """
    A new pidfd for the process that connected C{sock}; the caller closes it.

    @raise OSError: C{ENOPROTOOPT} on kernels before 6.5, or another error.
    """
    # With no buffer length, getsockopt returns the option as a C int.
    return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)


_pidfd_send_signal = signal.pidfd_send_signal


def pidfd_alive(pidfd: int) -> bool:
    """
    Whether the process C{pidfd} refers to still exists (a zombie not yet
    reaped does: its PID is not free for reuse).  One system call, the
    cheapest the kernel offers for the question: signal 0 is only checked,
    never sent.  C{EPERM} (not ours to signal) still means it exists.

    @raise OSError: anything but C{ESRCH} and C{EPERM}.
    """
    try:
        _pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pidfd_signal_usable() -> bool:
    """
    Whether L{pidfd_alive} can be trusted here: signalling our own pidfd
    with 0 must succeed.  A seccomp filter that refuses the system call
    answers C{EPERM} (or C{ENOSYS}), which L{pidfd_alive} would read as
    "exists" for every peer.
    """
    try:
        own = os.pidfd_open(os.getpid())
    except OSError:
        return False
    try:
        _pidfd_send_signal(own, 0)
    except OSError:
        return False
    finally:
        os.close(own)
    return True


def _fdinfo_pid(pidfd: int) -> int | None:
    with open(f"/proc/self/fdinfo/{pidfd}", "rb") as info:
        for line in info:
            if line.startswith(b"Pid:"):
                pid = int(line.split()[1])
                return pid if pid > 0 else None
    return None


def pidfd_current_pid(pidfd: int) -> int | None:
    """
    The PID, in this PID namespace, of the process C{pidfd} refers to, or
    C{None} if that process is gone.  One C{ioctl} where the kernel has
    C{PIDFD_GET_INFO}; C{/proc/self/fdinfo} otherwise.
    """
    buffer = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("Q", buffer, 0, PIDFD_INFO_PID)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buffer)
    except OSError as e:
        if e.errno == errno.ESRCH:
            return None
        if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            return _fdinfo_pid(pidfd)
        raise
    mask, _cgroup, pid = _PIDFD_INFO.unpack_from(buffer)
    if not mask & PIDFD_INFO_PID:
        return _fdinfo_pid(pidfd)
    return int(pid)


class PeerUnverified(Exception):
    """The peer's host PID cannot be vouched for; close with no reply."""


class PeerCredentialsFailed(PeerUnverified):
    """C{SO_PEERCRED} failed, or reported a PID that is not positive."""


class PeerGone(PeerUnverified):
    """The process that connected has exited (or its pidfd names another PID)."""


class PeerIdentifier:
    """
    Finds the host PID of a connected peer, and vouches that the process that
    connected is still the one that PID names.

    Where the kernel lacks C{SO_PEERPIDFD}, it falls back to C{SO_PEERCRED}
    alone and says so once in the log; L{pidfdSupported} tells the metrics.

    @ivar pidfdSupported: C{None} until the first peer was checked, then
        whether the pidfd check is in force.
    """

    log = Logger()

    def __init__(
        self,
        usePidfd: bool = True,
        peerPidfd: Callable[[_socket.socket], int] = peer_pidfd,
    ) -> None:
        self.pidfdSupported: bool | None = None if usePidfd else False
        self._peerPidfd = peerPidfd
        #: Whether the liveness test is one C{pidfd_send_signal}, or (where
        #: that is refused) the pidfd's current PID compared with the reported one.
        self.signalCheck = usePidfd and pidfd_signal_usable()

    def host_pid(self, sock: _socket.socket) -> int:
        """
        @raise PeerCredentialsFailed: no credentials, or PID not positive.
        @raise PeerGone: the connecting process is no longer there.
        """
        try:
            # The PID alone, as a C int: the kernel copies as much of
            # C{struct ucred} as the buffer holds, and the PID comes first.
            # No bytes object and no unpacking on the hot path.
            pid = sock.getsockopt(_SOL_SOCKET, _SO_PEERCRED)
        except OSError as e:
            raise PeerCredentialsFailed(e.strerror) from None
        if pid <= 0:
            raise PeerCredentialsFailed(f"PID {pid} (peer outside this PID namespace)")
        if self.pidfdSupported is False:
            return pid
        try:
            pidfd = self._peerPidfd(sock)
        except OSError as e:
            if e.errno != errno.ENOPROTOOPT:
                raise PeerCredentialsFailed(f"SO_PEERPIDFD: {e.strerror}") from None
            self.pidfdSupported = False
            self.log.warn(
                "hostpid-broker: this kernel has no SO_PEERPIDFD; replies rest on "
                "SO_PEERCRED alone (a caller that exits after connecting is not detected)"
            )
            return pid
        self.pidfdSupported = True
        try:
            if self.signalCheck:
                if pidfd_alive(pidfd):
                    return pid
                raise PeerGone(f"connected as PID {pid}, since exited")
            current = pidfd_current_pid(pidfd)
        except OSError as e:
            raise PeerCredentialsFailed(f"pidfd: {e.strerror}") from None
        finally:
            os.close(pidfd)
        if current != pid:
            raise PeerGone(f"connected as PID {pid}, now {current}")
        return pid
