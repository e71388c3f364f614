"""
The bounds hostpid's HTTP servers keep whatever a client does.

The broker's metrics and health server (L{hostpid.broker.metrics}) and the
webhook's AdmissionReview server (L{hostpid.admission.service}) each run
beside work that must not wait on one of their clients (the broker's
transactions; every pod creation in the cluster), so both put the same
limits around Twisted's HTTP/1.1 parser:

  - a connection cap, a newcomer at the cap evicting the oldest connection
    that has not completed a request, before any that has (L{BoundedSite}):
    idle or slow clients holding every slot cannot keep a probe, or the API
    server, out, nor push out the API server's kept-alive connection;
  - a request deadline that received data does not push back
    (L{BoundedChannel}): a client trickling bytes holds its slot for the
    site's timeout at most;
  - refusal before buffering: a body the server does not take, or a method
    it does not serve, is answered from the headers alone, before Twisted
    creates the request's content buffer (in memory, or a temporary file on
    disk), and whatever the client sends after is dropped unread;
  - no request makes the server log a traceback or an access-log line.

What differs stays with each server, as class attributes and the counting
hooks of its subclasses: the methods it serves, the body it takes, its
header limits, keep-alive, and the names its refusals are counted and
logged under.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.internet.interfaces import IAddress
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

#: Reason phrases of the answers the channel writes itself, below Twisted's
#: request machinery.
REASONS = {
    400: b"Bad Request",
    405: b"Method Not Allowed",
    413: b"Content Too Large",
    503: b"Service Unavailable",
}


def plain_text(request: Request, code: int, body: str) -> bytes:
    """A short plain-text answer: C{body} and a newline, with its length."""
    data = body.encode("utf-8") + b"\n"
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    request.setHeader(b"content-length", b"%d" % (len(data),))
    return data


class HealthResource(Resource):
    """C{/healthz}: answering at all means the reactor is running."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return plain_text(request, 200, "ok")


def internal_error(request: Request) -> None:
    """
    Answer a plain C{500} and finish: what a failed request gets instead of
    Twisted's traceback page (the caller logs what it wants to).
    """
    body = b"internal error\n"
    request.setResponseCode(http.INTERNAL_SERVER_ERROR)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    request.setHeader(b"content-length", b"%d" % (len(body),))
    request.write(body)
    request.finish()


class PrometheusResource(Resource):
    """A registry in the Prometheus text format, read at scrape time."""

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)


class BoundedChannel(http.HTTPChannel):
    """
    One connection: Twisted's HTTP/1.1 parser with the request deadline and
    the refusals before buffering.

      - The request deadline: C{TimeoutMixin}'s timer is armed at connect
        and again after each response (Twisted does both), but received data
        does not push it back (L{resetTimeout} does nothing), so a client
        trickling one byte at a time cannot hold its slot longer than the
        site's timeout.  When it fires the connection is aborted, counted,
        and not logged.
      - Refusals before buffering: Twisted creates a request's content
        buffer in C{allHeadersReceived} (C{Request.gotLength}: memory below
        100 kB, a temporary file above, which fails with a traceback on a
        read-only root).  L{allHeadersReceived} decides first, from the
        headers: a body longer than L{maxBody} (or any chunked body when
        L{maxBody} is 0) gets 413, a method not in L{allowedMethods} 405, and
        the connection is closed with whatever else the client sends dropped
        unread.
    """

    #: The methods served; any other is answered 405 before its body is
    #: read.  None: every method reaches the resources.
    allowedMethods: tuple[bytes, ...] | None = None
    #: The longest body a request may announce.  0: no body at all, so a
    #: chunked one is refused too; above 0 a chunked body is left to the
    #: request to bound as it arrives.
    maxBody = 0
    #: The text of the 413 and the 405 answers.
    tooLargeText = b"a request body is not accepted"
    methodText = b"this method is not served"

    site: BoundedSite
    _refused = False

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.forget(self)
        super().connectionLost(reason)

    def requestDone(self, request: http.Request) -> None:
        """A request was answered: this connection is a client's, not a squatter's."""
        super().requestDone(request)
        self.site.served(self)

    def abort(self) -> None:
        """Close at once, unanswered, and read nothing more."""
        self._refused = True
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def resetTimeout(self) -> None:
        """Data does not extend the request deadline (see the class docstring)."""

    def timeoutConnection(self) -> None:
        """Abort, counted, without Twisted's per-connection "Timing out client" log line."""
        self.site.countTimeout()
        self.abort()

    def dataReceived(self, data: bytes) -> None:
        if not self._refused:
            super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        length = self.length  # None for a chunked body
        if (length is None and self.maxBody == 0) or (
            length is not None and length > self.maxBody
        ):
            self.refuse(413, self.tooLargeText)
        elif self.allowedMethods is not None and self._command not in self.allowedMethods:
            self.refuse(405, self.methodText)
        else:
            super().allHeadersReceived()

    def refuse(self, code: int, text: bytes) -> None:
        """
        Answer C{code} and close; whatever else the client sends is dropped
        unread.  C{length} is set to None so that Twisted's C{lineReceived},
        when it called us, switches to raw mode instead of dispatching the
        request.
        """
        if self._refused:
            return
        self.site.countRefusal(code)
        self._refused = True
        self.length = None
        body = text + b"\n"
        headers = [
            b"HTTP/1.1 %d %s" % (code, REASONS[code]),
            b"Content-Type: text/plain; charset=utf-8",
            b"Content-Length: %d" % (len(body),),
            b"Connection: close",
        ]
        if code == 405 and self.allowedMethods is not None:
            headers.append(b"Allow: " + b", ".join(self.allowedMethods))
        assert self.transport is not None
        self.transport.write(b"\r\n".join(headers) + b"\r\n\r\n" + body)
        # HTTPChannel's own close: it unregisters the channel as the
        # transport's producer first, without which a TLS transport would
        # not shut down until the client left or the deadline fired.
        self.loseConnection()


