"""
The client's trust policy: which checks decide whether a broker's answer can
be trusted, and the checks themselves, as plain functions over what the
kernel reports.  Both client transports (L{hostpid.client.blocking}, blocking, and
L{hostpid.client.txclient}, Twisted) apply exactly these.

The checks, in order, each failing under a stable name:

  1. C{gate}: C{LIBVGPU_HOSTPID_BROKER} is exactly C{"1"};
  2. C{sandbox}: no sign of a sandboxed runtime (gVisor's kernel, a 9p
     broker directory; L{hostpid.client.sandbox});
  3. C{directory}: the socket's directory is a real directory (not followed
     if it is a symlink), owned by the trusted UID, with no group or other
     write bit;
  4. C{socket}: the socket path is a socket (not followed if it is a symlink)
     owned by the trusted UID;
  5. C{read-only-mount}: the directory is on a read-only mount;
  6. C{peer-uid}: after connecting, the kernel's C{SO_PEERCRED} says the
     listener runs as the trusted UID (checked before a byte is sent);
  7. C{peer-pid}: the same C{SO_PEERCRED} names a listener where the broker
     is: PID 0 (outside) from a private PID namespace, where the caller
     itself is what gVisor reports; a real PID in the host's
     (L{hostpid.client.peerpid});
  8. C{reply}: magic C{HPID}, version 1, status 0, a PID in 1..2**31-1.

Two transport stages can also fail a query, and no caller can turn them off:
C{connect} (the kernel refused the connection) and C{deadline} (one monotonic
deadline over connect, write and read passed).  Nor can C{gate},
C{sandbox} and C{reply}.  C{peer-pid} can, by name, only because a test
double in the caller's own process or PID namespace
(L{hostpid.testing.FakeBroker} in a container) is exactly what it refuses:
turned off anywhere else, it lets gVisor hand a workload its gofer's PID
once the other checks pass.

The filesystem checks run on one C{O_PATH} descriptor of the directory, and
the connection goes through that descriptor (C{/proc/self/fd/N/broker.sock})
when procfs confirms it names the same directory, so the directory that was
checked is the directory that is connected to.
"""

from __future__ import annotations

import errno
import math
import os
import stat

from hostpid import gate, wire
from hostpid.client import peerpid, sandbox, userns
from hostpid.ucred import PeerCredentials
from hostpid.values import Value

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from hostpid.client.policy import STRICT as STRICT
    from hostpid.client.policy import TrustPolicy as TrustPolicy

GATE = "gate"
SANDBOX = "sandbox"
DIRECTORY = "directory"
SOCKET = "socket"
READ_ONLY_MOUNT = "read-only-mount"
CONNECT = "connect"
PEER_UID = "peer-uid"
PEER_PID = "peer-pid"
REPLY = "reply"
DEADLINE = "deadline"

#: The trust checks, in the order every client applies them.
CHECKS: tuple[str, ...] = (
    GATE, SANDBOX, DIRECTORY, SOCKET, READ_ONLY_MOUNT, PEER_UID, PEER_PID, REPLY
)

#: The checks a caller may turn off by name.  The gate is the operator's
#: switch, a detected sandbox is a place where no answer can be right, and
#: the reply is what makes an answer an answer: none of them can be turned
#: off, nor can the transport stages (C{connect}, C{deadline}).  C{peer-pid}
#: is here for test doubles only (see the module text); never on a node.
OPTIONAL_CHECKS: frozenset[str] = frozenset(
    {DIRECTORY, SOCKET, READ_ONLY_MOUNT, PEER_UID, PEER_PID}
)

#: What L{doctor} reports, one result each, in this order.
DOCTOR_CHECKS: tuple[str, ...] = (
    GATE, SANDBOX, DIRECTORY, SOCKET, READ_ONLY_MOUNT, CONNECT, PEER_UID, PEER_PID, REPLY
)

#: The longest C{sun_path} Linux accepts, terminating NUL excluded.
_SUN_PATH_MAX = 107



class HostPidUnavailable(Exception):
    """
    The broker's answer cannot be had or cannot be trusted.

    @ivar check: the name of the check or stage that failed (one of
        L{CHECKS}, L{CONNECT} or L{DEADLINE}).
    @ivar observed: what the client saw, for a log line or an operator.
    """

    def __init__(self, check: str, observed: str) -> None:
        super().__init__(check, observed)
        self.check = check
        self.observed = observed

    def __str__(self) -> str:
        return f"{self.check}: {self.observed}"


