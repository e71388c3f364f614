"""
C{SO_PEERCRED} as a client reads it: the listener's PID, UID and GID.

A client transaction (and C{hostpid probe}, a fresh interpreter every few
seconds on every node) needs only this one option, so it lives apart from
L{hostpid.peercred}, the broker's side (pidfds, liveness, start times),
which loads C{enum}, C{signal} and C{fcntl}.  It uses the C module
C{_socket} and nothing of the C{socket} module, whose import (C{enum},
C{selectors}, C{collections}) costs a probe more than its transaction.
"""

from __future__ import annotations

import _socket
import struct

from hostpid.values import Value

#: C{struct ucred}: three C ints.
UCRED = struct.Struct("3i")
SOL_SOCKET: int = _socket.SOL_SOCKET
SO_PEERCRED: int = _socket.SO_PEERCRED


class PeerCredentials(Value):
    """C{struct ucred}: the peer's PID, UID and GID."""

    __slots__ = ("pid", "uid", "gid")
    pid: int
    uid: int
    gid: int

    def __init__(self, pid: int, uid: int, gid: int) -> None:
        self._set(pid=pid, uid=uid, gid=gid)


def peer_credentials(sock: _socket.socket) -> PeerCredentials:
    """
    The credentials of C{sock}'s peer (a C{socket.socket} is one too).

    A PID of 0 means the peer is not visible in this process's PID namespace;
    callers must treat C{pid <= 0} as a failure, never as an answer.

    @raise OSError: the kernel refused (for example the socket is closed).
    """
    return PeerCredentials(*UCRED.unpack(sock.getsockopt(SOL_SOCKET, SO_PEERCRED, UCRED.size)))