class BoundedSite(Site):
    """
    A site holding at most C{maxConnections} connections.

    At the cap a newcomer takes the slot of the oldest connection that has
    not yet completed a request, which is aborted unanswered: an attacker
    holding every slot with idle or slow connections cannot keep a newcomer
    out, only a client reconnecting C{maxConnections} times per newcomer's
    round trip can.  A connection that has completed a request (the API
    server's, kept alive between reviews; a Prometheus scraper's) is evicted
    only when every slot is held by such connections, the one served least
    recently first: when the oldest was taken whatever it was, a flood of
    idle connections dropped the API server's connection with its reviews in
    flight.  The evicted
    descriptor closes on the next reactor turn, so at most one accept batch
    more than the cap is ever open; clients still in the kernel's accept
    queue hold no descriptor of the server's.

    A subclass names its channel (L{protocol}) and request factory and
    counts its refusals under its own names in the C{count*} hooks.
    """

    protocol = BoundedChannel  # type: ignore[assignment]
    displayTracebacks = False
    noisy = False

    def __init__(
        self, resource: Resource, maxConnections: int, timeout: float, reactor: Any = None
    ) -> None:
        super().__init__(resource, timeout=timeout, reactor=reactor)
        self.maxConnections = maxConnections
        #: Connections holding a slot that have completed no request, oldest first.
        self._fresh: OrderedDict[BoundedChannel, None] = OrderedDict()
        #: Connections that have completed a request, least recently served first.
        self._served: OrderedDict[BoundedChannel, None] = OrderedDict()

    @property
    def connections(self) -> int:
        """Connections holding a slot now."""
        return len(self._fresh) + len(self._served)

    def buildProtocol(self, addr: IAddress) -> BoundedChannel | None:  # type: ignore[override]
        if self.connections >= self.maxConnections:
            if self._fresh:
                victim, _ = self._fresh.popitem(last=False)
            elif self._served:
                victim, _ = self._served.popitem(last=False)
            else:
                self.countOverLimit()
                return None
            victim.abort()
            self.countEviction()
        channel = super().buildProtocol(addr)
        assert isinstance(channel, BoundedChannel)
        self._fresh[channel] = None
        return channel

    def served(self, channel: BoundedChannel) -> None:
        """C{channel} completed a request: it is evicted after every fresh one."""
        if channel in self._fresh or channel in self._served:
            self._fresh.pop(channel, None)
            self._served.pop(channel, None)
            self._served[channel] = None

    def forget(self, channel: BoundedChannel) -> None:
        """C{channel} is closed: its slot is free."""
        self._fresh.pop(channel, None)
        self._served.pop(channel, None)

    def log(self, request: http.Request) -> None:
        """No access log: probes every few seconds, or every pod creation, would drown it."""

    def countOverLimit(self) -> None:
        """A connection was closed at accept: no slot could be freed (a cap of 0)."""

    def countEviction(self) -> None:
        """The oldest connection was closed for a newcomer at the cap."""

    def countTimeout(self) -> None:
        """A connection was aborted at the request deadline."""

    def countRefusal(self, code: int) -> None:
        """A request was answered C{code} by the channel, before any resource saw it."""
