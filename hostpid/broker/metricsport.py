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
from twisted.internet import endpoints
from twisted.internet.interfaces import IProtocolFactory, IStreamServerEndpoint

from hostpid.broker.fsrules import BrokerStartupError
from hostpid.pacedport import PacedPort, paced


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


class _SharedPort(PacedPort):
    """
    A metrics port bound with C{SO_REUSEPORT}, accepting at a bounded pace
    (L{hostpid.pacedport}: a connect flood on the port any pod can reach
    must not take the reactor from the broker's callers).
    """

    def createInternetSocket(self) -> socket.socket:
        sock = super().createInternetSocket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        return sock


def shared(endpoint: IStreamServerEndpoint) -> IStreamServerEndpoint:
    """
    C{endpoint}, if it is TCP, on a port a newer broker can bind while this
    one still listens (C{SO_REUSEPORT}; Linux lets only sockets of the same
    effective UID, root here, share it), and paced.  A reload starts the new
    broker, its metrics server first, while the old one serves: without
    this, the new one's listen would fail with C{EADDRINUSE} and the reload
    with it.  A port held by any other program still fails the listen.
    Other endpoints are as they are.
    """
    return paced(endpoint, _SharedPort)


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
