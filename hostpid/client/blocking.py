"""
The blocking client: ask the broker for this process's host PID, and trust
the answer only when every check of L{hostpid.client.trust} passes.

L{query_host_pid} / L{lookup_host_pid} use a plain non-blocking C{socket}
under one monotonic deadline, no reactor and no module-level mutable state,
so they are safe from any thread and after C{fork}.  L{doctor} runs every
check and reports each.  The same transaction on a Twisted reactor is
L{hostpid.client.txclient}.

The client never sends a PID and never returns one the reply did not carry:
every failure is an exception (or C{None} from L{lookup_host_pid}), and the
caller falls back to its existing discovery path.
"""

from __future__ import annotations

import math
import os
import select
import socket
import time
from collections.abc import Callable, Mapping

import attrs
from twisted.logger import Logger

from hostpid import defaults, wire
from hostpid.client.connect import FIRST_BACKOFF, new_socket, next_backoff, try_connect
from hostpid.client.trust import (
    CHECKS,
    CONNECT,
    DEADLINE,
    DIRECTORY,
    DOCTOR_CHECKS,
    GATE,
    OPTIONAL_CHECKS,
    PEER_PID,
    PEER_UID,
    READ_ONLY_MOUNT,
    REPLY,
    SANDBOX,
    SOCKET,
    STRICT,
    CheckResult,
    HostPidUnavailable,
    Layout,
    TrustPolicy,
    check_directory,
    check_gate,
    check_peer,
    check_peer_identity,
    check_peer_pid,
    check_read_only,
    check_reply,
    check_sandbox,
    check_socket,
    checked_path,
    host_pid_from_reply,
    inspect_layout,
    os_error_text,
)
from hostpid.peercred import PeerCredentials, peer_credentials

__all__ = [
    "CHECKS", "CONNECT", "DEADLINE", "DIRECTORY", "DOCTOR_CHECKS", "GATE", "OPTIONAL_CHECKS",
    "PEER_PID", "PEER_UID", "READ_ONLY_MOUNT", "REPLY", "SANDBOX", "SOCKET", "STRICT",
    "CheckResult", "HostPidUnavailable", "Layout", "TrustPolicy", "check_directory",
    "check_gate", "check_peer", "check_peer_identity", "check_peer_pid", "check_read_only",
    "check_reply", "check_sandbox", "check_socket", "doctor",
    "host_pid_from_reply", "inspect_layout", "lookup_host_pid", "probe", "ProbeReport",
    "query_host_pid", "checked_path",
]

_log = Logger()


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
        self.sock = new_socket()

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
        while not try_connect(self.sock, address):
            left = self._left()
            if left <= 0:
                raise self._passed("while connecting: accept queue full (EAGAIN)")
            time.sleep(min(delay, left))
            delay = next_backoff(delay)

    def send(self, data: bytes) -> None:
        sent = 0
        while sent < len(data):
            self._wait(select.POLLOUT, f"sending the request ({sent} of {len(data)} bytes)")
            try:
                sent += self.sock.send(data[sent:], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                continue
            except OSError as error:
                raise HostPidUnavailable(REPLY, f"cannot send: {os_error_text(error)}") from None

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
                    REPLY, f"cannot receive after {len(data)} bytes: {os_error_text(error)}"
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
    return _transaction(policy, environ)[0]


def _transaction(
    policy: TrustPolicy, environ: Mapping[str, str] | None
) -> tuple[int, tuple[CheckResult, ...]]:
    """
    One checked transaction: the PID the reply carried and the filesystem
    checks' verdicts (for a caller that reports what it checked).
    """
    policy.require(check_gate(environ))
    return _checked_transaction(policy)


def _checked_transaction(policy: TrustPolicy) -> tuple[int, tuple[CheckResult, ...]]:
    """
    L{_transaction} past the gate: every check of C{policy} on the layout,
    the peer and the reply.  Only L{probe} starts here, since the gate is a
    workload's decision to ask, not a property of the broker.
    """
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
            for verdict in check_peer_identity(credentials, policy.trusted_uid):
                policy.require(verdict)
            connection.send(wire.GET_HOST_PID_REQUEST)
            pid = host_pid_from_reply(connection.receive(wire.RESPONSE_SIZE))
            return pid, layout.results
        finally:
            connection.close()
    finally:
        layout.close()


@attrs.frozen
class ProbeReport:
    """
    A healthy broker, as L{probe} saw it.

    @ivar socket_path: the socket probed.
    @ivar pid: the PID the broker answered: this process's own.
    @ivar socket: the C{socket} check's verdict (type, owner UID and mode).
    @ivar gate: the gate in the probing process's environment, as information
        only: the probe ran whatever it says.
    """

    socket_path: str
    pid: int
    socket: CheckResult
    gate: CheckResult


def probe(
    socket_path: str = defaults.BROKER_SOCKET,
    deadline: float = defaults.DEADLINE,
    environ: Mapping[str, str] | None = None,
    trusted_uid: int = 0,
) -> ProbeReport:
    """
    The operator's check that a broker serves: one transaction from the host
    (or the broker's own container, which shares the host PID namespace),
    passing only when the reply has status 0 and names this very process.

    Every trust check applies but C{read-only-mount}: the broker directory is
    writable where the broker and its operator are, and read-only only in a
    workload's mount.  C{peer-pid} and C{sandbox} apply too (from the host
    PID namespace the listener must have a real PID).  The gate is not
    required either: it is a workload's decision whether to ask at all, and
    an operator checking a broker from the host has no reason to carry it in
    the shell.  It is read and reported (L{ProbeReport.gate}) as
    information.  A workload's question is L{query_host_pid}, not this.

    @param environ: where to read the gate reported (default: C{os.environ}).
    @param trusted_uid: the UID that must own the directory and the socket
        and run the listener: 0 for the production broker, another for a
        broker run unprivileged on its own C{--directory}.

    @raise HostPidUnavailable: a check or stage failed, or the broker
        answered another PID (check C{reply}).
    @raise ValueError: C{deadline} is not a positive number of seconds.
    """
    policy = TrustPolicy(
        socket_path=socket_path, deadline=deadline, trusted_uid=trusted_uid
    ).without(READ_ONLY_MOUNT)
    gate = check_gate(environ)
    pid, results = _checked_transaction(policy)
    own = os.getpid()
    if pid != own:
        raise HostPidUnavailable(
            REPLY,
            f"answered PID {pid}, not this process's PID {own} "
            "(a probe must run in the broker's PID namespace)",
        )
    (socket_result,) = (result for result in results if result.name == SOCKET)
    return ProbeReport(socket_path=policy.socket_path, pid=pid, socket=socket_result, gate=gate)


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
    listener's UID and PID; the request is sent only when both are trusted
    (or the policy turned the failing one off).  A check the policy turned
    off is still judged, and says so.
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
    for name in (CONNECT, PEER_UID, PEER_PID):
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
    for verdict in check_peer_identity(credentials, policy.trusted_uid):
        results[verdict.name] = verdict
    if any(not results[name].ok and policy.enforces(name) for name in (PEER_UID, PEER_PID)):
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


