"""
Closing what clients passed, in a process the broker can abandon.

A descriptor a client passes may take as long to close as its maker likes:
a TCP socket with C{SO_LINGER {1, N}} and a send queue nobody reads waits N
seconds, however deeply it is nested in Unix sockets' queues; a FUSE file
whose server never answers C{FLUSH} (or a file on a hard NFS mount) waits
in D state, deaf to every signal.  Closed in the broker, the first kind
can only be interrupted (a signal per close, queued against the node's
C{RLIMIT_SIGPENDING}) and the second holds its thread, and the broker
process itself, for good: it would not even finish dying on C{SIGKILL}.

So the broker closes none of them, and never even installs one: every
C{close(2)} of a descriptor, not only of its last reference, runs the file's
C{flush}, so a FUSE file would hold whichever thread closed any copy of it
(L{hostpid.broker.descriptors.PassedDescriptors}, C{takesDescriptors}).  A
connection whose queue holds passed descriptors goes whole to
L{BackgroundCloser}, which passes it (with C{SCM_RIGHTS}, over a
C{SOCK_SEQPACKET} socket pair) to a I{disposer} process
(L{hostpid.broker.disposer}) and closes its own copy: a Unix socket, which
has no flush, and never the last reference, since the message in flight
holds one.  The disposer drains each connection with no room for ancillary
data, so the kernel drops the queued descriptors' references itself, with
their C{release} and never their C{flush}; a release that waits (a
lingering socket's) is interrupted by its C{SIGALRM} timer within
milliseconds.  It reports its progress after each connection.  A disposer
that makes no progress for L{STUCK_AFTER} is stuck in a wait that ignores
signals (a release on a hard NFS mount, for one): it is killed and
I{abandoned}, and a fresh one takes the next connections.  A killed
disposer's interruptible waits end at once (a fatal signal is pending);
the rest keep that process in D state, but the broker lives on, serves,
and stops when asked.  At most L{MAX_ABANDONED} abandoned disposers may
still be alive: past that, a stuck disposer is kept, and connections wait
in flight on its stream (L{CHANNEL_BUFFER}), in no descriptor table; only
once that is full do they wait in the broker (L{held}, counted in
L{pending}).

None of this touches accepting: connections that carry no descriptor are
accepted, read and answered whatever the disposer is doing.
"""

from __future__ import annotations

import array
import collections
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.logger import Logger

from hostpid.broker import disposer
from hostpid.broker.closewatch import CloseGuard, CloseWatch, close_watched, default_watch

#: Descriptors held in the broker and with the disposer, not yet reported
#: closed, beyond which L{BackgroundCloser.saturated} (reads then take no
#: new descriptors).  Room for two full C{SCM_RIGHTS} messages.
CLOSER_QUEUE = 2 * 256

#: A disposer with descriptors to close and no progress for this long is
#: stuck in a close that ignores signals (its own timer interrupts the
#: others within milliseconds): abandoned.
STUCK_AFTER = 0.5

#: How long a disposer may take to start (seconds) before it is abandoned.
STARTUP_TIMEOUT = 30.0

#: Abandoned disposers that may still be alive (stuck in D state) before a
#: stuck one is kept instead of replaced: a tenant able to wedge them (a
#: FUSE or NFS server of its own) cannot fill the node's process table
#: through the broker.
MAX_ABANDONED = 8

#: Descriptors one message carries at most (the kernel's C{SCM_MAX_FD}).
_BATCH = disposer.SCM_MAX_FD

#: The send buffer of the stream connections go to a disposer on (bytes):
#: each message (a byte and up to 253 connections) costs about a kilobyte
#: of it, so some 16,000 messages can wait for a disposer that is slow or
#: stuck, in flight, in no descriptor table.
CHANNEL_BUFFER = 16 * 1024 * 1024

#: C{SO_SNDBUFFORCE} (C{asm-generic/socket.h}): past C{net.core.wmem_max},
#: for a process with C{CAP_NET_ADMIN}.
_SO_SNDBUFFORCE = 32

_SOURCE = Path(disposer.__file__).read_text()


