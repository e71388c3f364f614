"""
When a process started, and when a connection was accepted, on one clock.

Where the kernel has no C{SO_PEERPIDFD} (before Linux 6.5), the broker can
only look a caller's PID up again (C{pidfd_open}) and must then rule out
that the PID has since been given to another process.  A process that
started after the broker accepted the connection cannot be the one that
connected: this module gives both times in the same unit.

The kernel records each task's start as C{CLOCK_BOOTTIME} nanoseconds
(C{task->start_boottime}, set in C{copy_process} before the new PID becomes
visible) and shows it in C{/proc/PID/stat}, field 22, truncated to clock
ticks (C{USER_HZ}, 100 a second on every Linux architecture this runs on) and
shifted by the reader's time namespace; C{clock_gettime(CLOCK_BOOTTIME)} is
shifted the same way.  Truncating both sides to ticks keeps the rule exact in
one direction: a process that started at or before the accept never has a
later tick than the accept.  In the other direction it costs a tick: a
process started within the same tick as the accept is not told apart.

Nothing here imports the rest of the project.
"""

from __future__ import annotations

import os
import time

#: Clock ticks a second, the unit of C{/proc/PID/stat}'s start time.
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
#: One clock tick, in nanoseconds.
TICK_NS = 1_000_000_000 // TICKS_PER_SECOND

_BOOTTIME = time.CLOCK_BOOTTIME
_clock_gettime_ns = time.clock_gettime_ns
#: C{/proc/PID/stat} after the C{comm} field's closing parenthesis: field 3
#: (C{state}) is the first, so field 22 (C{starttime}) is at index 19.
_STARTTIME_INDEX = 22 - 3


def boottime_ns() -> int:
    """Now, on C{CLOCK_BOOTTIME}: the clock the kernel stamps process starts with."""
    return _clock_gettime_ns(_BOOTTIME)


def start_ticks(pid: int) -> int:
    """
    When process C{pid} started, in clock ticks since boot, as
    C{/proc/PID/stat} says (three system calls: open, read, close).

    The command name (field 2) may hold spaces and parentheses; everything
    after its last C{")"} is fixed-format.

    @raise ProcessLookupError: no process C{pid} (any more).
    @raise OSError: C{/proc} cannot be read.
    """
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    try:
        # Fields up to starttime are well under 1 KiB even with a 64-byte
        # command name; os.read may return less only at end of file.
        data = os.read(fd, 1024)
    finally:
        os.close(fd)
    fields = data[data.rindex(b")") + 2:].split(b" ", _STARTTIME_INDEX + 1)
    return int(fields[_STARTTIME_INDEX])


def started_after(pid: int, accepted_ns: int) -> bool:
    """
    Whether process C{pid} started after C{accepted_ns} (a L{boottime_ns}
    reading), to the tick: C{True} only if its start tick is later than the
    tick C{accepted_ns} falls in, so never for a process that had started by
    then.

    @raise ProcessLookupError: no process C{pid} (any more).
    """
    return start_ticks(pid) > accepted_ns // TICK_NS


def proc_shows_own_namespace() -> bool:
    """
    Whether C{/proc} is mounted for this process's PID namespace, so that
    C{/proc/PID} names the process this process knows as C{PID}.  A process
    moved into a new PID namespace without a new C{/proc} mount (as by
    C{unshare --pid} without C{--mount-proc}) would read other processes'
    start times.
    """
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False
