"""
The client: ask the broker for this process's host PID, and trust the answer
only when everything about the socket says it comes from the root broker
through a read-only mount.

One trust policy (L{TrustPolicy}) and one set of checks, applied in this
order, each failing under a stable name:

  1. C{gate}: C{LIBVGPU_HOSTPID_BROKER} is exactly C{"1"};
  2. C{directory}: the socket's directory is a real directory (not followed
     if it is a symlink), owned by the trusted UID, with no group or other
     write bit;
  3. C{socket}: the socket path is a socket (not followed if it is a symlink)
     owned by the trusted UID;
  4. C{read-only-mount}: the directory is on a read-only mount;
  5. C{peer-uid}: after connecting, the kernel's C{SO_PEERCRED} says the
     listener runs as the trusted UID (checked before a byte is sent);
  6. C{reply}: magic C{HPID}, version 1, status 0, a PID in 1..2**31-1.

Two transport stages can also fail a query, and no caller can turn them off:
C{connect} (the kernel refused the connection) and C{deadline} (one monotonic
deadline over connect, write and read passed).

The checks are plain functions over what the kernel reports (L{check_gate},
L{inspect_layout}, L{check_peer}, L{check_reply}), shared by two transports:

  - L{query_host_pid} / L{lookup_host_pid}: blocking, plain C{socket}, no
    reactor, no module-level mutable state, so they are safe from any thread
    and after C{fork};
  - L{query_host_pid_deferred} / L{lookup_host_pid_deferred}: the same
    transaction on a Twisted reactor, returning a L{Deferred}.

The filesystem checks run on one C{O_PATH} descriptor of the directory, and
the connection goes through that descriptor (C{/proc/self/fd/N/broker.sock})
when procfs confirms it names the same directory, so the directory that was
checked is the directory that is connected to.

The client never sends a PID and never returns one the reply did not carry:
every failure is an exception (or C{None} from the C{lookup} calls), and the
caller falls back to its existing discovery path.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol as Structural

import attrs
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid import defaults, gate, wire
from hostpid.peercred import PeerCredentials, peer_credentials


class _DelayedCall(Structural):
    def active(self) -> bool: ...
    def cancel(self) -> None: ...


class _Clock(Structural):
    """What the Twisted transport needs of a clock (C{IReactorTime.callLater})."""

    def callLater(
        self, delay: float, callable: Callable[..., object], *args: object, **kw: object
    ) -> _DelayedCall: ...


class _Transport(Structural):
    """What the reply protocol needs of its transport."""

    def getHandle(self) -> socket.socket: ...
    def write(self, data: bytes) -> None: ...
    def loseConnection(self) -> None: ...
    def abortConnection(self) -> None: ...

GATE = "gate"
DIRECTORY = "directory"
SOCKET = "socket"
READ_ONLY_MOUNT = "read-only-mount"
CONNECT = "connect"
PEER_UID = "peer-uid"
REPLY = "reply"
DEADLINE = "deadline"

#: The trust checks, in the order every client applies them.
CHECKS: tuple[str, ...] = (GATE, DIRECTORY, SOCKET, READ_ONLY_MOUNT, PEER_UID, REPLY)

#: The checks a caller may turn off by name.  The gate is the operator's
#: switch and the reply is what makes an answer an answer: neither can be
#: turned off, nor can the transport stages (C{connect}, C{deadline}).
OPTIONAL_CHECKS: frozenset[str] = frozenset({DIRECTORY, SOCKET, READ_ONLY_MOUNT, PEER_UID})

#: What L{doctor} reports, one result each, in this order.
DOCTOR_CHECKS: tuple[str, ...] = (
    GATE, DIRECTORY, SOCKET, READ_ONLY_MOUNT, CONNECT, PEER_UID, REPLY
)

#: Backoff between connect attempts while the accept queue is full.
FIRST_BACKOFF = 0.001
LAST_BACKOFF = 0.010

#: The longest C{sun_path} Linux accepts, terminating NUL excluded.
_SUN_PATH_MAX = 107

_log = Logger()


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


@attrs.frozen
class CheckResult:
    """One check's verdict: its C{name}, whether it passed, what was seen."""

    name: str
    ok: bool
    observed: str


def _positive_finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