def spawn_disposer(channel: int, progress: int) -> subprocess.Popen[bytes]:
    """
    Start a disposer on C{channel} (its end of the stream it is sent
    connections on) and C{progress} (its end of the pair it reports on): a
    fresh interpreter, isolated (C{-I}: no environment variables, no user
    site, no current directory on the path) and without C{site} (C{-S}),
    running L{hostpid.broker.disposer}'s source.  Nothing of the broker's
    is inherited but those two.
    """
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _SOURCE, str(channel), str(progress),
         str(os.getpid())],
        pass_fds=(channel, progress),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def _channel_pair() -> tuple[socket.socket, socket.socket]:
    """
    The stream the broker sends connections on.  A stream, because a Unix
    datagram or seqpacket peer takes at most C{net.unix.max_dgram_qlen}
    (10) messages: a stream takes as many as the sender's buffer holds, and
    the broker, as root, makes that L{CHANNEL_BUFFER} (C{SO_SNDBUFFORCE}).
    Connections in flight there are in no process's descriptor table: a
    disposer stuck at the bound on abandoned ones still parks them for the
    broker, whose own table stays small.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for option in (_SO_SNDBUFFORCE, socket.SO_SNDBUF):
        try:
            ours.setsockopt(socket.SOL_SOCKET, option, CHANNEL_BUFFER)
            break
        except OSError:
            continue
    return ours, theirs


class Disposer:
    """One disposer process, as the broker sees it."""

    def __init__(
        self, process: subprocess.Popen[bytes], channel: socket.socket,
        progress: socket.socket,
    ) -> None:
        self.process = process
        self.channel = channel
        self.progressChannel = progress
        #: Descriptors sent, and the disposer's running totals as last read.
        self.sent = 0
        self.closed = 0
        self.drained = 0
        self.interrupted = 0
        #: L{closed} plus L{interrupted} at the last stuck check, and
        #: whether a check has looked at it since it said it runs (its stuck
        #: clock starts at that look).
        self.checked = 0
        self.watched = False
        #: Whether its end of the pair was found closed (it exited).
        self.ended = False
        #: Whether it is kept although stuck (the bound on abandoned ones).
        self.kept = False
        #: Whether it has reported once (it does as soon as it runs), and
        #: when it was started (the reactor's clock).
        self.ready = False
        self.startedAt = 0.0
        #: The reactor's reader of its reports, while one is added.
        self.reader: _ProgressReader | None = None

    @property
    def owed(self) -> int:
        """Descriptors sent and not yet reported closed."""
        return self.sent - self.closed

    def readProgress(self) -> bool:
        """Read every progress report waiting; whether any was."""
        latest = None
        while True:
            try:
                report = self.progressChannel.recv(disposer.PROGRESS.size, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.ended = True
                break
            if not report:
                self.ended = True
                break
            if len(report) == disposer.PROGRESS.size:
                latest = report
        if latest is None:
            return False
        # Its first report, sent as it starts, says it is ready.
        self.ready = True
        self.closed, self.drained, self.interrupted = disposer.PROGRESS.unpack(latest)
        return True

    def fileno(self) -> int:
        return self.progressChannel.fileno()

    def close(self, guard: CloseGuard) -> None:
        """Close both channels, watched by the closing thread's C{guard}."""
        close_watched(guard, self.channel, self.progressChannel)


