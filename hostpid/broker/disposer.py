"""
The disposer: a small process of its own that closes what clients passed.

This file is run as a program (C{python -I -S -c SOURCE FD PROGRESS PARENT}), never
imported by the broker: it uses the standard library only, so that the
child starts in a few milliseconds and depends on nothing the broker's
environment might shadow.  L{hostpid.broker.descriptors.BackgroundCloser}
starts it, sends it connections over a Unix stream (C{SCM_RIGHTS}, up to
C{SCM_MAX_FD} a message, one byte each) and reads its progress on a
C{SOCK_SEQPACKET} pair.

What it is sent: client connections (Unix stream sockets) whose receive
queue holds descriptors some client passed.  The broker never installs such
a descriptor in its own table, and neither does this process: every
C{close(2)} of a descriptor, not only of its last reference, runs the file's
C{flush}, and a FUSE file whose server never answers C{FLUSH} (or a file on
a hard NFS mount) holds the closing thread in D state, deaf to every
signal; so does a process's exit, which closes its table.  Instead each
connection is I{drained}: shut for reading (its peer can add nothing more),
then read with no room for ancillary data, so that the kernel drops every
queued descriptor's reference itself (C{scm_detach_fds} finds no room and
releases them with C{fput}, which runs the file's C{release}, never its
C{flush}).  Then the connection is closed.

Why a process and not threads: a reference dropped may still be the last
one of something whose release waits: a TCP socket with C{SO_LINGER {1, N}}
and a send queue nobody reads waits N seconds, nested as deeply in passed
Unix sockets as its maker likes; a release that ignores signals (a hard
NFS mount) waits for good.  Threads stuck that way can never be reclaimed,
and neither can the broker process that holds them.  A process that is
stuck can be abandoned (killed and replaced): the broker lives on, and a
killed disposer's lingering releases end at once (a fatal signal is
pending).

How this process keeps each step short:

  - I{Interrupt.}  Every read and close runs with an interval timer armed
    (L{INTERRUPT_EVERY}): a lingering socket's wait, however deeply nested,
    and in-flight garbage the kernel's collector frees here, end at
    C{SIGALRM} within a few milliseconds.  C{SIGALRM} is a standard signal:
    at most one is ever pending, so nothing is queued against the node's
    C{RLIMIT_SIGPENDING}.
  - I{Report progress.}  After each connection it sends the parent its
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
import time

#: Seconds between interrupts while a read or close is in progress.
INTERRUPT_EVERY = 0.002

#: Reads of one connection's queue at most, before it is closed anyway
#: (with the timer armed: closing it drops what is left the same way).
MAX_READS = 64

#: The kernel's C{SCM_MAX_FD}.
SCM_MAX_FD = 253

#: The running totals sent after each connection: closed, drained (queues
#: that held descriptors, read out), and interrupted (reads or closes still
#: in progress when the timer fired).
PROGRESS = struct.Struct("=QQQ")

_PR_SET_PDEATHSIG = 1
_CHANNEL_ANCILLARY = socket.CMSG_SPACE(SCM_MAX_FD * array.array("i").itemsize)
_MSG_CTRUNC = socket.MSG_CTRUNC

closed = 0
drained = 0
interrupted = 0
_busy = False


#: Where progress is reported (set by L{main}), and when an interrupt last was.
_progress: socket.socket | None = None
_reportedAt = 0.0
#: Interrupts are reported at most this often (the broker judges every 0.5 s).
REPORT_EVERY = 0.1


def _alarm(signum: int, frame: object) -> None:
    global interrupted, _reportedAt
    if _busy:
        interrupted += 1
        # Reported, at most every REPORT_EVERY (the pair's queue, 10
        # messages, stays free for the report after each connection): a
        # handler runs only once the interrupted call has returned, so each
        # report proves a wait that signals end, and the broker does not
        # abandon a disposer busy cutting them.
        now = time.monotonic()
        if _progress is not None and now - _reportedAt >= REPORT_EVERY:
            _reportedAt = now
            report(_progress)


class Interruptible:
    """A block during which the interval timer interrupts every few ms."""

    def __enter__(self) -> None:
        global _busy
        _busy = True
        signal.setitimer(signal.ITIMER_REAL, INTERRUPT_EVERY, INTERRUPT_EVERY)

    def __exit__(self, *exc: object) -> None:
        global _busy
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        _busy = False


def collect_unix_garbage() -> None:
    """
    Close a throwaway Unix socket pair: on kernels before 6.10 that runs the
    kernel's collector of in-flight garbage (a passed Unix socket that
    carries itself, which our reads may just have made) here, with the
    timer armed, rather than in whichever thread next closes a Unix socket.
    """
    try:
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return
    left.close()
    right.close()


def dispose(fd: int) -> None:
    """Drain the connection C{fd} (see the module), then close it."""
    global closed, drained
    with Interruptible():
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            sock = None
        if sock is not None:
            if drain(sock):
                drained += 1
            fd = sock.detach()
        try:
            os.close(fd)
        except OSError:
            pass
        collect_unix_garbage()
    closed += 1


def drain(sock: socket.socket) -> bool:
    """
    Read a connection's queue out with no room for ancillary data: every
    descriptor queued is dropped by the kernel, never installed here.

    @return: whether any message carried descriptors.
    """
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    found = False
    for _ in range(MAX_READS):
        try:
            data, _ancillary, flags, _address = sock.recvmsg(65536, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        except ConnectionResetError:
            continue
        except OSError:
            break
        if flags & _MSG_CTRUNC:
            found = True
        elif not data:
            break
    return found


def report(progress: socket.socket) -> None:
    try:
        progress.send(PROGRESS.pack(closed, drained, interrupted), socket.MSG_DONTWAIT)
    except OSError:
        pass


def descriptors_in(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            count = len(data) // 4
            fds.extend(struct.unpack(f"{count}i", data[: count * 4]))
    return fds


def main(fd: int, progressFd: int, parent: int) -> None:
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
    global _progress
    progress = _progress = socket.socket(fileno=progressFd)
    # Ready: the broker judges this process by its progress from now on.
    report(progress)
    while True:
        try:
            # From the broker: its connections only (Unix sockets, which
            # have no flush), never a descriptor a client passed.
            data, ancillary, _flags, _address = channel.recvmsg(
                1, _CHANNEL_ANCILLARY, socket.MSG_CMSG_CLOEXEC
            )
        except InterruptedError:
            continue
        except OSError:
            return
        if not data and not ancillary:
            return
        for connection in descriptors_in(ancillary):
            dispose(connection)
            report(progress)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