class CheckResult(Value):
    """One check's verdict: its C{name}, whether it passed, what was seen."""

    __slots__ = ("name", "ok", "observed")
    name: str
    ok: bool
    observed: str

    def __init__(self, name: str, ok: bool, observed: str) -> None:
        self._set(name=name, ok=ok, observed=observed)


def check_deadline(name: str, value: float) -> None:
    """
    @raise ValueError: C{value} is not a positive, finite number of seconds.
    """
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def require(result: CheckResult, turned_off: frozenset[str] = frozenset()) -> None:
    """
    Raise for C{result} if it failed and its check is not in C{turned_off}.

    @raise HostPidUnavailable: it did.
    """
    if not result.ok and result.name not in turned_off:
        raise HostPidUnavailable(result.name, result.observed)


class Requirements(Value):
    """
    What one transaction enforces: a L{TrustPolicy}'s fields, already
    validated, in a class a probe can make without loading C{attrs}.
    """

    __slots__ = ("socket_path", "trusted_uid", "deadline", "turned_off")
    socket_path: str
    trusted_uid: int
    deadline: float
    turned_off: frozenset[str]

    def __init__(
        self, socket_path: str, trusted_uid: int, deadline: float, turned_off: frozenset[str]
    ) -> None:
        self._set(socket_path=socket_path, trusted_uid=trusted_uid, deadline=deadline,
                  turned_off=turned_off)

    def enforces(self, check: str) -> bool:
        return check not in self.turned_off

    def require(self, result: CheckResult) -> None:
        """@raise HostPidUnavailable: C{result} failed and its check is enforced."""
        require(result, self.turned_off)


def __getattr__(name: str) -> object:
    # The policy class is made with attrs, which a probe never loads: it
    # lives in hostpid.client.policy and is found here on first use.
    if name in ("TrustPolicy", "STRICT"):
        from hostpid.client import policy

        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- What the checks look at: plain functions over what the kernel says. ---


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "unknown file type"


def os_error_text(error: OSError) -> str:
    """An OSError as C{ENAME (strerror)}: short, greppable, and stable."""
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    return f"{name} ({os.strerror(error.errno)})" if error.errno else str(error)


def _describe(info: os.stat_result) -> str:
    return f"{_kind(info.st_mode)}, uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}"


def check_gate(environ: Mapping[str, str] | None = None) -> CheckResult:
    """The gate, judged by the one rule in L{hostpid.gate}."""
    if environ is None:
        environ = os.environ
    value = environ.get(gate.GATE_ENV)
    observed = f"{gate.GATE_ENV} unset" if value is None else f"{gate.GATE_ENV}={value!r}"
    return CheckResult(GATE, gate.gate_enabled(environ), observed)


def _owner_as_mounted(
    uid: int, trusted_uid: int, namespace: userns.UserNamespace | None
) -> str | None:
    """
    In a user namespace that does not map C{trusted_uid}: the words for an
    owner that is the host's C{trusted_uid} as a mount can show it, or
    C{None} (the host's rule judges, and refuses anything else).

    An idmapped mount with the pod's mapping shows the host's owner as the
    same number; a mount without an idmapping shows it as the overflow UID.
    Either number is also one the pod maps (its root, its nobody), so the
    owner alone proves nothing here: what keeps the pod's own files away
    from this path is that only the runtime (or a process with
    C{CAP_SYS_ADMIN} over this mount namespace) can mount there, and the
    listener must still show as the overflow UID with PID 0 (docs/userns.md).
    """
    if namespace is None:
        namespace = userns.read_user_namespace()
    if not namespace.unmaps(trusted_uid):
        return None
    if uid == trusted_uid:
        return f" (the host's uid {trusted_uid} through an idmapped mount)"
    if uid == namespace.overflow_uid:
        return f" (the host's uid {trusted_uid} on a mount without an idmapping)"
    return None


