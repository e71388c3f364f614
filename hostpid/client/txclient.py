"""
The Twisted client: L{hostpid.client.blocking}'s transaction, with the same checks
(L{hostpid.client.trust}) and the same single deadline, on a reactor, returning a
L{Deferred}.
"""

from __future__ import annotations

import _socket
import socket
from collections.abc import Callable, Mapping
from typing import Protocol as Structural

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid import wire
from hostpid.client.connect import FIRST_BACKOFF, new_socket, next_backoff, try_connect
from hostpid.client.trust import (
    CONNECT,
    DEADLINE,
    REPLY,
    STRICT,
    HostPidUnavailable,
    Layout,
    TrustPolicy,
    check_gate,
    check_peer_identity,
    check_reply,
    host_pid_from_reply,
    inspect_layout,
    os_error_text,
)
from hostpid.ucred import PeerCredentials, peer_credentials


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


_log = Logger()


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
        #: Read with the layout: the peer checks judge in the same namespace.
        self.namespace = layout.namespace
        self._reactor = reactor
        self._clock = clock
        self._sock: _socket.socket | None = None
        self._protocol: _ReplyProtocol | None = None
        self._retry: _DelayedCall | None = None
        self._deadline: _DelayedCall | None = None
        self._delay = FIRST_BACKOFF
        self._address = ""
        self._adopted = False
        self._outcome: int | Failure | None = None
        self.deferred: Deferred[int] = Deferred(lambda _: self._cancelled())

    def start(self) -> Deferred[int]:
        self._deadline = self._clock.callLater(self.policy.deadline, self._deadline_passed)
        try:
            self._address = self._layout.address()
            self._sock = new_socket()
        except OSError as error:
            self.fail(HostPidUnavailable(CONNECT, os_error_text(error)))
            return self.deferred
        self._attempt()
        return self.deferred

    def _attempt(self) -> None:
        self._retry = None
        sock = self._sock
        if sock is None:
            return
        try:
            connected = try_connect(sock, self._address)
        except HostPidUnavailable as problem:
            self.fail(problem)
            return
        if not connected:
            self._retry = self._clock.callLater(self._delay, self._attempt)
            self._delay = next_backoff(self._delay)
            return
        self._layout.close()
        factory = Factory.forProtocol(lambda: _ReplyProtocol(self))
        try:
            self._reactor.adoptStreamConnection(  # type: ignore[attr-defined]
                sock.fileno(), socket.AF_UNIX, factory
            )
        except Exception as error:
            self.fail(HostPidUnavailable(CONNECT, f"cannot adopt the connection: {error}"))
        else:
            self._adopted = True
        finally:
            sock.close()
            self._sock = None

    def connected(self, protocol: _ReplyProtocol) -> None:
        self._protocol = protocol

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self._protocol is not None:
            doing = (
                f"waiting for the reply ({len(self._protocol.buffer)} of "
                f"{wire.RESPONSE_SIZE} bytes)"
            )
        elif self._adopted:
            # Connected and handed over, but the reactor never ran the
            # connection: a MemoryReactor records adopted connections and
            # does nothing else.  Say so instead of blaming the broker.
            doing = (
                "after connecting: the reactor never started the connection it adopted "
                "(a MemoryReactor never does; use a real reactor, e.g. against "
                "hostpid.testing.FakeBroker)"
            )
        else:
            doing = "while connecting: accept queue full (EAGAIN)"
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
    The thin adapter: peer checks from the transport's handle, the request,
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
        policy = self.transaction.policy
        try:
            for verdict in check_peer_identity(
                credentials, policy.trusted_uid, self.transaction.namespace
            ):
                policy.require(verdict)
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


__all__ = ["lookup_host_pid_deferred", "query_host_pid_deferred"]
