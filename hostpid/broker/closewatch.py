"""
A bound on how long any close can hold a broker thread.

Closing a descriptor can block in the kernel for as long as whoever made it
likes.  The case that matters is a TCP socket with C{SO_LINGER {1, N}} and a
send queue its peer never reads: its last close waits in
C{sk_stream_wait_close} for up to N seconds (N up to 2**31-1).  A tenant can
hide one anywhere a close will reach it: passed directly, in the receive
queue of a passed Unix socket (closing the outer socket purges its queue in
the closing thread), one level deeper still, or in I{in-flight garbage} (a
Unix socket that carries itself), which on kernels before 6.10 the garbage
collector frees in whichever thread next closes I{any} Unix socket: possibly
the reactor's.

That wait is interruptible: it ends as soon as a signal is pending for the
waiting thread, and every nested close run in the same return to user
space sees the same pending signal and does not wait either.  So
L{CloseWatch} runs one watchdog thread that looks at every registered
L{CloseGuard} each L{POLL_BUSY} seconds (L{POLL_IDLE} while no close is in
progress), and sends L{INTERRUPT_SIGNAL} (with C{pthread_kill}) to a thread
it finds inside the I{same} close two looks in a row.  A close therefore
holds a thread for at most about two polls, whatever it carries.  Waits
that ignore signals (a hostile FUSE server's flush, a hard NFS mount) are
not ended by this: a guard still in one close after L{STUCK_AFTER} seconds
is reported (L{CloseWatch.stuck}, a log line, a metric) and its owner is
told, so the background closer can carry on with a fresh thread.

The signal needs a handler, or its default action would end the process:
L{CloseWatch.install} (in the main thread) installs a no-op one, and the
watchdog never signals unless that handler is still in place.  Python runs
the handler in the main thread only; any other thread just returns from the
interrupted call, and the main thread's reactor wakes once and goes on.

Cost on the hot path: a guarded close is two attribute stores and an
increment (L{CloseGuard.closes}, L{CloseGuard.busy}); no clock read, no lock.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger

#: A real-time signal nobody else in the broker uses.  Real-time signals
#: queue (one per send) and have no meaning to Python, Twisted or glibc.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 4

#: How often the watchdog looks while some close is in progress, and while
#: none is.  A close is interrupted once seen in progress on two
#: consecutive looks, so it holds its thread at most about 2 * POLL_BUSY
#: (POLL_IDLE + POLL_BUSY for the first close after a quiet spell).
POLL_BUSY = 0.02
POLL_IDLE = 0.1

#: A close still running this long, despite interrupts every poll, ignores
#: signals: reported as stuck.
STUCK_AFTER = 2.0


def _interrupted(signum: int, frame: object) -> None:
    """The handler: its being there is all that matters."""


class CloseGuard:
    """
    One thread's closes, as the watchdog sees them.  The thread increments
    L{closes} and sets L{busy} before a close, and clears L{busy} after.

    @ivar onStuck: called (from the watchdog thread) once per close found
        stuck past L{STUCK_AFTER}.
    """

    __slots__ = ("name", "ident", "closes", "busy", "seen", "looks", "stuck", "onStuck")

    def __init__(
        self, name: str, ident: int, onStuck: Callable[[CloseGuard], None] | None = None
    ) -> None:
        self.name = name
        self.ident = ident
        self.closes = 0
        self.busy = False
        #: The watchdog's own bookkeeping: L{closes} at its last look, and
        #: how many looks in a row found that same close in progress.
        self.seen = -1
        self.looks = 0
        self.stuck = False
        self.onStuck = onStuck


class CloseWatch:
    """
    The watchdog: one daemon thread for every guard in the process.

    @ivar interrupted: signals sent to a thread found inside one close.
    @ivar active: whether closes can be interrupted here (the handler is
        installed); when not, L{reason} says why.
    """

    log = Logger()

    def __init__(
        self,
        signum: int = INTERRUPT_SIGNAL,
        pollBusy: float = POLL_BUSY,
        pollIdle: float = POLL_IDLE,
        stuckAfter: float = STUCK_AFTER,
    ) -> None:
        self.signum = signum
        self.pollBusy = pollBusy
        self.pollIdle = pollIdle
        self.stuckAfter = stuckAfter
        self.interrupted = 0
        self.active = False
        self.reason = "not installed"
        self._guards: list[CloseGuard] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._reactor: Any = None

    def install(self, reactor: Any = None) -> bool:
        """
        Install the no-op handler (main thread only) and start the watchdog.
        Idempotent.  C{reactor}, if given, is where log lines are emitted
        from (C{callFromThread}); otherwise they are emitted in the watchdog.

        @return: whether closes can be interrupted.
        """
        if reactor is not None:
            self._reactor = reactor
        if self.active:
            return True
        current = signal.getsignal(self.signum)
        if current not in (signal.SIG_DFL, _interrupted):
            # Someone else's handler: still interrupts, but would be run
            # spuriously; leave it alone and do without.
            self.reason = f"signal {self.signum} already has a handler"
            return False
        try:
            signal.signal(self.signum, _interrupted)
        except ValueError:
            self.reason = "not installed from the main thread"
            return False
        signal.siginterrupt(self.signum, True)
        self.active = True
        self.reason = ""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hostpid-closewatch", daemon=True
                )
                self._thread.start()
        return True

    def guard(
        self, name: str, onStuck: Callable[[CloseGuard], None] | None = None
    ) -> CloseGuard:
        """A guard for the calling thread, watched from now on."""
        guard = CloseGuard(name, threading.get_ident(), onStuck)
        with self._lock:
            self._guards.append(guard)
        return guard

    def forget(self, guard: CloseGuard) -> None:
        with self._lock:
            if guard in self._guards:
                self._guards.remove(guard)

    @property
    def stuck(self) -> int:
        """Guards inside a close that ignored interrupts for L{STUCK_AFTER}."""
        return sum(1 for guard in list(self._guards) if guard.stuck)

    def look(self) -> bool:
        """
        One look at every guard (the watchdog's loop body; public so tests
        can drive it step by step).  @return: whether any close is in progress.
        """
        with self._lock:
            guards = list(self._guards)
        anyBusy = False
        for guard in guards:
            closes = guard.closes
            if not guard.busy:
                guard.seen, guard.looks, guard.stuck = closes, 0, False
                continue
            anyBusy = True
            if closes != guard.seen:
                guard.seen, guard.looks, guard.stuck = closes, 1, False
                continue
            guard.looks += 1
            self._interrupt(guard)
            if not guard.stuck and (guard.looks - 1) * self.pollBusy >= self.stuckAfter:
                guard.stuck = True
                self._emit(
                    "hostpid-broker: {thread} has been in one close for {seconds:.1f}s despite "
                    "interrupts (a descriptor whose close ignores signals)",
                    thread=guard.name, seconds=(guard.looks - 1) * self.pollBusy,
                )
                if guard.onStuck is not None:
                    guard.onStuck(guard)
        return anyBusy

    def _interrupt(self, guard: CloseGuard) -> None:
        if not self.active or signal.getsignal(self.signum) is not _interrupted:
            return
        try:
            signal.pthread_kill(guard.ident, self.signum)
        except (ProcessLookupError, OSError):
            return
        self.interrupted += 1
        count = self.interrupted
        if count & (count - 1) == 0:
            self._emit(
                "hostpid-broker: {count} closes interrupted so far (a descriptor some client "
                "passed would have held {thread} in its close)",
                count=count, thread=guard.name,
            )

    def _emit(self, format: str, **fields: object) -> None:
        """Log from the reactor's thread if there is one that takes calls, else here."""
        callFromThread = getattr(self._reactor, "callFromThread", None)
        if callFromThread is None:
            self.log.warn(format, **fields)
            return
        try:
            callFromThread(self.log.warn, format, **fields)
        except Exception:
            self.log.warn(format, **fields)

    def _run(self) -> None:
        """
        The watchdog's loop.  It must outlive anything a look runs into (a
        replacement thread that cannot start, a log observer that raises):
        a watchdog that died would leave every later close unbounded, and
        nothing would say so.
        """
        delay = self.pollIdle
        while True:
            time.sleep(delay)
            try:
                busy = self.look()
            except Exception:
                self.log.failure("hostpid-broker: the close watchdog's look failed; looking on")
                busy = True
            delay = self.pollBusy if busy else self.pollIdle


_default: CloseWatch | None = None


def default_watch() -> CloseWatch:
    """The process's one watchdog (created, not installed, on first use)."""
    global _default
    if _default is None:
        _default = CloseWatch()
    return _default