def check_directory(
    info: os.stat_result | OSError, trusted_uid: int,
    namespace: userns.UserNamespace | None = None,
) -> CheckResult:
    """
    Judge the directory from its C{lstat}: a symlink is not followed, since
    whoever controls its target would control the answer.  In a user
    namespace that does not map the trusted UID the owner is judged as the
    mount shows it (L{_owner_as_mounted}): the same number through an
    idmapped broker mount, the overflow UID through a plain one.
    """
    if isinstance(info, OSError):
        return CheckResult(DIRECTORY, False, f"cannot open: {os_error_text(info)}")
    described = _describe(info)
    if not stat.S_ISDIR(info.st_mode):
        return CheckResult(DIRECTORY, False, f"{described}: not a real directory")
    owner = _owner_as_mounted(info.st_uid, trusted_uid, namespace)
    if owner is not None:
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return CheckResult(DIRECTORY, False, f"{described}: group or other may write")
        return CheckResult(DIRECTORY, True, f"{described}{owner}")
    if info.st_uid != trusted_uid:
        return CheckResult(
            DIRECTORY, False,
            f"{described}: owner is not uid {trusted_uid}"
            f"{userns.owner_hint(info.st_uid, namespace, trusted_uid)}",
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return CheckResult(DIRECTORY, False, f"{described}: group or other may write")
    return CheckResult(DIRECTORY, True, described)


def check_socket(
    info: os.stat_result | OSError, trusted_uid: int,
    namespace: userns.UserNamespace | None = None,
) -> CheckResult:
    """
    Judge the socket path from its C{lstat}: a socket owned by the trusted
    UID (as the mount shows it, in a user namespace: see L{check_directory}).
    """
    if isinstance(info, OSError):
        return CheckResult(SOCKET, False, f"cannot lstat: {os_error_text(info)}")
    described = _describe(info)
    if not stat.S_ISSOCK(info.st_mode):
        return CheckResult(SOCKET, False, f"{described}: not a socket")
    owner = _owner_as_mounted(info.st_uid, trusted_uid, namespace)
    if owner is not None:
        return CheckResult(SOCKET, True, f"{described}{owner}")
    if info.st_uid != trusted_uid:
        return CheckResult(
            SOCKET, False,
            f"{described}: owner is not uid {trusted_uid}"
            f"{userns.owner_hint(info.st_uid, namespace, trusted_uid)}",
        )
    return CheckResult(SOCKET, True, described)


def check_read_only(info: os.statvfs_result | OSError) -> CheckResult:
    """
    Judge the directory's mount: read-only, so that nobody in the workload,
    root included, can put another socket in the broker's place.
    """
    if isinstance(info, OSError):
        return CheckResult(READ_ONLY_MOUNT, False, f"cannot statvfs: {os_error_text(info)}")
    if info.f_flag & os.ST_RDONLY:
        return CheckResult(READ_ONLY_MOUNT, True, "read-only")
    return CheckResult(READ_ONLY_MOUNT, False, "read-write mount")


def check_peer(
    credentials: PeerCredentials | OSError, trusted_uid: int,
    namespace: userns.UserNamespace | None = None,
) -> CheckResult:
    """
    Judge the listener's credentials, as the kernel recorded them at
    C{listen()}.

    In the initial user namespace (and wherever the trusted UID is mapped)
    the listener must run as the trusted UID.  In a user namespace that
    does not map it, the kernel shows the host's root as the overflow UID
    (C{cred_to_ucred}: C{from_kuid_munged}), which is also a UID that a pod's
    own mapping maps: so the overflow UID passes only together with PID 0,
    a listener outside this PID namespace, never a process of this
    container (C{docs/userns.md} argues the rule).  The trusted UID as the
    namespace shows it still passes, with C{peer-pid} judging its PID as
    everywhere: the pod's own root is refused there unless outside this PID
    namespace, the same class of listener as an overflow UID with PID 0.
    """
    if isinstance(credentials, OSError):
        return CheckResult(
            PEER_UID, False, f"cannot read SO_PEERCRED: {os_error_text(credentials)}"
        )
    observed = f"uid {credentials.uid} (pid {credentials.pid})"
    if namespace is None:
        namespace = userns.read_user_namespace()
    if namespace.unmaps(trusted_uid):
        return _check_unmapped_peer(credentials, trusted_uid, namespace, observed)
    if credentials.uid != trusted_uid:
        return CheckResult(
            PEER_UID, False,
            f"{observed}: not uid {trusted_uid}"
            f"{userns.owner_hint(credentials.uid, namespace, trusted_uid)}",
        )
    return CheckResult(PEER_UID, True, observed)


def _check_unmapped_peer(
    credentials: PeerCredentials, trusted_uid: int, namespace: userns.UserNamespace,
    observed: str,
) -> CheckResult:
    overflow = namespace.overflow_uid
    if credentials.uid == trusted_uid:
        # The trusted UID as this namespace shows it (a test double run by
        # this pod, or the pod's root): the same rule as the host's, and
        # peer-pid then judges where the listener is.
        return CheckResult(
            PEER_UID, True, f"{observed}: uid {trusted_uid} as this user namespace shows it"
        )
    if credentials.uid != overflow:
        return CheckResult(
            PEER_UID, False,
            f"{observed}: not the overflow uid {overflow}: in this user namespace, where "
            f"uid {trusted_uid} of the host is not mapped, the host's broker shows as uid "
            f"{overflow}; uid {credentials.uid} is one this namespace maps",
        )
    if credentials.pid != 0:
        return CheckResult(
            PEER_UID, False,
            f"{observed}: the overflow uid {overflow} with pid {credentials.pid}, a process of "
            f"this PID namespace: uid {overflow} is also one this user namespace maps "
            "(nobody), and only pid 0 (outside this PID namespace) sets the host's broker apart",
        )
    return CheckResult(
        PEER_UID, True,
        f"{observed}: the overflow uid outside this PID namespace, as the host's uid "
        f"{trusted_uid} shows in this {namespace.describe()}",
    )


def check_peer_pid(
    credentials: PeerCredentials | OSError, caller: peerpid.CallerProcess | None = None
) -> CheckResult:
    """
    Judge the listener's PID: never the caller itself, and where the broker
    is (L{hostpid.client.peerpid}).  C{caller} defaults to this process.
    """
    if isinstance(credentials, OSError):
        return CheckResult(
            PEER_PID, False, f"cannot read SO_PEERCRED: {os_error_text(credentials)}"
        )
    if caller is None:
        caller = peerpid.this_process()
    problem = peerpid.peer_pid_problem(credentials.pid, caller)
    if problem is not None:
        return CheckResult(PEER_PID, False, problem)
    return CheckResult(PEER_PID, True, peerpid.describe(credentials.pid, caller))


def check_peer_identity(
    credentials: PeerCredentials | OSError, trusted_uid: int,
    namespace: userns.UserNamespace | None = None,
) -> tuple[CheckResult, CheckResult]:
    """The two verdicts on C{SO_PEERCRED}, in order: C{peer-uid}, C{peer-pid}."""
    return check_peer(credentials, trusted_uid, namespace), check_peer_pid(credentials)


def check_sandbox(signals: sandbox.SandboxSignals) -> CheckResult:
    """Judge what the runtime says about itself (L{hostpid.client.sandbox})."""
    problem = sandbox.sandbox_problem(signals)
    if problem is not None:
        return CheckResult(SANDBOX, False, problem)
    return CheckResult(SANDBOX, True, sandbox.describe(signals))


def check_reply(data: bytes) -> CheckResult:
    """
    Judge a reply: all twelve bytes, magic, version, status, then the PID,
    in the order HAMi-core checks them.
    """
    if len(data) != wire.RESPONSE_SIZE:
        return CheckResult(
            REPLY, False, f"cut short: {len(data)} of {wire.RESPONSE_SIZE} bytes"
        )
    response = wire.parse_response(data)
    if response.magic != wire.MAGIC:
        return CheckResult(REPLY, False, f"bad magic {response.magic!r}")
    if response.version != wire.VERSION:
        return CheckResult(REPLY, False, f"bad version {response.version}")
    if response.status != wire.Status.OK:
        return CheckResult(REPLY, False, f"status {response.status}, not 0")
    if not 1 <= response.pid <= wire.PID_MAX:
        return CheckResult(REPLY, False, f"PID {response.pid} outside 1..{wire.PID_MAX}")
    return CheckResult(REPLY, True, f"host PID {response.pid}")


def checked_path(check: str, socket_path: str) -> str | None:
    """
    The path a failure of C{check} is about, for a message that names it:
    the directory for C{directory} and C{read-only-mount}, the socket for the
    socket and everything after it, none for the C{gate} (an environment
    variable, not a path).
    """
    if check in (GATE, SANDBOX):
        return None
    if check in (DIRECTORY, READ_ONLY_MOUNT):
        return os.path.dirname(socket_path) or "."
    return socket_path


def host_pid_from_reply(data: bytes) -> int:
    """
    The PID in a reply that passes L{check_reply}.

    @raise HostPidUnavailable: it does not.
    """
    result = check_reply(data)
    if not result.ok:
        raise HostPidUnavailable(REPLY, result.observed)
    return wire.parse_response(data).pid


class Layout:
    """
    What the filesystem checks saw, and an open C{O_PATH} descriptor of the
    directory they saw it in (C{None} when it could not be opened).

    Connect to L{address} and then L{close}: the descriptor is what ties the
    connection to the directory that was checked.
    """

    def __init__(
        self,
        socket_path: str,
        results: tuple[CheckResult, ...],
        directory_fd: int | None,
        connectable: bool,
        namespace: userns.UserNamespace | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.results = results
        self.directory_fd = directory_fd
        self.connectable = connectable
        #: The user namespace the checks judged in, read once: the peer
        #: checks judge in the same one.
        self.namespace = namespace if namespace is not None else userns.read_user_namespace()

    def address(self) -> str:
        """
        The path to connect to: through the checked directory's descriptor
        when procfs confirms it names that directory, else the socket path.
        """
        fd = self.directory_fd
        if fd is None:
            return self.socket_path
        name = os.path.basename(self.socket_path)
        via = f"/proc/self/fd/{fd}/{name}"
        if len(os.fsencode(via)) > _SUN_PATH_MAX:
            return self.socket_path
        try:
            seen, held = os.stat(f"/proc/self/fd/{fd}"), os.fstat(fd)
        except OSError:
            return self.socket_path
        if (seen.st_dev, seen.st_ino) != (held.st_dev, held.st_ino):
            return self.socket_path
        return via

    def close(self) -> None:
        if self.directory_fd is not None:
            os.close(self.directory_fd)
            self.directory_fd = None


def _open_path(path: str, follow: bool) -> int:
    flags = os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    return os.open(path, flags)


def inspect_layout(policy: TrustPolicy | Requirements) -> Layout:
    """
    Run the checks that need no connection (C{sandbox}, C{directory},
    C{socket}, C{read-only-mount}) and return all four verdicts, in that
    order; enforcing them is the caller's business, so that L{doctor} can
    report every one.

    The directory is opened once without following a symlink and judged from
    C{fstat} of that descriptor (an C{lstat} that cannot race); if it turns
    out to be a symlink the later checks still look through it, so that an
    operator sees everything that is wrong at once.
    """
    directory, name = os.path.split(policy.socket_path)
    directory = directory or "."
    fd: int | None = None
    try:
        fd = _open_path(directory, follow=False)
        directory_info: os.stat_result | OSError = os.fstat(fd)
    except OSError as error:
        directory_info = error
    if fd is not None and isinstance(directory_info, os.stat_result):
        if not stat.S_ISDIR(directory_info.st_mode):
            os.close(fd)
            fd = None
            if stat.S_ISLNK(directory_info.st_mode):
                try:
                    fd = _open_path(directory, follow=True)
                except OSError:
                    fd = None
    namespace = userns.read_user_namespace()
    directory_result = check_directory(directory_info, policy.trusted_uid, namespace)
    sandbox_result = check_sandbox(sandbox.read_signals(fd))
    if fd is None:
        unseen = "not checked: the directory cannot be opened"
        return Layout(
            socket_path=policy.socket_path,
            results=(
                sandbox_result,
                directory_result,
                CheckResult(SOCKET, False, unseen),
                CheckResult(READ_ONLY_MOUNT, False, unseen),
            ),
            directory_fd=None,
            connectable=False,
            namespace=namespace,
        )
    try:
        socket_info: os.stat_result | OSError = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError as error:
        socket_info = error
    try:
        mount_info: os.statvfs_result | OSError = os.fstatvfs(fd)
    except OSError as error:
        mount_info = error
    connectable = isinstance(socket_info, os.stat_result) and stat.S_ISSOCK(socket_info.st_mode)
    return Layout(
        socket_path=policy.socket_path,
        results=(
            sandbox_result,
            directory_result,
            check_socket(socket_info, policy.trusted_uid, namespace),
            check_read_only(mount_info),
        ),
        directory_fd=fd,
        connectable=connectable,
        namespace=namespace,
    )


