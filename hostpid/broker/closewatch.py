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
L{CloseWatch.install} (in the main thread) installs one, and the watchdog
never signals unless that handler is still in place.  Python runs the
handler in the main thread only; any other thread just returns from the
interrupted call, and the main thread's reactor wakes once and goes on.

The watchdog thread holds no descriptor: it starts by giving itself a
descriptor table of its own with only 0-2 in it (L{own_descriptor_table}).
While a second thread shares the process's table, the kernel takes and
drops a reference on the file for every system call on a descriptor, in
every thread; with the watchdog (the broker's only other thread while no
client passes a descriptor) on a table of its own, the reactor thread's
calls take the single-threaded path again, about 1.5 us less per
transaction in mode I{received} (CHANGELOG.md, performance history).  So the watchdog
makes no call that needs a descriptor: what it has to say (a log line, a
stuck close for its owner) waits in its outbox, and the main thread, woken
by the same signal, hands it to the reactor (L{CloseWatch.flush}).  It also
blocks every signal, so that none meant for the process (C{SIGTERM}) is
handled in a thread that cannot write to Python's wake-up descriptor.

Cost on the hot path: a guarded close is two attribute stores and an
increment (L{CloseGuard.closes}, L{CloseGuard.busy}); no clock read, no lock.
"""

from __future__ import annotations

import collections
import ctypes
import os
import platform
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from twisted.logger import Logger
from twisted.python.failure import Failure

#: A real-time signal nobody else in the broker uses.  Real-time signals
#: queue (one per send) and have no meaning to Python, Twisted or glibc.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 4

#: How often the watchdog looks while some close is in progress, and while
#: none is.  A close is interrupted once seen in progress on two
#: consecutive looks, so it holds its thread at most about 2 * POLL_BUSY
#: (POLL_IDLE + POLL_BUSY for the first close after a quiet spell).
POLL_BUSY = 0.02
POLL_IDLE = 0.1

#: A close still running this long, despite interrupts, ignores signals:
#: reported as stuck.
STUCK_AFTER = 2.0

#: Signals sent into one close at most.  A real-time signal queues one
#: entry per send, charged to the sender's UID's C{RLIMIT_SIGPENDING}, which
#: every process of that UID on the node shares (for the broker, UID 0: the
#: kubelet, the container runtime, every root container).  A close that
#: outlasts this many interrupts ignores them; more would only fill that
#: queue, for as long as the close lasted.
INTERRUPTS_PER_CLOSE = 3


#: C{close_range(2)} (Linux 5.9): its number where the broker runs (x86-64,
#: and arm64's generic table) and its flag C{CLOSE_RANGE_UNSHARE}.
_SYS_CLOSE_RANGE = {"x86_64": 436, "aarch64": 436}.get(platform.machine())
_CLOSE_RANGE_UNSHARE = 2

#: What the watchdog's outbox keeps at most (it keeps the newest): log
#: lines are few (counts at powers of two) and stuck closes at most one per
#: thread, so this is reached only when nothing drains it (no main thread
#: running Python).
OUTBOX_SIZE = 256

#: Watches whose outbox the handler drains (L{CloseWatch.install}).
_installed: list[CloseWatch] = []


def own_descriptor_table() -> str | None:
    """
    Give the calling thread a descriptor table of its own, with copies of
    descriptors 0-2 only: C{close_range(3, ~0U, CLOSE_RANGE_UNSHARE)}.

    The kernel copies none of the descriptors it is asked to close into
    the new table (C{__close_range}: before Linux 6.11 a range past the
    table's end copies only those beneath it; from 6.11 C{dup_fd} copies
    all but the range), so no descriptor from 3 up gains a reference here:
    none can have its last reference dropped by this thread, and none is
    kept open by it after its owner closes it.

    @return: C{None}, or why the thread still shares the process's table.
    """
    if _SYS_CLOSE_RANGE is None:
        return f"no close_range(2) number known for {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(
        ctypes.c_long(_SYS_CLOSE_RANGE), ctypes.c_uint(3), ctypes.c_uint(0xFFFFFFFF),
        ctypes.c_uint(_CLOSE_RANGE_UNSHARE),
    ) != 0:
        return f"close_range(CLOSE_RANGE_UNSHARE): {os.strerror(ctypes.get_errno())}"
    return None


def _interrupted(signum: int, frame: object) -> None:
    """
    The handler, run by Python in the main thread: a close interrupted in
    any thread, or the watchdog waking the main thread to take what its
    outbox holds.  Cheap when the outboxes are empty, as they nearly always
    are.
    """
    for watch in _installed:
        if watch.outbox:
            watch.handOver()


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


class Closable(Protocol):
    def close(self) -> None: ...


def close_watched(guard: CloseGuard, *closables: Closable) -> None:
    """
    Close each of C{closables} in the calling thread (C{guard}'s), watched:
    each counts as a close of its own, interrupted if it lasts.  For every
    Unix socket a broker thread closes, not only connections: on kernels
    before 6.10 I{any} Unix socket's release may run the collector of
    in-flight garbage (C{unix_release_sock} calls C{unix_gc} whenever
    descriptors are in flight anywhere), which frees whatever a tenant left
    in flight, a lingering TCP socket included, in the closing thread.
    """
    for closable in closables:
        guard.closes += 1
        guard.busy = True
        try:
            closable.close()
        finally:
            guard.busy = False


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
        #: Whether someone replaced the handler after L{install} (said once).
        self.handlerLost = False
        self.active = False
        self.reason = "not installed"
        #: Why the watchdog thread still shares the process's descriptor
        #: table (L{own_descriptor_table}), or C{None} once it does not.
        self.sharedTable: str | None = "not started"
        #: What the watchdog thread has to say, for the main thread to do
        #: (L{flush}): log lines, and stuck guards' L{CloseGuard.onStuck}.
        self.outbox: collections.deque[Callable[[], object]] = collections.deque(
            maxlen=OUTBOX_SIZE
        )
        self._guards: list[CloseGuard] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: Set once the watchdog thread has tried L{own_descriptor_table}.
        self._started = threading.Event()
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
        if self not in _installed:
            _installed.append(self)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watchdog, name="hostpid-closewatch", daemon=True
                )
                self._thread.start()
        # So that the broker's start-up lines can say how the thread runs.
        self._started.wait(1.0)
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

    def checkHandler(self) -> bool:
        """
        In the main thread, now and then: whether the handler L{install}
        put in place is still there.  An embedding application that installs
        its own handler for L{signum} takes the close bound away (the
        watchdog then never signals, since the signal's default action or
        someone else's handler could do anything): said once, as an error,
        and L{active} becomes false, which readiness and the metrics show.

        @return: whether closes can still be interrupted.
        """
        if not self.active:
            return False
        if signal.getsignal(self.signum) is _interrupted:
            return True
        self.active = False
        self.handlerLost = True
        self.reason = f"the handler of signal {int(self.signum)} was replaced after start"
        self.log.error(
            "hostpid-broker: {reason}: closes in this process are no longer bounded; "
            "leave signal {signum} to the broker",
            reason=self.reason, signum=int(self.signum),
        )
        return False

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
            if guard.looks - 1 <= INTERRUPTS_PER_CLOSE:
                self._interrupt(guard)
            if not guard.stuck and (guard.looks - 1) * self.pollBusy >= self.stuckAfter:
                guard.stuck = True
                self._emit(
                    "hostpid-broker: {thread} has been in one close for {seconds:.1f}s despite "
                    "interrupts (a descriptor whose close ignores signals)",
                    thread=guard.name, seconds=(guard.looks - 1) * self.pollBusy,
                )
                if guard.onStuck is not None:
                    self._later(guard.onStuck, guard)
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
        """A warning, written from the reactor's thread (see L{_later})."""
        self._later(self.log.warn, format, **fields)

    def _later(self, call: Callable[..., object], *args: object, **kwargs: object) -> None:
        """
        Have C{call} made in the reactor's thread.  From the main thread (a
        test driving L{look}) it is handed over at once; from the watchdog,
        which holds no descriptor, it waits in the L{outbox} and the main
        thread is woken by this watch's signal to hand it over.
        """
        self.outbox.append(lambda: call(*args, **kwargs))
        if threading.current_thread() is threading.main_thread():
            self.handOver()
        elif self.active and signal.getsignal(self.signum) is _interrupted:
            try:
                signal.pthread_kill(threading.main_thread().ident or 0, self.signum)
            except (ProcessLookupError, OSError):
                pass

    def handOver(self) -> None:
        """
        In the main thread: have the reactor's thread L{flush} the outbox, or
        flush it here if the reactor takes no calls from threads (a test's
        memory reactor, a reactor being torn down).
        """
        callFromThread = getattr(self._reactor, "callFromThread", None)
        if callFromThread is not None:
            try:
                callFromThread(self.flush)
                return
            except Exception:
                pass
        self.flush()

    def flush(self) -> None:
        """Make the calls the outbox holds, oldest first."""
        # Only the main thread takes from the outbox: it cannot run dry here.
        while self.outbox:
            call = self.outbox.popleft()
            try:
                call()
            except Exception:
                self.log.failure("hostpid-broker: the close watchdog's report failed")

    def _watchdog(self) -> None:
        """
        The watchdog thread: block every signal (one meant for the process
        must not be handled here, where Python's wake-up descriptor is not),
        take a descriptor table of its own (L{own_descriptor_table}), then
        loop.
        """
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            self.sharedTable = own_descriptor_table()
        except Exception as e:  # noqa: BLE001 - reported, and the watch goes on
            self.sharedTable = f"close_range(CLOSE_RANGE_UNSHARE): {e}"
        self._started.set()
        self._run()

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
                self._later(
                    self.log.failure,
                    "hostpid-broker: the close watchdog's look failed; looking on",
                    Failure(),
                )
                busy = True
            delay = self.pollBusy if busy else self.pollIdle


_default: CloseWatch | None = None


def default_watch() -> CloseWatch:
    """The process's one watchdog (created, not installed, on first use)."""
    global _default
    if _default is None:
        _default = CloseWatch()
    return _default
