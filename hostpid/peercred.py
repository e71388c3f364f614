"""
Reading the kernel's word on who is at the other end of a Unix socket.

C{SO_PEERCRED} reports the peer's PID, UID and GID as they were when it called
C{connect()}, translated into the reader's PID namespace.  Twisted exposes no
wrapper, so this module is the one place that knows the C{struct ucred} layout.
"""

from __future__ import annotations

import socket
import struct

import attrs

_UCRED = struct.Struct("3i")


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
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))
