"""
L{hostpid.pacedport}: the metrics ports' accept pace, on a real listening
socket with real connections; the reactor is a C{MemoryReactorClock}, so
each turn of the port is one C{doRead} made here and the pause is the
clock's.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from twisted.internet import endpoints
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock

from hostpid.broker.metricsport import shared
from hostpid.pacedport import BATCH, PAUSE, PacedPort, PacedTCPEndpoint, paced

#: Connections waiting at once: three turns' worth and some.
WAITING = 3 * BATCH + 5


class Counting(Factory):
    def __init__(self) -> None:
        self.built = 0

    def buildProtocol(self, addr: object) -> Protocol:
        self.built += 1
        return Protocol()


@pytest.fixture
def listening() -> Iterator[tuple[MemoryReactorClock, PacedPort, Counting]]:
    reactor = MemoryReactorClock()
    factory = Counting()
    port = PacedPort(0, factory, 128, "127.0.0.1", reactor)
    port.startListening()
    yield reactor, port, factory
    port.stopListening()
    reactor.advance(0)


@contextmanager
def flood(port: PacedPort, count: int) -> Iterator[None]:
    """C{count} connections made to C{port}, waiting in its backlog, closed after."""
    address = port.getHost()
    clients = []
    try:
        for _ in range(count):
            clients.append(socket.create_connection((address.host, address.port), timeout=5))
        yield
    finally:
        for client in clients:
            client.close()


def test_a_flood_is_accepted_a_batch_a_pause(
        listening: tuple[MemoryReactorClock, PacedPort, Counting]) -> None:
    reactor, port, factory = listening
    with flood(port, WAITING):
        assert port in reactor.readers
        port.doRead()
        assert factory.built == BATCH, "one batch a turn, however many wait"
        assert port not in reactor.readers, "then the port rests"
        reactor.advance(PAUSE / 2)
        assert port not in reactor.readers
        reactor.advance(PAUSE / 2)
        assert port in reactor.readers, "and reads again after the pause"
        port.doRead()
        port.doRead()  # the reactor would not call it now; if it did, nothing more is taken
        assert factory.built == 2 * BATCH
        reactor.advance(PAUSE)
        port.doRead()
        assert factory.built == 3 * BATCH
        reactor.advance(PAUSE)
        port.doRead()
        assert factory.built == WAITING, "the rest, fewer than a batch"
        assert port in reactor.readers, "a turn that took less than a batch does not rest"


def test_a_few_connections_are_accepted_at_once(
        listening: tuple[MemoryReactorClock, PacedPort, Counting]) -> None:
    reactor, port, factory = listening
    with flood(port, 3):
        port.doRead()
        assert factory.built == 3
        assert port in reactor.readers and not reactor.getDelayedCalls()


def test_stopping_while_resting_cancels_the_resume(
        listening: tuple[MemoryReactorClock, PacedPort, Counting]) -> None:
    reactor, port, factory = listening
    with flood(port, BATCH + 1):
        port.doRead()
        assert len(reactor.getDelayedCalls()) == 1
        port.stopListening()
        reactor.advance(0)
        assert not [c for c in reactor.getDelayedCalls() if c.active()]
        assert port not in reactor.readers


def test_tcp_endpoints_are_paced_others_are_not() -> None:
    reactor = MemoryReactorClock()
    tcp = endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1")
    assert isinstance(paced(tcp), PacedTCPEndpoint)
    unix = endpoints.serverFromString(reactor, "unix:/nonexistent/metrics.sock")
    assert paced(unix) is unix
    # The broker's metrics port: shared with a newer broker, and paced.
    broker = shared(tcp)
    assert isinstance(broker, PacedTCPEndpoint) and issubclass(broker.portClass, PacedPort)
