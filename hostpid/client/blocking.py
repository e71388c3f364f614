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

from collections.abc import Mapping

from twisted.logger import Logger

from hostpid import wire
from hostpid.client.policy import STRICT, TrustPolicy
from hostpid.client.transaction import (
    BlockingConnection,
    ProbeReport,
    checked_transaction,
    probe,
)
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
    CheckResult,
    HostPidUnavailable,
    Layout,
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
)
from hostpid.ucred import PeerCredentials, peer_credentials

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
    return checked_transaction(policy.requirements())


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
            connection = BlockingConnection(policy.deadline)
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
    connection: BlockingConnection,
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
    for verdict in check_peer_identity(credentials, policy.trusted_uid, layout.namespace):
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
    return result.replace(observed=f"{result.observed} [check turned off]")


