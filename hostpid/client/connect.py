"""
The connect step both client transports share: one non-blocking,
close-on-exec Unix stream socket, one connect attempt at a time, and the
backoff between attempts while the broker's accept queue is full.

A connect to a Unix socket never blocks and never completes later: it
connects at once, fails with C{EAGAIN} when the listener's accept queue is
full, or fails for good.  So neither transport needs C{EINPROGRESS}
handling; the blocking client sleeps the backoff (L{hostpid.client.blocking})
and the Twisted client schedules it on its clock (L{hostpid.client.txclient}).
The policy (how long, how often) lives here once so the two cannot drift, and
matches the C client's.

It makes the socket with the C module C{_socket}: the C{socket} module's
import (C{enum}, C{selectors}, C{collections}) would cost an exec probe
more CPU than its whole transaction.
"""

from __future__ import annotations

import _socket

from hostpid.client.trust import CONNECT, HostPidUnavailable, os_error_text

__all__ = ["FIRST_BACKOFF", "LAST_BACKOFF", "new_socket", "next_backoff", "try_connect"]

#: The first pause between connect attempts while the accept queue is full.
FIRST_BACKOFF = 0.001

#: The longest pause: short enough to catch a draining queue.
LAST_BACKOFF = 0.010


def next_backoff(delay: float) -> float:
    """The pause after C{delay}: doubling, at most L{LAST_BACKOFF}."""
    return min(delay * 2, LAST_BACKOFF)


def new_socket() -> _socket.socket:
    """
    A Unix stream socket that never blocks and is not inherited across
    C{exec}: a client in a workload must not leak it into child programs.
    """
    return _socket.socket(
        _socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC
    )


def try_connect(sock: _socket.socket, address: str) -> bool:
    """
    One non-blocking connect attempt: C{True} when connected, C{False} when
    the accept queue is full (retry after L{next_backoff}).

    @raise HostPidUnavailable: the kernel refused for any other reason
        (check C{connect}).
    """
    try:
        sock.connect(address)
    except BlockingIOError:
        return False
    except OSError as error:
        raise HostPidUnavailable(CONNECT, os_error_text(error)) from None
    return True
