"""
C{--metrics}: the endpoint string parsed, and the service that listens on it.

Imported only when the option is given: Twisted's endpoints module and the
application services it comes with cost about 45 ms of every start, which a
broker without a metrics server, and the first answer after its restart,
need not wait for.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.application.internet import StreamServerEndpointService
from twisted.internet import endpoints, tcp
from twisted.internet.defer import Deferred, execute
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from zope.interface import implementer

from hostpid.broker.fsrules import BrokerStartupError


def _reason(error: BaseException) -> str:
    """An exception as the end of a one-line message."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def parse_metrics_endpoint(description: str, reactor: Any = None) -> IStreamServerEndpoint:
    """
    Parse C{--metrics} without listening (C{serverFromString} only builds the
    endpoint), so that a mistyped value is a usage error before anything is
    created.

    @raise BrokerStartupError: naming the option and what is wrong (its one
        line comes from L{refuse_in_one_line}).
    """
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
    try:
        return endpoints.serverFromString(reactor, description)
    except Exception as e:
        raise BrokerStartupError(
            f"--metrics {description!r}",
            f"not a Twisted server endpoint string ({_reason(e)}); for example "
            "tcp:9394:interface=127.0.0.1",
        ) from None


class _SharedPort(tcp.Port):
    """A TCP port bound with C{SO_REUSEPORT}."""

    def createInternetSocket(self) -> socket.socket:
        sock = super().createInternetSocket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        return sock


@implementer(IStreamServerEndpoint)
class SharedTCPEndpoint:
    """
    A C{tcp:}/C{tcp6:} endpoint whose port a newer broker can bind while
    this one still listens (C{SO_REUSEPORT}; Linux lets only sockets of the
    same effective UID, root here, share it).  A reload starts the new
    broker, its metrics server first, while the old one serves: without
    this, the new one's listen would fail with C{EADDRINUSE} and the reload
    with it.  A port held by any other program still fails the listen.

    It reads the port, backlog and interface Twisted's
    C{_TCPServerEndpoint} keeps (C{twisted/internet/endpoints.py}) and
    listens as C{PosixReactorBase.listenTCP} does, with the option set.
    """

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        endpoint = self.endpoint

        def listen() -> IListeningPort:
            port = _SharedPort(
                endpoint._port, protocolFactory, endpoint._backlog, endpoint._interface,
                endpoint._reactor,
            )
            port.startListening()
            return port

        return execute(listen)


def shared(endpoint: IStreamServerEndpoint) -> IStreamServerEndpoint:
    """C{endpoint}, as a L{SharedTCPEndpoint} if it is TCP (others as they are)."""
    if isinstance(endpoint, (endpoints.TCP4ServerEndpoint, endpoints.TCP6ServerEndpoint)):
        return SharedTCPEndpoint(endpoint)
    return endpoint


class MetricsEndpointService(StreamServerEndpointService):
    """
    The metrics server's listening service.  A failed listen raises at once
    (twistd binds it in C{privilegedStartService}, before the broker creates
    anything) as a L{BrokerStartupError} naming C{--metrics}, whatever the
    endpoint raised (C{CannotListenError}, or an C{OSError} from a C{unix:}
    endpoint's lock file).
    """

    _raiseSynchronously = True

    def __init__(
        self, description: str, endpoint: IStreamServerEndpoint, factory: IProtocolFactory
    ) -> None:
        super().__init__(shared(endpoint), factory)
        self.description = description

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except Exception as e:
            raise BrokerStartupError(
                f"--metrics {self.description}", f"the metrics endpoint cannot listen: {_reason(e)}"
            ) from None
