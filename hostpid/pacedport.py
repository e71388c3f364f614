"""
A TCP port that accepts at a bounded pace, for the metrics ports any pod can
reach.

Twisted's C{tcp.Port.doRead} (C{twisted/internet/tcp.py}) accepts as many
connections as are waiting, up to C{numberAccepts}, which it raises by 20
each time a turn used it all: under a connect flood the reactor's one
thread does little but accept and close, and the NRI plugin's runtime
requests and the probes' listener, served by that same thread, wait behind
it (on the cluster tier a restricted pod's 15,000 connects a second made the
kubelet's exec probes fail and the plugin's container restart).  A metrics
port needs a scrape every few seconds; this one takes at most L{BATCH}
connections a turn, and after a turn that took all it could it stops
reading for L{PAUSE} seconds.  Meanwhile the kernel's backlog fills and
further connects wait in the kernel, at no cost to the process: at most
L{BATCH} / L{PAUSE} connections a second reach Python, whatever the flood.
A scrape during a flood may time out; nothing else served by the process
does.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import endpoints, tcp
from twisted.internet.defer import Deferred, execute
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from zope.interface import implementer

#: Connections accepted in one turn of the reactor, at most.
BATCH = 16
#: Seconds the port stops reading after a turn that accepted L{BATCH}.
PAUSE = 0.1


class PacedPort(tcp.Port):
    """A C{tcp.Port} that accepts at most L{BATCH} a turn and L{BATCH} / L{PAUSE} a second."""

    batch = BATCH
    pause = PAUSE
    _resume: Any = None

    def doRead(self) -> None:
        if self._resume is not None:
            return  # resting: a read already waiting when it began is left for after
        self.numberAccepts = min(self.numberAccepts, self.batch)
        super().doRead()
        # tcp.Port raised numberAccepts past what it was given: the turn
        # accepted all it could, and more may be waiting.
        if self.numberAccepts > self.batch and not self.disconnecting:
            self.numberAccepts = self.batch
            self.stopReading()
            clock: Any = self.reactor  # tcp.Port types it IReactorFDSet; it is the reactor
            self._resume = clock.callLater(self.pause, self._resumeReading)

    def _resumeReading(self) -> None:
        self._resume = None
        if self.connected and not self.disconnecting:
            self.startReading()

    def connectionLost(self, reason: Any) -> None:
        if self._resume is not None and self._resume.active():
            self._resume.cancel()
        self._resume = None
        super().connectionLost(reason)


@implementer(IStreamServerEndpoint)
class PacedTCPEndpoint:
    """
    A C{tcp:}/C{tcp6:} endpoint listening with C{portClass} (L{PacedPort} or
    a subclass): the port, backlog and interface Twisted's
    C{_TCPServerEndpoint} keeps (C{twisted/internet/endpoints.py}), listened
    on as C{PosixReactorBase.listenTCP} does.
    """

    def __init__(self, endpoint: Any, portClass: type[PacedPort] = PacedPort) -> None:
        self.endpoint = endpoint
        self.portClass = portClass

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        endpoint = self.endpoint

        def listen() -> IListeningPort:
            port = self.portClass(
                endpoint._port, protocolFactory, endpoint._backlog, endpoint._interface,
                endpoint._reactor,
            )
            port.startListening()
            return port

        return execute(listen)


def paced(endpoint: IStreamServerEndpoint,
          portClass: type[PacedPort] = PacedPort) -> IStreamServerEndpoint:
    """C{endpoint}, as a L{PacedTCPEndpoint} if it is TCP (others as they are)."""
    if isinstance(endpoint, (endpoints.TCP4ServerEndpoint, endpoints.TCP6ServerEndpoint)):
        return PacedTCPEndpoint(endpoint, portClass)
    return endpoint
