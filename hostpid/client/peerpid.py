"""
Is the listener the client connected to where the broker is?

The broker runs in the host PID namespace.  C{SO_PEERCRED} translates the
listener's PID into the caller's PID namespace, so what the kernel reports
is fixed by where the caller is:

  - in a private PID namespace (an ordinary container, and every gVisor
    sandbox): the broker is outside and shows as PID 0.  Any other PID is
    refused.  The caller's own PID (or one of its threads') is what gVisor
    answers for a host-connected socket, whose sentry echoes the connecting
    task's own credentials while the broker, on the host, sees the
    sandbox's gofer; any other non-zero PID is a listener inside the
    caller's own container (or sandbox), not the host's broker whatever it
    answers.
  - in the host PID namespace (the host, a C{hostPID} pod, the broker's
    own container): the broker shows as its own non-zero PID.  It may be
    the caller itself there, but only as a broker embedded in the caller's
    own process (C{docs/examples/broker-with-web.tac}), which answers from
    the kernel's C{SO_PEERCRED} like any other.
  - where the namespace cannot be told: only PID 0 (outside) passes.

The initial PID namespace is recognised by its fixed nsfs inode
(C{PROC_PID_INIT_INO}), as the broker recognises it; gVisor's sentry
numbers its namespaces itself and never reports that inode.
"""

from __future__ import annotations

import os

from hostpid.values import Value

#: C{PROC_PID_INIT_INO} (include/linux/proc_ns.h): the initial PID namespace.
PROC_PID_INIT_INO = 0xEFFFFFFC
PID_NAMESPACE_PATH = "/proc/self/ns/pid"
TASKS_PATH = "/proc/self/task"


class CallerProcess(Value):
    """
    The calling process as the kernel sees it.

    @ivar pid: C{getpid()}.
    @ivar pid_namespace: the nsfs inode of its PID namespace, or the error
        that kept it from being read.
    @ivar threads: the thread IDs of this process, or C{None}: ask
        C{/proc/self/task} about one PID when it matters (a non-zero PID
        other than C{pid} seen from a private PID namespace, which is refused
        anyway: the question only picks the words).
    """

    __slots__ = ("pid", "pid_namespace", "threads")
    #: An error is not a value: the namespace takes no part in equality.
    _compared = ("pid", "threads")
    pid: int
    pid_namespace: int | OSError
    threads: frozenset[int] | None

    def __init__(
        self, pid: int, pid_namespace: int | OSError, threads: frozenset[int] | None = None
    ) -> None:
        self._set(pid=pid, pid_namespace=pid_namespace, threads=threads)

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
    "sandboxed runtime: outside the host PID namespace the broker shows as pid 0, but "
    "gVisor answers SO_PEERCRED on a host socket with the caller's own credentials, while "
    "the broker sees the sandbox's gofer"
)


def peer_pid_problem(pid: int, caller: CallerProcess) -> str | None:
    """Why a listener reported as C{pid} is not the host's broker, or C{None}."""
    if pid < 0:
        return f"pid {pid} is not a PID"
    host = caller.in_host_pid_namespace
    if host:
        if pid == 0:
            return (
                "pid 0 in the host PID namespace, where every process has a PID: "
                "no listener named"
            )
        return None
    if pid == 0:
        return None
    if pid == caller.pid:
        return f"pid {pid} is this process itself: {_SANDBOXED}"
    if caller.has_thread(pid):
        return f"pid {pid} is a thread of this process (pid {caller.pid}): {_SANDBOXED}"
    if host is None:
        error = caller.pid_namespace
        assert isinstance(error, OSError)
        return (
            f"pid {pid}: cannot tell whether the listener is outside this PID namespace "
            f"({PID_NAMESPACE_PATH}: {error.strerror}); mount /proc"
        )
    return (
        f"pid {pid} is inside this process's PID namespace "
        f"pid:[{caller.pid_namespace}]: the listener runs in this container (or sandbox), "
        "not in the host PID namespace, where the broker runs and shows here as pid 0"
    )


def describe(pid: int, caller: CallerProcess) -> str:
    """What a passing C{pid} means, for an C{ok} line."""
    if pid == 0:
        return "pid 0: outside this PID namespace (the host's)"
    if pid == caller.pid:  # the kernel reports a thread group's PID, never a thread's
        return f"pid {pid}: this process, in the host PID namespace (a broker embedded in it)"
    return f"pid {pid}: another process of the host PID namespace (this one is {caller.pid})"
