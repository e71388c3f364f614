"""
What an accepted connection is on the broker's fast path, and the system
calls made on it.

Where the C helper C{_hostpid_native} (C{native/}) is built, a connection
is its bare descriptor, an C{int}, from C{accept} to C{close}.  No socket
object is built for it, so there is no C{getsockname} (CPython's socket
constructor asks it of every descriptor it is given), no address asked of
C{accept} and thrown away, and no GIL dropped and taken again around each
call: 1-3 us less per transaction, in both descriptor modes
(C{CHANGELOG.md}, performance history).  Where the helper is not built, a
connection is a C{_socket.socket} and the calls are the socket module's
methods, the reference the helper's calls must match: the same system
calls, the same flags, the same errors.

Only the fast path holds connections this way.  One that goes on to the
waiting room (L{hostpid.broker.waiting}) becomes a socket object there
(L{ConnectionCalls.socketOf}): the reactor reads it, and the general path's
rarer calls (C{recvmsg} with ancillary data, C{shutdown}) are the socket
module's.

The calls that create or end a connection (C{accept}, C{close}) take
descriptors only: a socket object given to C{close} would be left holding a
closed descriptor number that the next C{accept} reuses.
"""

from __future__ import annotations

import _socket
import functools
from collections.abc import Callable
from typing import Any

import attrs

#: The C helper module, or C{None} where it is not built.
try:
    import _hostpid_native as helper
except ImportError as e:
    helper = None  # type: ignore[assignment]
    #: Why the C helper is not in use (for the broker's start-up log line).
    NATIVE_MISSING: str | None = str(e)
else:
    NATIVE_MISSING = None

#: A connection on the fast path: its descriptor where the C helper is
#: built, a socket object where not (one kind per L{ConnectionCalls}).
Connection = Any

#: The socket object for a descriptor of an accepted Unix stream
#: connection, which owns it from then on.  Plain ints (the socket module's
#: constants are enum members), and a C-level partial: no Python frame on
#: the fallback's accept path.
unix_socket = functools.partial(
    _socket.socket, int(_socket.AF_UNIX), int(_socket.SOCK_STREAM), 0
)


#: C{getsockopt(conn, level, option)} of an int option on a connection of
#: either kind (the helper's takes a descriptor or a socket object).
getsockopt: Callable[[Connection, int, int], int] = (
    helper.getsockopt if helper is not None else _socket.socket.getsockopt
)


@attrs.frozen
class ConnectionCalls:
    """
    One kind of fast-path connection and the calls made on it.

    @ivar native: whether connections are descriptors, and the calls the C
        helper's.
    @ivar acceptorFor: given the listening socket, a function of no
        arguments that accepts one connection (raising C{OSError} as
        C{accept}: C{BlockingIOError} when none is waiting).
    @ivar recv: C{recv(conn, size, flags)}: the bytes read.
    @ivar send: C{send(conn, data, flags)}: the count sent.
    @ivar close: C{close(conn)}: the connection is gone.
    @ivar socketOf: C{socketOf(conn)}: the connection as a socket object,
        which owns it from then on.
    """

    native: bool
    acceptorFor: Callable[[_socket.socket], Callable[[], Connection]]
    recv: Callable[[Connection, int, int], bytes]
    send: Callable[[Connection, bytes, int], int]
    close: Callable[[Connection], None]
    socketOf: Callable[[Connection], _socket.socket]


def _descriptor_acceptor(listener: _socket.socket) -> Callable[[], int]:
    return functools.partial(helper.accept, listener.fileno())


def _socket_acceptor(listener: _socket.socket) -> Callable[[], _socket.socket]:
    # The C-level accept and socket type: socket.socket.accept() builds an
    # instance of the Python subclass for each connection, about 2.5 us
    # more (CHANGELOG.md, optimisation log).
    accept = listener._accept  # type: ignore[attr-defined]

    def acceptOne() -> _socket.socket:
        fd, _address = accept()
        return unix_socket(fd)

    return acceptOne


def _same_socket(sock: _socket.socket) -> _socket.socket:
    return sock


#: Connections as socket objects: the socket module's calls.
SOCKETS = ConnectionCalls(
    native=False,
    acceptorFor=_socket_acceptor,
    recv=_socket.socket.recv,
    send=_socket.socket.send,
    close=_socket.socket.close,
    socketOf=_same_socket,
)


def descriptor_calls() -> ConnectionCalls:
    """
    Connections as descriptors, their calls the C helper's.

    @raise RuntimeError: the helper is not built.
    """
    if helper is None:
        raise RuntimeError(f"the C helper _hostpid_native is not built: {NATIVE_MISSING}")
    return ConnectionCalls(
        native=True,
        acceptorFor=_descriptor_acceptor,
        recv=helper.recv,
        send=helper.send,
        close=helper.close,
        socketOf=unix_socket,
    )


def default_calls() -> ConnectionCalls:
    """Descriptors where the C helper is built, socket objects where not."""
    return descriptor_calls() if helper is not None else SOCKETS
