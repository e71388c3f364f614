"""
The webhook's HTTP bounds, exactly, in memory: a L{MemoryReactorClock} for
the request deadline and L{StringTransport} for the bytes (the real TLS
server is tested in C{tests/integration/test_webhook_tls.py}).

Why each check exists: a request deadline that trickling data extended, a
timer left behind after a connection closes, a body buffered past the cap,
or a connection cap that let an idle client keep a newcomer out would each
let one client hold the webhook that every pod creation waits on.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport

from hostpid.admission import service
from hostpid.admission.decision import Config
from hostpid.admission.service import MAX_BODY, WebhookChannel, WebhookMetrics, make_site

TIMEOUT = 10.0


def connect(site: service.WebhookSite, port: int = 1) -> tuple[WebhookChannel, StringTransport]:
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", port))
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport


def setup(**kwargs: Any) -> tuple[MemoryReactorClock, service.WebhookSite, WebhookMetrics]:
    clock = MemoryReactorClock()
    metrics = WebhookMetrics()
    site = make_site(Config(gate=True), timeout=TIMEOUT, reactor=clock, metrics=metrics,
                     **kwargs)
    return clock, site, metrics


def refused(metrics: WebhookMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value(
        "hostpid_webhook_refused_requests_total", {"reason": reason}) or 0.0


def review_bytes(uid: str = "u") -> bytes:
    body = json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "operation": "CREATE",
                    "object": {"metadata": {"name": "p"}, "spec": {"containers": [
                        {"name": "c", "image": "x",
                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}},
    }).encode()
    return (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


def finish(channel: WebhookChannel) -> None:
    channel.connectionLost(None)  # type: ignore[arg-type]


def test_trickled_headers_do_not_extend_the_deadline() -> None:
    clock, site, metrics = setup()
    channel, transport = connect(site)
    for byte in b"POST /mutate HTTP/1.1\r\nHost: x\r\n":
        channel.dataReceived(bytes([byte]))
        clock.advance(TIMEOUT / 40)
    assert not transport.disconnected
    clock.advance(TIMEOUT / 4)
    assert transport.disconnected and refused(metrics, "timed_out") == 1
    finish(channel)
    assert clock.getDelayedCalls() == [], "no timer outlives the connection"


def test_a_body_that_never_ends_is_aborted_at_the_deadline() -> None:
    clock, site, metrics = setup()
    channel, transport = connect(site)
    channel.dataReceived(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    clock.advance(TIMEOUT - 0.01)
    assert not transport.disconnected
    clock.advance(0.02)
    assert transport.disconnected
    finish(channel)
    assert clock.getDelayedCalls() == []


def test_a_kept_alive_connection_gets_a_whole_deadline_per_request() -> None:
    clock, site, _ = setup()
    channel, transport = connect(site)
    clock.advance(TIMEOUT - 1)
    channel.dataReceived(review_bytes("first"))
    assert b'"uid":"first"' in transport.value()
    clock.advance(TIMEOUT - 1)
    assert not transport.disconnected, "the deadline restarted with the answer"
    channel.dataReceived(review_bytes("second"))
    assert b'"uid":"second"' in transport.value()
    clock.advance(TIMEOUT + 1)
    assert transport.disconnected, "an idle kept-alive connection is closed"
    finish(channel)


def test_the_answer_is_an_allowed_review_with_a_base64_patch() -> None:
    _, site, metrics = setup()
    channel, transport = connect(site)
    channel.dataReceived(review_bytes("abc"))
    head, body = transport.value().split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 ") and b"application/json" in head
    response = json.loads(body)["response"]
    assert response["uid"] == "abc" and response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(response["patch"]))[0]["path"] == "/metadata/annotations"
    assert metrics.registry.get_sample_value(
        "hostpid_webhook_reviews_total", {"outcome": "patched"}) == 1
    finish(channel)


def test_a_declared_oversized_body_is_refused_before_any_byte_of_it() -> None:
    _, site, metrics = setup()
    channel, transport = connect(site)
    channel.dataReceived(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % (MAX_BODY + 1))
    assert transport.value().startswith(b"HTTP/1.1 413 ")
    assert channel.requests == [] or channel.requests[-1].content is None
    channel.dataReceived(b"x" * 65536)  # dropped unread
    assert refused(metrics, "too_large") == 1
    finish(channel)


def test_a_chunked_body_is_never_held_beyond_the_cap() -> None:
    _, site, metrics = setup()
    channel, transport = connect(site)
    channel.dataReceived(b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    (request,) = channel.requests
    chunk = b"y" * 65536
    for _ in range(40):
        channel.dataReceived(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert request.content.tell() <= MAX_BODY
    assert transport.value().startswith(b"HTTP/1.1 413 ")
    assert refused(metrics, "too_large") == 1
    finish(channel)


def test_malformed_json_is_a_short_400() -> None:
    _, site, metrics = setup()
    channel, transport = connect(site)
    body = b"{" * 5000
    channel.dataReceived(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
    head, text = transport.value().split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 ") and len(text) < 200
    assert refused(metrics, "bad_request") == 1
    finish(channel)


def test_a_newcomer_at_the_cap_evicts_the_oldest() -> None:
    clock = MemoryReactorClock()
    metrics = WebhookMetrics()
    site = service.WebhookSite(service.webhook_resource(Config(), metrics), metrics,
                               timeout=TIMEOUT, maxConnections=2, reactor=clock)
    first, first_transport = connect(site, 1)
    second, second_transport = connect(site, 2)
    third, third_transport = connect(site, 3)
    assert first_transport.disconnected and not second_transport.disconnected
    assert not third_transport.disconnected and refused(metrics, "evicted") == 1
    for channel in (first, second, third):
        finish(channel)
    assert clock.getDelayedCalls() == []


def test_at_the_cap_a_connection_that_completed_a_request_is_evicted_last() -> None:
    """
    The API server's kept-alive connection has completed reviews; idle
    newcomers flooding the cap evict each other, not it.
    """
    clock = MemoryReactorClock()
    metrics = WebhookMetrics()
    site = service.WebhookSite(service.webhook_resource(Config(), metrics), metrics,
                               timeout=TIMEOUT, maxConnections=2, reactor=clock)
    kept, kept_transport = connect(site, 1)
    kept.dataReceived(review_bytes("kept"))
    assert b'"uid":"kept"' in kept_transport.value()
    idle = [connect(site, port) for port in range(2, 6)]
    assert not kept_transport.disconnected
    assert [t.disconnected for _, t in idle] == [True, True, True, False]
    assert refused(metrics, "evicted") == 3
    # Only served connections left: the one served least recently goes.
    idle[-1][0].dataReceived(review_bytes("late"))
    connect(site, 9)
    assert kept_transport.disconnected and not idle[-1][1].disconnected
    for channel in (kept, *(c for c, _ in idle)):
        finish(channel)


def test_the_bodies_held_at_once_are_bounded_and_given_back() -> None:
    """
    Slow clients each stopping short of the body cap cannot together hold
    more than the site's budget for bytes past each body's first 64 KiB:
    the chunk that would pass it is answered 503, a small review is still
    answered while the budget is full, and the budget comes back when a
    connection goes or a review is answered.
    """
    clock = MemoryReactorClock()
    metrics = WebhookMetrics()
    budget = MAX_BODY
    site = service.WebhookSite(service.webhook_resource(Config(gate=True), metrics), metrics,
                               timeout=TIMEOUT, maxLarge=budget, reactor=clock)
    chunk = b"z" * 65536
    head = b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"

    def hold(channel: WebhookChannel, count: int) -> None:
        channel.dataReceived(head)
        for _ in range(count):
            channel.dataReceived(b"%x\r\n%s\r\n" % (len(chunk), chunk))

    first, first_transport = connect(site, 1)
    hold(first, 15)  # 960 KiB, short of the body cap
    second, second_transport = connect(site, 2)
    hold(second, 15)
    assert second_transport.value().startswith(b"HTTP/1.1 503 ")
    assert not first_transport.value(), "the first keeps its place"
    assert site.large <= budget and refused(metrics, "busy") == 1
    small, small_transport = connect(site, 4)
    small.dataReceived(review_bytes("small"))
    assert b'"uid":"small"' in small_transport.value(), "room kept for small bodies"
    finish(small)
    finish(second)
    assert site.buffered == 15 * len(chunk)
    finish(first)
    assert site.buffered == 0, "a lost connection gives its bytes back"
    third, third_transport = connect(site, 3)
    third.dataReceived(review_bytes("after"))
    assert b'"uid":"after"' in third_transport.value()
    assert site.buffered == 0, "an answered review gives its bytes back"
    finish(third)
