"""
The metrics server's limits, exactly: the real L{MetricsSite} and its
channels on L{StringTransport}s with a L{MemoryReactorClock}, so the cap,
the request deadline and the refusals are checked to the second and the byte.
(tests/integration/test_metrics_limits.py attacks a real broker's port.)
"""

from __future__ import annotations

from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import LogLevel, globalLogPublisher
from twisted.web.resource import Resource

from hostpid import defaults
from hostpid.broker.metrics import HealthResource, MetricsChannel, MetricsSite

PEER = IPv4Address("TCP", "127.0.0.1", 40000)


class _Transport(StringTransport):
    aborted = False

    def abortConnection(self) -> None:
        self.aborted = True
        self.loseConnection()


def site(clock: MemoryReactorClock | None = None) -> MetricsSite:
    root = Resource()
    root.putChild(b"healthz", HealthResource())
    return MetricsSite(root, reactor=clock or MemoryReactorClock())


def connect(server: MetricsSite) -> tuple[MetricsChannel, _Transport]:
    channel = server.buildProtocol(PEER)
    assert channel is not None
    transport = _Transport()
    channel.makeConnection(transport)
    return channel, transport


def test_at_the_cap_a_newcomer_evicts_the_oldest() -> None:
    """
    Every slot held (idle, slow or keep-alive clients): a newcomer takes the
    oldest one's slot, which is aborted unanswered, so a probe always gets
    in.  (Before eviction the newcomer was refused instead,
    and 16 keep-alive clients kept every probe out.)
    """
    server = site()
    held = [connect(server) for _ in range(defaults.METRICS_MAX_CONNECTIONS)]
    assert server.counts.open == defaults.METRICS_MAX_CONNECTIONS == 16
    probe, probeTransport = connect(server)
    assert held[0][1].aborted and held[0][1].value() == b""
    assert not any(transport.aborted for _, transport in held[1:])
    assert server.counts.evicted == 1 and server.counts.overLimit == 0
    held[0][0].dataReceived(b"GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n")
    assert held[0][1].value() == b"", "an evicted connection is never answered"
    probe.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n")
    assert probeTransport.value().startswith(b"HTTP/1.1 200 ")
    connect(server)
    assert held[1][1].aborted, "then the next oldest"
    held[0][0].connectionLost(None)  # type: ignore[arg-type]  # the reactor, a turn later
    assert server.counts.open == 16 + 2 - 1, "held, the probe and one more, less one closed"


def test_request_deadline_is_not_extended_by_trickling_data() -> None:
    clock = MemoryReactorClock()
    server = site(clock)
    channel, transport = connect(server)
    for byte in b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 100:
        clock.advance(defaults.METRICS_REQUEST_TIMEOUT / 30)
        channel.dataReceived(bytes([byte]))
        if transport.aborted:
            break
    assert transport.aborted, "aborted within the deadline although data kept coming"
    assert server.counts.timedOut == 1
    assert transport.value() == b""


def test_every_response_closes_the_connection() -> None:
    """No keep-alive: a client cannot hold its slot by polling on one connection."""
    server = site()
    channel, transport = connect(server)
    channel.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n")
    response = transport.value()
    assert response.startswith(b"HTTP/1.1 200 ")
    assert b"\r\nConnection: close\r\n" in response
    assert transport.disconnecting, "closed after one response"


def test_idle_connection_is_closed_after_the_deadline() -> None:
    clock = MemoryReactorClock()
    server = site(clock)
    channel, transport = connect(server)
    clock.advance(defaults.METRICS_REQUEST_TIMEOUT - 0.01)
    assert not transport.aborted
    clock.advance(0.02)
    assert transport.aborted


def test_timeout_logs_nothing() -> None:
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        clock = MemoryReactorClock()
        channel, transport = connect(site(clock))
        clock.advance(defaults.METRICS_REQUEST_TIMEOUT + 1)
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert transport.aborted
    assert [e for e in events if e.get("log_level", LogLevel.info) >= LogLevel.info] == []


def test_announced_body_is_refused_before_a_content_buffer_exists() -> None:
    server = site()
    channel, transport = connect(server)
    channel.dataReceived(b"POST /healthz HTTP/1.1\r\nHost: b\r\nContent-Length: 209715200\r\n\r\n")
    assert transport.value().startswith(b"HTTP/1.1 413 Content Too Large\r\n")
    assert transport.disconnecting
    (request,) = channel.requests
    assert request.content is None, "Request.gotLength was never called: no buffer, no file"
    channel.dataReceived(b"x" * 1_000_000)  # dropped, not parsed, not kept
    assert server.counts.body == 1


def test_chunked_body_is_refused() -> None:
    channel, transport = connect(site())
    channel.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: b\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert transport.value().startswith(b"HTTP/1.1 413 ")


def test_other_methods_get_405_and_are_not_dispatched() -> None:
    server = site()
    channel, transport = connect(server)
    channel.dataReceived(b"DELETE /healthz HTTP/1.1\r\nHost: b\r\n\r\n")
    reply = transport.value()
    assert reply.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")
    assert b"\r\nAllow: GET, HEAD\r\n" in reply
    assert b"ok" not in reply
    assert transport.disconnecting
    assert server.counts.method == 1


def test_empty_content_length_is_served() -> None:
    channel, transport = connect(site())
    channel.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: b\r\nContent-Length: 0\r\n\r\n")
    assert transport.value().startswith(b"HTTP/1.1 200 ")


def test_a_failing_resource_is_one_log_line_not_a_traceback() -> None:
    class Broken(Resource):
        isLeaf = True

        def render_GET(self, request: object) -> bytes:
            raise RuntimeError("scrape failed")

    root = Resource()
    root.putChild(b"metrics", Broken())
    server = MetricsSite(root, reactor=MemoryReactorClock())
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        for _ in range(3):
            channel, transport = connect(server)
            channel.dataReceived(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert transport.value().startswith(b"HTTP/1.0 500 ")
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert not any("log_failure" in e for e in events), "no traceback"
    failed = [e for e in events if "metrics request" in e.get("log_format", "")]
    assert len(failed) == 2, "the 1st and 2nd of 3 (powers of two)"
    assert server.counts.failed == 3
