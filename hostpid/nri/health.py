"""
C{--metrics}: C{/healthz}, C{/readyz} and C{/metrics} over the HTTP bounds the
broker's and the webhook's servers share (L{hostpid.boundedhttp}): a
connection cap with the oldest evicted, a request deadline that trickled
data does not extend, C{GET}/C{HEAD} only and no body, one request per
connection, no traceback and no access log.

  - C{/healthz}: the reactor answers;
  - C{/readyz}: 200 while the plugin is registered with the runtime, 503
    otherwise (the runtime is down, restarting, or refused the plugin);
  - C{/metrics}: L{hostpid.nri.service.NRIMetrics}.
"""

from __future__ import annotations

from typing import Any, Protocol

from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request

from hostpid import defaults
from hostpid.boundedhttp import (
    BoundedChannel,
    BoundedSite,
    HealthResource,
    PrometheusResource,
    plain_text,
)
from hostpid.nri.service import NRIMetrics


class Readiness(Protocol):
    @property
    def ready(self) -> bool: ...

    socketPath: str


class ReadyResource(Resource):
    isLeaf = True

    def __init__(self, service: Readiness) -> None:
        super().__init__()
        self.service = service

    def render_GET(self, request: Request) -> bytes:
        if self.service.ready:
            return plain_text(request, 200,
                              f"ready: registered with the runtime at {self.service.socketPath}")
        return plain_text(request, 503, f"not ready: not registered with the runtime at "
                                        f"{self.service.socketPath}")


class HealthChannel(BoundedChannel):
    """No body, C{GET}/C{HEAD} only, one request per connection."""

    maxHeaders = 32
    totalHeadersSize = 8192
    allowedMethods = (b"GET", b"HEAD")
    maxBody = 0
    methodText = b"only GET and HEAD are served"

    def checkPersistence(self, request: http.Request, version: bytes) -> bool:
        request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
        return False


class HealthSite(BoundedSite):
    protocol = HealthChannel


def health_site(service: Readiness, metrics: NRIMetrics, reactor: Any = None) -> HealthSite:
    root = Resource()
    root.putChild(b"metrics", PrometheusResource(metrics.registry))
    root.putChild(b"healthz", HealthResource())
    root.putChild(b"readyz", ReadyResource(service))
    return HealthSite(root, defaults.METRICS_MAX_CONNECTIONS, defaults.METRICS_REQUEST_TIMEOUT,
                      reactor=reactor)
