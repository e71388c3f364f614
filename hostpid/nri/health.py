"""
C{--metrics}: C{/healthz}, C{/readyz} and C{/metrics} over the HTTP bounds the
broker's and the webhook's servers share (L{hostpid.boundedhttp}): a
connection cap with the oldest evicted, a request deadline that trickled
data does not extend, C{GET}/C{HEAD} only and no body, one request per
connection, no traceback and no access log.

  - C{/healthz}: the reactor answers, and the last look found neither host
    path this container was given removed on the host since (a restart binds
    the new one);
  - C{/readyz}: 200 once the runtime has configured the plugin (registered
    alone, it is sent no container yet) and, with the gate on, while the
    last look at the host (L{hostpid.nri.service.Adjuster.last}: the one
    before the latest GPU container's adjustment, or the periodic one) found
    the broker directory and the lock parent present and the broker
    mountpoint sound (L{hostpid.nri.hostcheck}); 503 with the reason
    otherwise (the runtime is down, restarting, refused the plugin or has
    not configured it; the host not looked at yet; a host path missing; the
    mountpoint unsafe and not repairable).  A mountpoint that cannot be
    made immutable on this node is 200 with the reason (L{degraded_because});
  - C{/metrics}: L{hostpid.nri.service.NRIMetrics}.

C{/readyz} only reports: it never looks at the host itself.  Looking repairs
(the mountpoint a tenant replaced) and logs (each repair), so a request that
looked would let anyone who reaches the port make the root plugin act on the
host and write its log at the rate it sends requests (200 requests, 69,400
bytes of log).  The looks happen at a GPU container's creation and every
C{--host-look-interval} seconds, whatever the requests.

Two sites can serve these: C{--metrics} (all three, for Prometheus) and
C{--health} (C{/healthz} and C{/readyz} only, for an exec probe over a
listener no other pod reaches, L{hostpid.nri.probe}).  Each has its own
connection cap, so a flood of the metrics port cannot evict a probe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request

from hostpid import defaults
from hostpid.boundedhttp import (
    BoundedChannel,
    BoundedSite,
    PrometheusResource,
    plain_text,
)
from hostpid.nri.hostcheck import HostState
from hostpid.nri.service import NRIMetrics


class Readiness(Protocol):
    @property
    def ready(self) -> bool: ...

    socketPath: str


def not_ready_because(service: Readiness,
                      host: Callable[[], HostState | None] | None = None) -> str | None:
    """
    Why the plugin is not ready, or None when it is.

    @param host: the last look at the host (None before the first); not
        called at all while the plugin is not configured.
    """
    if not service.ready:
        factory = getattr(service, "pluginFactory", None)
        if factory is not None and getattr(factory, "connected", False):
            return (f"registered with the runtime at {service.socketPath}, not yet "
                    "configured by it")
        return f"not registered with the runtime at {service.socketPath}"
    if host is None:
        return None
    state = host()
    if state is None:
        return "the host has not been looked at yet"
    if state.missing:
        return f"missing on the host: {' and '.join(state.missing)}"
    if state.mountpoint_problem and not state.not_immutable:
        return (f"the broker mountpoint is unsafe and cannot be repaired: "
                f"{state.mountpoint_problem}")
    return None


def degraded_because(host: Callable[[], HostState | None] | None = None) -> str | None:
    """
    Why a ready plugin gives GPU containers the lock parent alone, or None.

    A mountpoint that cannot be made immutable (the filesystem has no such
    attribute, as tmpfs before Linux 6.0; the plugin lacks
    C{CAP_LINUX_IMMUTABLE}) is a property of the node that no wait repairs.
    The plugin is still doing its whole job there, failing closed: each GPU
    container gets the lock parent and no broker mount, so HAMi-core takes
    its own slower path.  Reporting that as not ready would hold the pod out
    of Ready forever, and with it every rollout of the DaemonSet on the node
    (surge-first: the old pod waits for the new one) and any C{helm --wait},
    for no safety gained.  So C{/readyz} stays 200 and says it is degraded;
    the operator's signal is C{hostpid_nri_mountpoint_immutable} 0
    (docs/operations.md gives the alert).
    """
    if host is None:
        return None
    state = host()
    if state is None or not state.not_immutable:
        return None
    return (f"degraded: GPU containers get the lock parent alone, no broker mount: "
            f"{state.mountpoint_problem}")


class LiveResource(Resource):
    """
    C{/healthz}: the reactor answers, and the last look found no host path
    this container was given removed since (L{hostpid.nri.service.
    removed_since_mounted}): only a restart binds the host's new one.
    """

    isLeaf = True

    def __init__(self, stale: Callable[[], tuple[str, ...]] | None = None) -> None:
        super().__init__()
        self.stale = stale

    def render_GET(self, request: Request) -> bytes:
        gone = self.stale() if self.stale is not None else ()
        if gone:
            return plain_text(request, 503, f"restart me: {' and '.join(gone)} was removed on "
                                            "the host since this container started")
        return plain_text(request, 200, "ok")


class ReadyResource(Resource):
    isLeaf = True

    def __init__(self, service: Readiness,
                 host: Callable[[], HostState | None] | None = None) -> None:
        super().__init__()
        self.service = service
        self.host = host

    def render_GET(self, request: Request) -> bytes:
        why = not_ready_because(self.service, self.host)
        if why is None:
            ready = f"ready: configured by the runtime at {self.service.socketPath}"
            degraded = degraded_because(self.host)
            if degraded is not None:
                ready = f"{ready}; {degraded}"
            return plain_text(request, 200, ready)
        return plain_text(request, 503, f"not ready: {why}")


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


def health_site(service: Readiness, metrics: NRIMetrics | None, reactor: Any = None,
                host: Callable[[], HostState | None] | None = None,
                stale: Callable[[], tuple[str, ...]] | None = None) -> HealthSite:
    """
    @param metrics: served at C{/metrics}; None for the probes' site.
    @param host: the last look at the host (L{hostpid.nri.service.Adjuster.last}),
        never a new one; None with the gate off, when the host's state
        changes nothing.
    @param stale: the host paths the last look found removed since mounted.
    """
    root = Resource()
    if metrics is not None:
        root.putChild(b"metrics", PrometheusResource(metrics.registry))
    root.putChild(b"healthz", LiveResource(stale))
    root.putChild(b"readyz", ReadyResource(service, host))
    return HealthSite(root, defaults.METRICS_MAX_CONNECTIONS, defaults.METRICS_REQUEST_TIMEOUT,
                      reactor=reactor)