def _optional_checks(
    instance: object, attribute: attrs.Attribute[frozenset[str]], value: frozenset[str]
) -> None:
    for name in sorted(value):
        if name in OPTIONAL_CHECKS:
            continue
        if name in CHECKS or name in (CONNECT, DEADLINE):
            raise ValueError(f"the {name!r} check cannot be turned off")
        raise ValueError(
            f"unknown check {name!r}; checks that can be turned off: "
            + ", ".join(sorted(OPTIONAL_CHECKS))
        )


def _names(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise TypeError("turned_off takes check names, not one string")
    return frozenset(value)


@attrs.frozen
class TrustPolicy:
    """
    Where the broker is and what makes its answer trustworthy.

    The defaults are the production rules; a test or an unusual node points
    the client elsewhere with C{socket_path} and turns a check off only by
    naming it (L{without}), so that a relaxed policy always says what it
    relaxed.

    @ivar socket_path: the broker's socket.
    @ivar trusted_uid: the UID that must own the directory and the socket and
        run the listener.
    @ivar deadline: seconds for connect, write and read together.
    @ivar turned_off: names from L{OPTIONAL_CHECKS} that are not enforced.
    """

    socket_path: str = attrs.field(default=defaults.CLIENT_SOCKET, converter=os.fspath)
    trusted_uid: int = 0
    deadline: float = attrs.field(default=defaults.DEADLINE, validator=_positive_finite)
    turned_off: frozenset[str] = attrs.field(
        default=frozenset(), converter=_names, validator=_optional_checks
    )

    def without(self, *checks: str) -> TrustPolicy:
        """
        This policy with C{checks} turned off.

        @raise ValueError: a name is unknown or names a check that cannot be
            turned off.
        """
        return attrs.evolve(self, turned_off=self.turned_off.union(checks))

    def enforces(self, check: str) -> bool:
        return check not in self.turned_off

    def require(self, result: CheckResult) -> None:
        """
        Raise for C{result} if it failed and its check is enforced.

        @raise HostPidUnavailable: it did.
        """
        if not result.ok and self.enforces(result.name):
            raise HostPidUnavailable(result.name, result.observed)


#: The production policy.
STRICT = TrustPolicy()


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


def _error(error: OSError) -> str:
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


def check_directory(info: os.stat_result | OSError, trusted_uid: int) -> CheckResult:
    """
    Judge the directory from its C{lstat}: a symlink is not followed, since
    whoever controls its target would control the answer.
    """
    if isinstance(info, OSError):
        return CheckResult(DIRECTORY, False, f"cannot open: {_error(info)}")
    described = _describe(info)
    if not stat.S_ISDIR(info.st_mode):
        return CheckResult(DIRECTORY, False, f"{described}: not a real directory")
    if info.st_uid != trusted_uid:
        return CheckResult(DIRECTORY, False, f"{described}: owner is not uid {trusted_uid}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return CheckResult(DIRECTORY, False, f"{described}: group or other may write")
    return CheckResult(DIRECTORY, True, described)


def check_socket(info: os.stat_result | OSError, trusted_uid: int) -> CheckResult:
    """Judge the socket path from its C{lstat}: a socket owned by the trusted UID."""
    if isinstance(info, OSError):
        return CheckResult(SOCKET, False, f"cannot lstat: {_error(info)}")
    described = _describe(info)
    if not stat.S_ISSOCK(info.st_mode):
        return CheckResult(SOCKET, False, f"{described}: not a socket")
    if info.st_uid != trusted_uid:
        return CheckResult(SOCKET, False, f"{described}: owner is not uid {trusted_uid}")
    return CheckResult(SOCKET, True, described)


def check_read_only(info: os.statvfs_result | OSError) -> CheckResult:
    """
    Judge the directory's mount: read-only, so that nobody in the workload,
    root included, can put another socket in the broker's place.
    """
    if isinstance(info, OSError):
        return CheckResult(READ_ONLY_MOUNT, False, f"cannot statvfs: {_error(info)}")
    if info.f_flag & os.ST_RDONLY:
        return CheckResult(READ_ONLY_MOUNT, True, "read-only")
    return CheckResult(READ_ONLY_MOUNT, False, "read-write mount")


def check_peer(credentials: PeerCredentials | OSError, trusted_uid: int) -> CheckResult:
    """Judge the listener's credentials, as the kernel recorded them at C{listen()}."""
    if isinstance(credentials, OSError):
        return CheckResult(PEER_UID, False, f"cannot read SO_PEERCRED: {_error(credentials)}")
    observed = f"uid {credentials.uid} (pid {credentials.pid})"
    if credentials.uid != trusted_uid:
        return CheckResult(PEER_UID, False, f"{observed}: not uid {trusted_uid}")
    return CheckResult(PEER_UID, True, observed)


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


def host_pid_from_reply(data: bytes) -> int:
    """
    The PID in a reply that passes L{check_reply}.

    @raise HostPidUnavailable: it does not.
    """
    result = check_reply(data)
    if not result.ok:
        raise HostPidUnavailable(REPLY, result.observed)
    return wire.parse_response(data).pid


@attrs.define
class Layout:
    """
    What the filesystem checks saw, and an open C{O_PATH} descriptor of the
    directory they saw it in (C{None} when it could not be opened).

    Connect to L{address} and then L{close}: the descriptor is what ties the
    connection to the directory that was checked.
    """

    socket_path: str
    results: tuple[CheckResult, ...]
    directory_fd: int | None
    connectable: bool

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


def inspect_layout(policy: TrustPolicy) -> Layout:
    """
    Run the filesystem checks (C{directory}, C{socket}, C{read-only-mount})
    and return all three verdicts; enforcing them is the caller's business,
    so that L{doctor} can report every one.

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
    directory_result = check_directory(directory_info, policy.trusted_uid)
    if fd is None:
        unseen = "not checked: the directory cannot be opened"
        return Layout(
            socket_path=policy.socket_path,
            results=(
                directory_result,
                CheckResult(SOCKET, False, unseen),
                CheckResult(READ_ONLY_MOUNT, False, unseen),
            ),
            directory_fd=None,
            connectable=False,
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
            directory_result,
            check_socket(socket_info, policy.trusted_uid),
            check_read_only(mount_info),
        ),
        directory_fd=fd,
        connectable=connectable,
    )


def _next_backoff(delay: float) -> float:
    """1 ms, doubling, at most 10 ms: short enough to catch a draining queue."""
    return min(delay * 2, LAST_BACKOFF)


def _try_connect(sock: socket.socket, address: str) -> bool:
    """
    One non-blocking connect attempt: C{True} when connected, C{False} when
    the accept queue is full (retry later).

    @raise HostPidUnavailable: the kernel refused for any other reason.
    """
    try:
        sock.connect(address)
    except BlockingIOError:
        return False
    except OSError as error:
        raise HostPidUnavailable(CONNECT, _error(error)) from None
    return True


def _new_socket() -> socket.socket:
    return socket.socket(
        socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
    )


# --- The blocking transport. ---


class _BlockingConnection:
    """
    One non-blocking socket and one monotonic deadline, fixed when it is made:
    every wait below is bounded by what is left of it, so a broker that
    trickles bytes cannot extend it.
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._seconds = seconds
        self._clock = clock
        self._deadline = clock() + seconds
        self.sock = _new_socket()

    def close(self) -> None:
        self.sock.close()

    def _left(self) -> float:
        return self._deadline - self._clock()

    def _passed(self, doing: str) -> HostPidUnavailable:
        return HostPidUnavailable(DEADLINE, f"{self._seconds:g} s passed {doing}")

    def _wait(self, events: int, doing: str) -> None:
        left = self._left()
        if left <= 0:
            raise self._passed(doing)
        poller = select.poll()
        poller.register(self.sock, events)
        if not poller.poll(math.ceil(left * 1000)) and self._left() <= 0:
            raise self._passed(doing)

    def connect(self, address: str) -> None:
        delay = FIRST_BACKOFF
        while not _try_connect(self.sock, address):
            left = self._left()
            if left <= 0:
                raise self._passed("while connecting: accept queue full (EAGAIN)")
            time.sleep(min(delay, left))
            delay = _next_backoff(delay)

    def send(self, data: bytes) -> None:
        sent = 0
        while sent < len(data):
            self._wait(select.POLLOUT, f"sending the request ({sent} of {len(data)} bytes)")
            try:
                sent += self.sock.send(data[sent:], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                continue
            except OSError as error:
                raise HostPidUnavailable(REPLY, f"cannot send: {_error(error)}") from None

    def receive(self, size: int) -> bytes:
        """Up to C{size} bytes, fewer only if the broker closed first."""
        data = b""
        while len(data) < size:
            self._wait(select.POLLIN, f"waiting for the reply ({len(data)} of {size} bytes)")
            try:
                chunk = self.sock.recv(size - len(data))
            except BlockingIOError:
                continue
            except OSError as error:
                raise HostPidUnavailable(
                    REPLY, f"cannot receive after {len(data)} bytes: {_error(error)}"
                ) from None
            if not chunk:
                break
            data += chunk
        return data


def query_host_pid(
    policy: TrustPolicy = STRICT, environ: Mapping[str, str] | None = None
) -> int:
    """
    Ask the broker for this process's host PID, applying every enforced check.

    Blocking, with no reactor and no shared state: safe from any thread and
    after C{fork}.  It returns within about C{policy.deadline} seconds.

    @param environ: where to read the gate (default: C{os.environ}).
    @raise HostPidUnavailable: a check or stage failed; C{check} names it.
    """
    policy.require(check_gate(environ))
    layout = inspect_layout(policy)
    try:
        for result in layout.results:
            policy.require(result)
        connection = _BlockingConnection(policy.deadline)
        try:
            connection.connect(layout.address())
            layout.close()
            try:
                credentials: PeerCredentials | OSError = peer_credentials(connection.sock)
            except OSError as error:
                credentials = error
            policy.require(check_peer(credentials, policy.trusted_uid))
            connection.send(wire.GET_HOST_PID_REQUEST)
            return host_pid_from_reply(connection.receive(wire.RESPONSE_SIZE))
        finally:
            connection.close()
    finally:
        layout.close()


def lookup_host_pid(
    policy: TrustPolicy = STRICT, environ: Mapping[str, str] | None = None
) -> int | None:
    """
    This process's host PID from the broker, or C{None}: the caller then uses
    its existing discovery path.  Broker trouble never raises.
    """
    try:
        return query_host_pid(policy, environ)
    except HostPidUnavailable as problem:
        _log.debug(
            "host PID broker not used ({check}: {observed})",
            check=problem.check,
            observed=problem.observed,
        )
        return None


def doctor(
    policy: TrustPolicy = STRICT, environ: Mapping[str, str] | None = None
) -> tuple[CheckResult, ...]:
    """
    Run every check and report each (L{DOCTOR_CHECKS}, in order) instead of
    stopping at the first failure, so an operator sees at once why a
    workload falls back.

    The socket is connected to whenever it is a socket, to report its
    listener's UID; the request is sent only when that UID is trusted (or
    the policy turned C{peer-uid} off).  A check the policy turned off is
    still judged, and says so.
    """
    results: dict[str, CheckResult] = {GATE: check_gate(environ)}
    layout = inspect_layout(policy)
    try:
        for result in layout.results:
            results[result.name] = result
        if not layout.connectable:
            results[CONNECT] = CheckResult(CONNECT, False, "not tried: no socket to connect to")
        else:
            connection = _BlockingConnection(policy.deadline)
            try:
                _doctor_exchange(policy, layout, connection, results)
            finally:
                connection.close()
    finally:
        layout.close()
    for name in DOCTOR_CHECKS:
        if name not in results:
            results[name] = CheckResult(name, False, f"not tried: {_first_failure(results)}")
    return tuple(_annotate(policy, results[name]) for name in DOCTOR_CHECKS)


def _first_failure(results: Mapping[str, CheckResult]) -> str:
    for name in (CONNECT, PEER_UID):
        if name in results and not results[name].ok:
            return f"{name} failed"
    return "an earlier step failed"


def _doctor_exchange(
    policy: TrustPolicy,
    layout: Layout,
    connection: _BlockingConnection,
    results: dict[str, CheckResult],
) -> None:
    try:
        connection.connect(layout.address())
    except HostPidUnavailable as problem:
        results[CONNECT] = CheckResult(CONNECT, False, str(problem))
        return
    results[CONNECT] = CheckResult(CONNECT, True, "connected")
    try:
        credentials: PeerCredentials | OSError = peer_credentials(connection.sock)
    except OSError as error:
        credentials = error
    peer = results[PEER_UID] = check_peer(credentials, policy.trusted_uid)
    if not peer.ok and policy.enforces(PEER_UID):
        return
    try:
        connection.send(wire.GET_HOST_PID_REQUEST)
        data = connection.receive(wire.RESPONSE_SIZE)
    except HostPidUnavailable as problem:
        results[REPLY] = CheckResult(REPLY, False, str(problem))
        return
    results[REPLY] = check_reply(data)


def _annotate(policy: TrustPolicy, result: CheckResult) -> CheckResult:
    if policy.enforces(result.name):
        return result
    return attrs.evolve(result, observed=f"{result.observed} [check turned off]")


# --- The Twisted transport: the same checks, on a reactor. ---


def query_host_pid_deferred(
    policy: TrustPolicy = STRICT,
    environ: Mapping[str, str] | None = None,
    reactor: object = None,
    clock: _Clock | None = None,
) -> Deferred[int]:
    """
    L{query_host_pid} for Twisted code: the same checks and the same single
    deadline, without blocking the reactor.

    The filesystem checks are a few system calls and run at once; the
    connection is made with the same non-blocking connect (a full accept
    queue is retried on C{clock}), then adopted by C{reactor}, and the
    listener's UID is read from the transport's handle before the request is
    written.  Cancelling the L{Deferred} closes the connection.

    @param reactor: provides C{IReactorSocket}; default: the global reactor.
    @param clock: runs the deadline and the retries; default: C{reactor}.
    @return: fires with the host PID, or fails with L{HostPidUnavailable}.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
    try:
        policy.require(check_gate(environ))
        layout = inspect_layout(policy)
    except HostPidUnavailable:
        return defer.fail()
    try:
        for result in layout.results:
            policy.require(result)
    except HostPidUnavailable:
        layout.close()
        return defer.fail()
    transaction = _TwistedTransaction(
        policy=policy,
        layout=layout,
        reactor=reactor,
        clock=clock if clock is not None else reactor,  # type: ignore[arg-type]
    )
    return transaction.start()


def lookup_host_pid_deferred(
    policy: TrustPolicy = STRICT,
    environ: Mapping[str, str] | None = None,
    reactor: object = None,
    clock: _Clock | None = None,
) -> Deferred[int | None]:
    """
    L{lookup_host_pid} for Twisted code: fires with the host PID or C{None},
    never with a failure for broker trouble.
    """

    def unavailable(failure: Failure) -> int | None:
        failure.trap(HostPidUnavailable)
        problem = failure.value
        assert isinstance(problem, HostPidUnavailable)
        _log.debug(
            "host PID broker not used ({check}: {observed})",
            check=problem.check,
            observed=problem.observed,
        )
        return None

    deferred: Deferred[int | None] = Deferred()
    query_host_pid_deferred(policy, environ, reactor, clock).addCallbacks(
        deferred.callback, lambda failure: deferred.callback(unavailable(failure))
    )
    return deferred


class _TwistedTransaction:
    """
    One transaction on a reactor: connect (with retries), adopt, check the
    peer, write, read twelve bytes, all under one deadline on C{clock}.

    Its L{Deferred} fires exactly once, and only after the connection is
    closed and every delayed call is cancelled, so a caller that gets the
    answer has nothing left to clean up.  (Cancelling is the exception: the
    Deferred fails at once, and the aborted connection goes on the next
    reactor turn.)
    """

    def __init__(
        self, policy: TrustPolicy, layout: Layout, reactor: object, clock: _Clock
    ) -> None:
        self.policy = policy
        self._layout = layout
        self._reactor = reactor
        self._clock = clock
        self._sock: socket.socket | None = None
        self._protocol: _ReplyProtocol | None = None
        self._retry: _DelayedCall | None = None
        self._deadline: _DelayedCall | None = None
        self._delay = FIRST_BACKOFF
        self._address = ""
        self._outcome: int | Failure | None = None
        self.deferred: Deferred[int] = Deferred(lambda _: self._cancelled())

    def start(self) -> Deferred[int]:
        self._deadline = self._clock.callLater(self.policy.deadline, self._deadline_passed)
        try:
            self._address = self._layout.address()
            self._sock = _new_socket()
        except OSError as error:
            self.fail(HostPidUnavailable(CONNECT, _error(error)))
            return self.deferred
        self._attempt()
        return self.deferred

    def _attempt(self) -> None:
        self._retry = None
        sock = self._sock
        if sock is None:
            return
        try:
            connected = _try_connect(sock, self._address)
        except HostPidUnavailable as problem:
            self.fail(problem)
            return
        if not connected:
            self._retry = self._clock.callLater(self._delay, self._attempt)
            self._delay = _next_backoff(self._delay)
            return
        self._layout.close()
        factory = Factory.forProtocol(lambda: _ReplyProtocol(self))
        try:
            self._reactor.adoptStreamConnection(  # type: ignore[attr-defined]
                sock.fileno(), socket.AF_UNIX, factory
            )
        except Exception as error:
            self.fail(HostPidUnavailable(CONNECT, f"cannot adopt the connection: {error}"))
        finally:
            sock.close()
            self._sock = None

    def connected(self, protocol: _ReplyProtocol) -> None:
        self._protocol = protocol

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self._protocol is None:
            doing = "while connecting: accept queue full (EAGAIN)"
        else:
            doing = (
                f"waiting for the reply ({len(self._protocol.buffer)} of "
                f"{wire.RESPONSE_SIZE} bytes)"
            )
        self.fail(HostPidUnavailable(DEADLINE, f"{self.policy.deadline:g} s passed {doing}"))

    def _release(self) -> None:
        for call in (self._retry, self._deadline):
            if call is not None and call.active():
                call.cancel()
        self._retry = self._deadline = None
        self._layout.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _conclude(self, outcome: int | Failure) -> None:
        """Record the first outcome, release everything, and close the connection."""
        if self._outcome is not None or self.deferred.called:
            return
        self._outcome = outcome
        self._release()
        protocol = self._protocol
        if protocol is None:
            self._settle()
        elif isinstance(outcome, Failure):
            protocol.abort()
        else:
            protocol.close()

    def fail(self, problem: HostPidUnavailable) -> None:
        self._conclude(Failure(problem))

    def succeed(self, pid: int) -> None:
        self._conclude(pid)

    def connection_lost(self, received: bytes) -> None:
        """The connection is gone: settle the outcome, or conclude with the reply."""
        self._protocol = None
        if self._outcome is None and not self.deferred.called:
            self.fail(HostPidUnavailable(REPLY, check_reply(received).observed))
        else:
            self._settle()

    def _settle(self) -> None:
        outcome, self._outcome = self._outcome, None
        if self.deferred.called or outcome is None:
            return
        if isinstance(outcome, Failure):
            self.deferred.errback(outcome)
        else:
            self.deferred.callback(outcome)

    def _cancelled(self) -> None:
        self._outcome = None
        self._release()
        if self._protocol is not None:
            self._protocol.abort()


class _ReplyProtocol(Protocol):
    """
    The thin adapter: peer check from the transport's handle, the request,
    twelve bytes of reply; every verdict comes from the shared functions.
    """

    def __init__(self, transaction: _TwistedTransaction) -> None:
        self.transaction = transaction
        self.buffer = b""
        self.done = False

    def _transport(self) -> _Transport:
        transport: _Transport = self.transport  # type: ignore[assignment]
        return transport

    def abort(self) -> None:
        self.done = True
        self._transport().abortConnection()

    def close(self) -> None:
        self.done = True
        self._transport().loseConnection()

    def connectionMade(self) -> None:
        self.transaction.connected(self)
        try:
            credentials: PeerCredentials | OSError = peer_credentials(
                self._transport().getHandle()
            )
        except OSError as error:
            credentials = error
        try:
            self.transaction.policy.require(
                check_peer(credentials, self.transaction.policy.trusted_uid)
            )
        except HostPidUnavailable as problem:
            self.transaction.fail(problem)
            return
        self._transport().write(wire.GET_HOST_PID_REQUEST)

    def dataReceived(self, data: bytes) -> None:
        if self.done:
            return
        self.buffer += data
        if len(self.buffer) < wire.RESPONSE_SIZE:
            return
        try:
            pid = host_pid_from_reply(self.buffer[: wire.RESPONSE_SIZE])
        except HostPidUnavailable as problem:
            self.transaction.fail(problem)
            return
        self.transaction.succeed(pid)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.transaction.connection_lost(self.buffer)


__all__ = [
    "CHECKS",
    "CONNECT",
    "DEADLINE",
    "DIRECTORY",
    "DOCTOR_CHECKS",
    "GATE",
    "OPTIONAL_CHECKS",
    "PEER_UID",
    "READ_ONLY_MOUNT",
    "REPLY",
    "SOCKET",
    "STRICT",
    "CheckResult",
    "HostPidUnavailable",
    "Layout",
    "TrustPolicy",
    "check_directory",
    "check_gate",
    "check_peer",
    "check_read_only",
    "check_reply",
    "check_socket",
    "doctor",
    "host_pid_from_reply",
    "inspect_layout",
    "lookup_host_pid",
    "lookup_host_pid_deferred",
    "query_host_pid",
    "query_host_pid_deferred",
]
