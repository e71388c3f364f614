"""
The disposer: a small process of its own that closes what clients passed.

This file is run as a program (C{python -I -S -c SOURCE FD}), never
imported by the broker: it uses the standard library only, so that the
child starts in a few milliseconds and depends on nothing the broker's
environment might shadow.  L{hostpid.broker.descriptors.BackgroundCloser}
starts it, sends it descriptors over a C{SOCK_SEQPACKET} socket pair
(C{SCM_RIGHTS}, up to C{SCM_MAX_FD} a message) and reads its progress.

Why a process and not threads: a close can block in the kernel for as long
as whoever made the descriptor likes.  A lingering TCP socket's wait
(C{sk_stream_wait_close}) ends when a signal is pending; a FUSE file whose
server never answers C{FLUSH}, or a hard NFS mount, ignores every signal
and holds the closing thread in D state.  Threads stuck that way can never
be reclaimed, and neither can the broker process that holds them: it
would not even finish dying.  A process that is stuck can be abandoned
(killed and replaced): the broker lives on, and a killed disposer's
lingering closes end at once (a fatal signal is pending).

How this process keeps each close short:

  - I{Disarm first.}  An Internet socket gets C{SO_LINGER {1, 0}}, so its
    close resets the connection at once.  A Unix socket is drained before
    it is closed: C{shutdown(SHUT_RD)} (its peer can add nothing more), then
    its queue is read with room for descriptors, and each descriptor found
    there is disposed of the same way, recursively up to L{MAX_DEPTH}.  So a
    lingering socket nested inside passed Unix sockets is disarmed in
    microseconds instead of waiting out its linger.
  - I{Interrupt the rest.}  Every close runs with an interval timer armed
    (L{INTERRUPT_EVERY}): what is nested too deep, or in-flight garbage the
    kernel's collector frees here, is interrupted by C{SIGALRM} within a few
    milliseconds.  C{SIGALRM} is a standard signal: at most one is ever
    pending, so nothing is queued against the node's C{RLIMIT_SIGPENDING}.
  - I{Report progress.}  After each descriptor it sends the parent its
    running totals (L{PROGRESS}), without blocking: a parent that reads
    late finds the latest totals in the last message it reads.  A disposer
    that makes no progress for the parent's bound is abandoned.

It dies with the broker (C{PR_SET_PDEATHSIG}) and ends at end of file on
its socket.
"""

import array
import ctypes
import os
import signal
import socket
import struct
import sys

#: Seconds between interrupts while a close is in progress.
INTERRUPT_EVERY = 0.002

#: How deep a chain of Unix sockets carrying Unix sockets is drained.
MAX_DEPTH = 4

#: Reads of one Unix socket's queue at most, before it is closed anyway
#: (with the timer armed).
MAX_READS = 64

#: The kernel's C{SCM_MAX_FD}.
SCM_MAX_FD = 253

#: The running totals sent after each descriptor: closed, disarmed
#: (Internet sockets reset, Unix sockets drained) and interrupted (closes
#: still in progress when the timer fired).
PROGRESS = struct.Struct("=QQQ")

_PR_SET_PDEATHSIG = 1
_LINGER_RESET = struct.pack("ii", 1, 0)
_INTERNET = (socket.AF_INET, socket.AF_INET6)
_ANCILLARY = socket.CMSG_SPACE(SCM_MAX_FD * array.array("i").itemsize)
_RECV_FLAGS = socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC

closed = 0
disarmed = 0
interrupted = 0
_closing = False


def _alarm(signum: int, frame: object) -> None:
    global interrupted
    if _closing:
        interrupted += 1


def close_bounded(fd: int, count: bool = True) -> None:
    """Close C{fd} with the interval timer armed; C{count} it as a passed one."""
    global closed, _closing
    _closing = True
    signal.setitimer(signal.ITIMER_REAL, INTERRUPT_EVERY, INTERRUPT_EVERY)
    try:
        os.close(fd)
    except OSError:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        _closing = False
    if count:
        closed += 1


def descriptors_in(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            count = len(data) // 4
            fds.extend(struct.unpack(f"{count}i", data[: count * 4]))
    return fds


def dispose(fd: int, depth: int = 0) -> None:
    """Disarm what can be disarmed, then close C{fd} (see the module)."""
    global disarmed
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        close_bounded(fd, depth == 0)
        return
    try:
        family = sock.family
        if family in _INTERNET:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            disarmed += 1
        elif family == socket.AF_UNIX and depth < MAX_DEPTH:
            drain(sock, depth)
            disarmed += 1
    except OSError:
        family = None
    close_bounded(sock.detach(), depth == 0)
    if family == socket.AF_UNIX:
        collect_unix_garbage()


def collect_unix_garbage() -> None:
    """
    Close a throwaway Unix socket pair: on kernels before 6.10 that runs the
    kernel's collector of in-flight garbage (a passed Unix socket that
    carries itself, which our close may just have made) here, with the
    timer armed, rather than in whichever thread next closes a Unix socket.
    """
    try:
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return
    close_bounded(left.detach(), count=False)
    close_bounded(right.detach(), count=False)


def drain(sock: socket.socket, depth: int) -> None:
    """Read a Unix socket's queue out, disposing of what it carries."""
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    for _ in range(MAX_READS):
        try:
            data, ancillary, _flags, _address = sock.recvmsg(65536, _ANCILLARY, _RECV_FLAGS)
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionResetError:
            continue
        except OSError:
            return
        for inner in descriptors_in(ancillary):
            dispose(inner, depth + 1)
        if not data and not ancillary:
            return


def report(channel: socket.socket) -> None:
    try:
        channel.send(PROGRESS.pack(closed, disarmed, interrupted), socket.MSG_DONTWAIT)
    except OSError:
        pass


def main(fd: int, parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        # The broker ended before the death signal was set.
        return
    signal.signal(signal.SIGALRM, _alarm)
    signal.siginterrupt(signal.SIGALRM, True)
    for other in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(other, signal.SIG_IGN)
    channel = socket.socket(fileno=fd)
    while True:
        try:
            data, ancillary, _flags, _address = channel.recvmsg(
                1, _ANCILLARY, socket.MSG_CMSG_CLOEXEC
            )
        except InterruptedError:
            continue
        except OSError:
            return
        if not data and not ancillary:
            return
        for passed in descriptors_in(ancillary):
            dispose(passed)
            report(channel)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