class BackgroundCloser:
    """
    Takes descriptors the broker must not close itself and has a disposer
    process close them (see the module).

    @ivar held: descriptors waiting in the broker for a disposer (none while
        one takes them).
    @ivar pending: descriptors submitted and not yet reported closed (held,
        in flight, or with a disposer).
    @ivar closed: descriptors a disposer reported closed, or that went with
        an abandoned one.
    @ivar abandoned: disposers killed because they were stuck; those still
        alive count toward L{MAX_ABANDONED}.
    """

    log = Logger()

    def __init__(
        self,
        limit: int = CLOSER_QUEUE,
        watch: CloseWatch | None = None,
        reactor: Any = None,
        stuckAfter: float = STUCK_AFTER,
        maxAbandoned: int = MAX_ABANDONED,
        spawn: Callable[[int, int], subprocess.Popen[bytes]] = spawn_disposer,
    ) -> None:
        self.limit = limit
        self.stuckAfter = stuckAfter
        self.maxAbandoned = maxAbandoned
        if watch is None:
            # The process's watchdog, installed here (the broker builds its
            # closer in the reactor's thread, the main one): it bounds the
            # reactor thread's own closes (see L{hostpid.broker.closewatch}).
            watch = default_watch()
            watch.install()
        self._watch = watch
        #: The hand-off's closes, in the reactor thread: never a last
        #: reference while the disposer lives, but watched all the same.
        self._guard = watch.guard("the reactor thread")
        self._reactor = reactor
        self._spawn = spawn
        self._disposer: Disposer | None = None
        self._reading = False
        self._check: Any = None
        self.held: collections.deque[int] = collections.deque()
        self.pending = 0
        self._closed = 0
        self.started = 0
        self.spawnFailures = 0
        self.abandoned: list[Disposer] = []
        #: Progress of disposers no longer in use, added to the live one's.
        self._retiredDrained = 0
        self._retiredInterrupted = 0

    # The counters the broker's metrics and readiness read.

    @property
    def saturated(self) -> bool:
        return self.pending >= self.limit

    @property
    def closed(self) -> int:
        """
        Descriptors a disposer reported closed, or that went with an
        abandoned one: its reports read first (the reactor reads them as
        they come; this serves callers without a running reactor).
        """
        self.progress()
        return self._closed

    @property
    def room(self) -> int:
        """Descriptors the closer can still take within its bound."""
        return self.limit - self.pending

    @property
    def watch(self) -> CloseWatch:
        """The watchdog that bounds the reactor thread's own closes."""
        return self._watch

    @property
    def interruptible(self) -> bool:
        """Whether the reactor thread's own closes can be interrupted."""
        return self._watch.active

    @property
    def drained(self) -> int:
        """Connections whose queue held passed descriptors, read out by disposers."""
        live = self._disposer.drained if self._disposer is not None else 0
        return self._retiredDrained + live

    @property
    def interrupted(self) -> int:
        """Closes cut short: by a disposer's timer, or by the watchdog."""
        live = self._disposer.interrupted if self._disposer is not None else 0
        return self._retiredInterrupted + live + self._watch.interrupted

    @property
    def stuck(self) -> int:
        """Abandoned disposers still alive, and reactor closes stuck."""
        return self.stuckDisposers + self._watch.stuck

    @property
    def stuckDisposers(self) -> int:
        self._reap()
        return len(self.abandoned)

    @property
    def disposerReady(self) -> bool:
        """Whether the disposer in use has started and reported (its reports read now)."""
        self.progress()
        return self._disposer is not None and self._disposer.ready

    @property
    def disposerPid(self) -> int | None:
        """The disposer in use, if one is running."""
        return self._disposer.process.pid if self._disposer is not None else None

    # Taking descriptors.

    def submit(self, fd: int) -> None:
        """Take C{fd}: it will be closed by a disposer, never here."""
        self.pending += 1
        self.held.append(fd)
        self._send()

    def _send(self) -> None:
        while self.held:
            current = self._disposer or self._start()
            if current is None:
                return
            count = min(len(self.held), _BATCH)
            batch = [self.held[i] for i in range(count)]
            try:
                current.channel.sendmsg(
                    [b"D"],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", batch))],
                    socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL,
                )
            except (BlockingIOError, InterruptedError):
                # Its queue is full: the rest waits for its progress.
                self._armCheck()
                return
            except OSError as e:
                self._abandon(current, f"cannot pass descriptors to it ({e.strerror})")
                continue
            guard = self._guard
            guard.closes += 1
            guard.busy = True
            for _ in range(count):
                # Not the last reference: the message in flight holds one.
                os.close(self.held.popleft())
            guard.busy = False
            current.sent += count
            self._armCheck()

    def _start(self) -> Disposer | None:
        """
        A fresh disposer, or C{None} if it cannot start.  (No bound to check
        here: one is abandoned only while fewer than L{maxAbandoned} are
        alive, so at most that many and this one are.)
        """
        ours, theirs = _channel_pair()
        reports, reporter = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                process = self._spawn(theirs.fileno(), reporter.fileno())
            finally:
                close_watched(self._guard, theirs, reporter)
        except OSError as e:
            close_watched(self._guard, ours, reports)
            self.spawnFailures += 1
            if self.spawnFailures & (self.spawnFailures - 1) == 0:
                self.log.warn(
                    "hostpid-broker: cannot start a disposer for passed descriptors ({error}); "
                    "{held} wait in the broker (failures so far: {count})",
                    error=e, held=len(self.held), count=self.spawnFailures,
                )
            self._armCheck()
            return None
        ours.setblocking(False)
        reports.setblocking(False)
        self._disposer = Disposer(process, ours, reports)
        self._disposer.startedAt = self._reactorOrNone().seconds()
        self.started += 1
        self._startReading()
        return self._disposer

    # Progress, and abandoning a disposer that makes none.

    def _startReading(self) -> None:
        current = self._disposer
        if current is not None:
            current.reader = _ProgressReader(self, current)
            self._reactorOrNone().addReader(current.reader)

    def _stopReading(self, which: Disposer) -> None:
        if which.reader is not None:
            self._reactorOrNone().removeReader(which.reader)
            which.reader = None

    def _reactorOrNone(self) -> Any:
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor
        return self._reactor

    def progress(self, which: Disposer | None = None) -> None:
        """Read the disposer's progress now (the reactor does, as it comes)."""
        current = which or self._disposer
        if current is None or current is not self._disposer:
            return
        before = current.closed
        if not current.readProgress():
            return
        done = current.closed - before
        self.pending -= done
        previous, self._closed = self._closed, self._closed + done
        if previous.bit_length() != self._closed.bit_length():
            # Said at powers of two: a flood of them writes a few lines.
            self.log.info(
                "hostpid-broker: {count} passed descriptors closed by the disposer so far "
                "({drained} drained, {interrupted} interrupted)",
                count=self._closed, drained=self.drained, interrupted=self.interrupted,
            )
        if self.held:
            self._send()

    def _armCheck(self) -> None:
        if self._check is not None and self._check.active():
            return
        reactor = self._reactorOrNone()
        self._check = reactor.callLater(self.stuckAfter, self.checkStuck)

    def checkStuck(self) -> None:
        """
        Every L{STUCK_AFTER} while anything is owed: a disposer that closed
        and interrupted nothing since the last look is abandoned (the first
        look after it says it runs only starts its clock); descriptors held
        in the broker are offered again (to a fresh disposer, if one may
        start).
        """
        self._check = None
        current = self._disposer
        if current is not None:
            self.progress(current)
            if not current.ready:
                # A fresh interpreter on a loaded node (or under emulation)
                # may take longer than STUCK_AFTER to start: it is judged by
                # its progress only once it runs, and abandoned only if it
                # never does.
                if self._reactorOrNone().seconds() - current.startedAt >= STARTUP_TIMEOUT:
                    self._abandon(current, f"it did not start within {STARTUP_TIMEOUT:.0f}s")
            elif not current.watched:
                # Its first report may have come just before this check: it
                # has had no time to drain or interrupt anything yet, so its
                # clock starts here, a full stuckAfter of running before it
                # is judged.
                current.watched = True
                current.checked = current.closed + current.interrupted
            elif current.owed and current.closed + current.interrupted == current.checked:
                if self.stuckDisposers < self.maxAbandoned:
                    self._abandon(
                        current,
                        f"no connection drained in {self.stuckAfter:.1f}s (a wait that "
                        "ignores signals)",
                    )
                elif not current.kept:
                    # No fresh one may start: keep this one, whose stream
                    # goes on parking connections in flight for the broker.
                    current.kept = True
                    self.log.warn(
                        "hostpid-broker: disposer {pid} is stuck too and {most} abandoned "
                        "disposers are alive: connections carrying descriptors wait in flight "
                        "to it ({owed} so far)",
                        pid=current.process.pid, most=self.maxAbandoned, owed=current.owed,
                    )
            else:
                # Progress is a connection drained or a wait interrupted: a
                # disposer cutting one lingering close after another (slow
                # under emulation) is working; one in a wait that ignores
                # signals reports neither.
                current.checked = current.closed + current.interrupted
        if self.held:
            self._send()
        if self.held or (self._disposer is not None and self._disposer.owed):
            self._armCheck()

    def _abandon(self, which: Disposer, why: str) -> None:
        """Kill C{which}, count what it owed as gone with it, carry on without it."""
        if which is self._disposer:
            self._disposer = None
        self._stopReading(which)
        which.readProgress()
        owed = which.owed
        self.pending -= owed
        self._closed += owed
        self._retiredDrained += which.drained
        self._retiredInterrupted += which.interrupted
        try:
            which.process.send_signal(signal.SIGKILL)
        except OSError:
            pass
        which.close(self._guard)
        self.abandoned.append(which)
        self.log.warn(
            "hostpid-broker: disposer {pid} abandoned: {why}; {owed} descriptors went with it "
            "({alive} abandoned disposers alive, at most {most})",
            pid=which.process.pid, why=why, owed=owed,
            alive=self.stuckDisposers, most=self.maxAbandoned,
        )

    def _reap(self) -> None:
        self.abandoned = [d for d in self.abandoned if d.process.poll() is None]

    def stop(self) -> None:
        """
        The broker is stopping: the disposer finishes what it holds and ends
        at end of file (it dies with the broker in any case).
        """
        if self._check is not None and self._check.active():
            self._check.cancel()
        self._check = None
        current, self._disposer = self._disposer, None
        if current is not None:
            self._stopReading(current)
            current.close(self._guard)
            self._retiredDrained += current.drained
            self._retiredInterrupted += current.interrupted
        self._watch.forget(self._guard)


class _ProgressReader:
    """The reactor's reader of one disposer's progress reports."""

    def __init__(self, closer: BackgroundCloser, which: Disposer) -> None:
        self.closer = closer
        self.disposer = which

    def fileno(self) -> int:
        return self.disposer.fileno()

    def logPrefix(self) -> str:
        return "hostpid-disposer"

    def doRead(self) -> None:
        if self.disposer is not self.closer._disposer:
            return
        self.closer.progress(self.disposer)
        if self.disposer.ended:
            self.closer._abandon(self.disposer, "it exited")

    def connectionLost(self, reason: object) -> None:
        pass
