"""
Is the listener the client connected to a process other than the client,
where the broker would be?

The real broker is never the calling process, and it runs in the host PID
namespace.  C{SO_PEERCRED} translates the listener's PID into the caller's
PID namespace, so what the kernel reports is fixed by where the two are:

  - the caller in a private PID namespace (an ordinary container): the
    broker is outside it and shows as PID 0;
  - the caller in the host PID namespace (the host, a C{hostPID} pod, the
    broker's own container): the broker shows as its own, non-zero PID, and
    it is not the caller.

Anything else is refused.  A PID equal to the caller's own (or one of its
threads') is what gVisor answers for a host-connected socket: its sentry
echoes the connecting task's own credentials, while the broker, on the
host, sees the sandbox's gofer.  A non-zero PID seen from a private PID
namespace is a listener inside the caller's own container (or sandbox),
which is not the host's broker whatever it answers.

The initial PID namespace is recognised by its fixed nsfs inode
(C{PROC_PID_INIT_INO}), as the broker recognises it.
"""

from __future__ import annotations

import os

import attrs

#: C{PROC_PID_INIT_INO} (include/linux/proc_ns.h): the initial PID namespace.
PROC_PID_INIT_INO = 0xEFFFFFFC
PID_NAMESPACE_PATH = "/proc/self/ns/pid"
TASKS_PATH = "/proc/self/task"


@attrs.frozen
class CallerProcess:
    """
    The calling process as the kernel sees it.

    @ivar pid: C{getpid()}.
    @ivar pid_namespace: the nsfs inode of its PID namespace, or the error
        that kept it from being read.
    @ivar threads: the thread IDs of this process, or C{None}: ask
        C{/proc/self/task} about one PID when it matters (a non-zero PID
        other than C{pid}), which costs one C{stat} and nothing at all in a
        container, where the broker shows as PID 0.
    """

    pid: int
    pid_namespace: int | OSError = attrs.field(eq=False)
    threads: frozenset[int] | None = None

    def has_thread(self, tid: int) -> bool:
        """Whether C{tid} is a thread of this process (C{pid} is)."""
        if tid == self.pid:
            return True
        if self.threads is not None:
            return tid in self.threads
        return tid > 0 and os.path.lexists(f"{TASKS_PATH}/{tid}")

    @property
    def in_host_pid_namespace(self) -> bool | None:
        """Whether this is the kernel's initial PID namespace; C{None}: unknown."""
        if isinstance(self.pid_namespace, OSError):
            return None
        return self.pid_namespace == PROC_PID_INIT_INO


def this_process() -> CallerProcess:
    """The caller's PID and PID namespace (one C{stat}); its threads when asked."""
    try:
        namespace: int | OSError = os.stat(PID_NAMESPACE_PATH).st_ino
    except OSError as error:
        namespace = error
    return CallerProcess(os.getpid(), namespace)


_SANDBOXED = (
    "sandboxed runtime: the kernel never reports the broker as the caller, but gVisor "
    "answers SO_PEERCRED on a host socket with the caller's own credentials, while the "
    "broker sees the sandbox's gofer"
)


def peer_pid_problem(pid: int, caller: CallerProcess) -> str | None:
    """Why a listener reported as C{pid} is not the host's broker, or C{None}."""
    if pid == caller.pid:
        return f"pid {pid} is this process itself: {_SANDBOXED}"
    if pid > 0 and caller.has_thread(pid):
        return f"pid {pid} is a thread of this process (pid {caller.pid}): {_SANDBOXED}"
    if pid < 0:
        return f"pid {pid} is not a PID"
    host = caller.in_host_pid_namespace
    if host is None:
        if pid == 0:
            return None
        error = caller.pid_namespace
        assert isinstance(error, OSError)
        return (
            f"pid {pid}: cannot tell whether the listener is outside this PID namespace "
            f"({PID_NAMESPACE_PATH}: {error.strerror}); mount /proc"
        )
    if host and pid == 0:
        return "pid 0 in the host PID namespace, where every process has a PID: no listener named"
    if not host and pid > 0:
        return (
            f"pid {pid} is inside this process's PID namespace "
            f"pid:[{caller.pid_namespace}]: the listener runs in this container (or sandbox), "
            "not in the host PID namespace, where the broker runs and shows here as pid 0"
        )
    return None


def describe(pid: int, caller: CallerProcess) -> str:
    """What a passing C{pid} means, for an C{ok} line."""
    if pid == 0:
        return "pid 0: outside this PID namespace (the host's)"
    return f"pid {pid}: another process of the host PID namespace (this one is {caller.pid})"
