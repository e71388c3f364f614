"""
One checked transaction on a plain non-blocking socket, and the probe built
on it: what C{hostpid probe} (an exec probe, a fresh interpreter three times
per 20 s on every node) runs, so this module and what it imports load
neither C{attrs} nor Twisted, nor the standard library's C{socket},
C{enum}, C{ctypes} or C{collections} (C{tests/test_cli.py} holds the list):
each import is CPU the probe pays on every run.  L{hostpid.client.blocking}
builds the workload's query and C{doctor} on the same pieces.
"""

from __future__ import annotations

import _socket
import math
import os
import select
import time

from hostpid import defaults, wire
from hostpid.client.connect import FIRST_BACKOFF, new_socket, next_backoff, try_connect
from hostpid.client.trust import (
    DEADLINE,
    READ_ONLY_MOUNT,
    REPLY,
    SOCKET,
    CheckResult,
    HostPidUnavailable,
    Requirements,
    check_deadline,
    check_gate,
    check_peer_identity,
    host_pid_from_reply,
    inspect_layout,
    os_error_text,
)
from hostpid.ucred import PeerCredentials, peer_credentials
from hostpid.values import Value

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


class BlockingConnection:
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
                sent += self.sock.send(data[sent:], _socket.MSG_NOSIGNAL)
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


def checked_transaction(policy: Requirements) -> tuple[int, tuple[CheckResult, ...]]:
    """
    L{_transaction} past the gate: every check of C{policy} on the layout,
    the peer and the reply.  Only L{probe} starts here, since the gate is a
    workload's decision to ask, not a property of the broker.
    """
    layout = inspect_layout(policy)
    try:
        for result in layout.results:
            policy.require(result)
        connection = BlockingConnection(policy.deadline)
        try:
            connection.connect(layout.address())
            layout.close()
            try:
                credentials: PeerCredentials | OSError = peer_credentials(connection.sock)
            except OSError as error:
                credentials = error
            for verdict in check_peer_identity(
                credentials, policy.trusted_uid, layout.namespace
            ):
                policy.require(verdict)
            connection.send(wire.GET_HOST_PID_REQUEST)
            pid = host_pid_from_reply(connection.receive(wire.RESPONSE_SIZE))
            return pid, layout.results
        finally:
            connection.close()
    finally:
        layout.close()


class ProbeReport(Value):
    """
    A healthy broker, as L{probe} saw it.

    @ivar socket_path: the socket probed.
    @ivar pid: the PID the broker answered: this process's own.
    @ivar socket: the C{socket} check's verdict (type, owner UID and mode).
    @ivar gate: the gate in the probing process's environment, as information
        only: the probe ran whatever it says.
    """

    __slots__ = ("socket_path", "pid", "socket", "gate")
    socket_path: str
    pid: int
    socket: CheckResult
    gate: CheckResult

    def __init__(self, socket_path: str, pid: int, socket: CheckResult, gate: CheckResult) -> None:
        self._set(socket_path=socket_path, pid=pid, socket=socket, gate=gate)


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
    check_deadline("deadline", deadline)
    policy = Requirements(
        os.fspath(socket_path), trusted_uid=trusted_uid, deadline=deadline,
        turned_off=frozenset({READ_ONLY_MOUNT}),
    )
    gate = check_gate(environ)
    pid, results = checked_transaction(policy)
    own = os.getpid()
    if pid != own:
        raise HostPidUnavailable(
            REPLY,
            f"answered PID {pid}, not this process's PID {own} "
            "(a probe must run in the broker's PID namespace)",
        )
    (socket_result,) = (result for result in results if result.name == SOCKET)
    return ProbeReport(socket_path=policy.socket_path, pid=pid, socket=socket_result, gate=gate)
