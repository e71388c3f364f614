"""
Metrics and health over HTTP, for operators and probes.

  - C{/metrics}: the Prometheus text format, produced by C{prometheus-client}
    from a collector that reads the broker's own counters at scrape time, so
    the transaction hot path pays nothing for metrics beyond the counts it
    keeps anyway;
  - C{/healthz}: the process is alive (the reactor answers);
  - C{/readyz}: 200 only while the socket is listening and its path still
    has the identity of the socket the broker created; with the gate off the
    broker is ready (it has nothing to serve) and says so in the body.

The server runs in the broker's process and reactor, so it must never take
what the broker needs (the bounds shared with the webhook are in
L{hostpid.boundedhttp}): it holds at most
L{defaults.METRICS_MAX_CONNECTIONS} connections, a newcomer at the cap
evicting the oldest (L{MetricsSite}); each request must arrive whole within
L{defaults.METRICS_REQUEST_TIMEOUT}; only C{GET} and C{HEAD} are served, and
a request that announces a body is answered 413 before Twisted would buffer
that body (in memory, or in a temporary file on disk); no request makes it
log a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request

import hostpid
from hostpid import defaults
from hostpid.boundedhttp import (
    BoundedChannel,
    BoundedSite,
    HealthResource,
    PrometheusResource,
    internal_error,
    plain_text,
)
from hostpid.broker.descriptors import DescriptorMode
from hostpid.broker.port import PAUSE_RESOURCES
from hostpid.broker.server import LATENCY_BUCKETS, Outcome
from hostpid.broker.service import BrokerService
from hostpid.peercred import LivenessCheck


class BrokerCollector:
    """A Prometheus collector over one L{BrokerService}."""

    def __init__(self, broker: BrokerService, server: MetricsServerCounts | None = None) -> None:
        self.broker = broker
        self.server = server if server is not None else MetricsServerCounts()

    def collect(self) -> Iterator[Metric]:
        broker = self.broker
        factory = broker.factory
        transactions = CounterMetricFamily(
            "hostpid_broker_transactions",
            "Transactions by outcome.",
            labels=["outcome"],
        )
        for outcome in Outcome:
            count = factory.counts[outcome] if factory is not None else 0
            transactions.add_metric([outcome.label], count)
        yield transactions

        latency = HistogramMetricFamily(
            "hostpid_broker_transaction_seconds",
            "Accept-to-reply latency of answered transactions (an answer given at accept is "
            "observed with the duration of its accept batch, an upper bound).",
        )
        if factory is not None:
            cumulative, buckets = 0, []
            for bound, count in zip(
                [*map(str, LATENCY_BUCKETS), "+Inf"], factory.latency.counts, strict=True
            ):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric([], buckets, factory.latency.total)
        else:
            latency.add_metric([], [("+Inf", 0)], 0.0)
        yield latency

        yield self._gauge(
            "hostpid_broker_active_connections",
            "Transactions in progress on the general path.",
            factory.active if factory is not None else 0,
        )
        yield self._gauge(
            "hostpid_broker_max_connections",
            "Configured limit of active transactions.",
            broker.maxConnections,
        )
        yield self._gauge(
            "hostpid_broker_enabled",
            "1 when LIBVGPU_HOSTPID_BROKER is exactly 1.",
            int(broker.enabled),
        )
        yield self._gauge(
            "hostpid_broker_listening",
            "1 while the broker socket is listening with its original identity.",
            int(broker.ready()),
        )
        supported = factory.identifier.pidfdSupported if factory is not None else None
        yield self._gauge(
            "hostpid_broker_pidfd_check",
            "1 when callers are verified with SO_PEERPIDFD, 0 when the kernel lacks it "
            "(see hostpid_broker_liveness_check for what is used instead), -1 before the "
            "first caller.",
            -1 if supported is None else int(supported),
        )
        check = factory.identifier.check if factory is not None else None
        liveness = GaugeMetricFamily(
            "hostpid_broker_liveness_check",
            "1 for the check in force that the process that connected still owns its PID: "
            "peerpidfd (SO_PEERPIDFD, Linux 6.5+), pidfd_open (older kernels: the PID looked "
            "up again and its start time compared with the accept) or none (pidfd_open "
            "refused: SO_PEERCRED alone); all 0 before the first caller.",
            labels=["check"],
        )
        for kind in LivenessCheck:
            liveness.add_metric([kind.value], int(kind is check))
        yield liveness
        mode = broker.port.descriptorMode if broker.port is not None else None
        passing = GaugeMetricFamily(
            "hostpid_broker_descriptor_passing",
            "1 for the mode in force for descriptors clients pass: refused (SO_PASSRIGHTS=0, "
            "the kernel refuses them) or received (no SO_PASSRIGHTS: received and disposed of).",
            labels=["mode"],
        )
        for candidate in DescriptorMode:
            passing.add_metric([candidate.value], int(candidate is mode))
        yield passing
        passed = factory.passed if factory is not None else None
        yield self._gauge(
            "hostpid_broker_passed_descriptors_closing",
            "Passed descriptors waiting for, or in, a close by the disposer process.",
            passed.closer.pending if passed is not None else 0,
        )
        yield self._counter(
            "hostpid_broker_closes_interrupted",
            "Closes of passed descriptors (or of connections carrying them) that the watchdog "
            "cut short with a signal, because they would have held a broker thread.",
            passed.closer.interrupted if passed is not None else 0,
        )
        yield self._gauge(
            "hostpid_broker_closes_stuck",
            "Disposer processes abandoned in a close that ignores signals and still alive, plus "
            "broker threads inside such a close for 2 s or more.",
            passed.closer.stuck if passed is not None else 0,
        )
        yield self._counter(
            "hostpid_broker_reads_without_room",
            "Reads made by peeking first, because the descriptor table or the background "
            "closer lacked room for a full SCM_RIGHTS message.",
            passed.withoutRoom if passed is not None else 0,
        )
        port = broker.port
        paused = GaugeMetricFamily(
            "hostpid_broker_accept_paused",
            "1 while accepting is paused, by reason: resources (EMFILE/ENFILE/ENOBUFS/ENOMEM). "
            "Passed descriptors never pause accepting.",
            labels=["reason"],
        )
        for label, reason in (("resources", PAUSE_RESOURCES),):
            paused.add_metric([label], int(port is not None and port.pauseReason == reason))
        yield paused
        resource_errors = broker.port.resourceErrors if broker.port is not None else 0
        yield self._counter(
            "hostpid_broker_accept_resource_errors",
            "Accept attempts that failed for lack of descriptors or memory (then backed off).",
            resource_errors,
        )
        yield self._counter(
            "hostpid_broker_mountpoint_events",
            "Times the broker mountpoint <lock parent>/hostpid went missing or was replaced "
            "while the broker served (a root workload's rmdir detaches the broker mount in "
            "every running container).",
            broker.mountpointWatch.events,
        )
        yield self._gauge(
            "hostpid_broker_metrics_connections",
            "Connections the metrics server holds now "
            f"(at most {defaults.METRICS_MAX_CONNECTIONS}).",
            self.server.open,
        )
        refused = CounterMetricFamily(
            "hostpid_broker_metrics_refused",
            "Metrics connections or requests refused: evicted (the oldest, closed for a "
            "newcomer at the cap), over_limit (closed at accept: no slot could be freed), "
            "timed_out (no whole request in time), method (405), body (413), failed (500).",
            labels=["reason"],
        )
        for reason, count in self.server.refusals().items():
            refused.add_metric([reason], count)
        yield refused
        info = GaugeMetricFamily(
            "hostpid_broker_build_info", "Build information.", labels=["version"]
        )
        info.add_metric([hostpid.__version__], 1)
        yield info

    @staticmethod
    def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, documentation, value=value)

    @staticmethod
    def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(name, documentation, value=value)


class ReadyResource(Resource):
    """C{/readyz}: whether workloads can be served right now."""

    isLeaf = True

    def __init__(self, broker: BrokerService) -> None:
        super().__init__()
        self.broker = broker

    def render_GET(self, request: Request) -> bytes:
        broker = self.broker
        if not broker.enabled:
            return plain_text(
                request, 200,
                "ready: broker disabled (LIBVGPU_HOSTPID_BROKER is not exactly 1); "
                "workloads use their existing discovery path",
            )
        if broker.ready():
            return plain_text(request, 200, f"ready: listening on {broker.socketPath}")
        problem = broker.servingProblem() if broker.listening else None
        return plain_text(
            request, 503, f"not ready: {broker.socketPath}: {problem or 'not listening'}"
        )


@attrs.define
class MetricsServerCounts:
    """What the metrics server holds and has refused, for the collector and the log."""

    open: int = 0
    overLimit: int = 0
    evicted: int = 0
    timedOut: int = 0
    method: int = 0
    body: int = 0
    failed: int = 0

    def refusals(self) -> dict[str, int]:
        return {
            "over_limit": self.overLimit,
            "evicted": self.evicted,
            "timed_out": self.timedOut,
            "method": self.method,
            "body": self.body,
            "failed": self.failed,
        }


#: Methods the server answers; any other is refused with 405.
ALLOWED_METHODS = (b"GET", b"HEAD")


def _rateLimited(count: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... occurrence only: any client behaviour, a bounded log."""
    return count & (count - 1) == 0


class MetricsChannel(BoundedChannel):
    """
    One metrics connection: the shared bounds (L{BoundedChannel}: the
    request deadline of L{defaults.METRICS_REQUEST_TIMEOUT}, refusals before
    buffering) with the broker's policy.

      - One request per connection: every response says C{Connection:
        close} and the connection ends with it, so no client can hold a slot
        with keep-alive requests (16 keep-alive clients polling every 5 s
        held the server for as long as they liked, and a liveness probe
        failing three times restarts the broker).
      - No body at all: a request that announces one (any C{Content-Length}
        but 0, or C{Transfer-Encoding}) gets 413; any method but
        C{GET}/C{HEAD} gets 405.
    """

    maxHeaders = 32
    totalHeadersSize = 8192
    allowedMethods = ALLOWED_METHODS
    maxBody = 0
    tooLargeText = b"a request body is not accepted"
    methodText = b"only GET and HEAD are served"

    site: MetricsSite

    def connectionMade(self) -> None:
        self.site.counts.open += 1
        super().connectionMade()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.counts.open -= 1
        super().connectionLost(reason)

    def checkPersistence(self, request: http.Request, version: bytes) -> bool:
        """Never persistent: C{Connection: close} on every response (see the class docstring)."""
        request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
        return False


class MetricsRequest(Request):
    """A request whose failure is one rate-limited log line and a plain 500, never a traceback."""

    logger = Logger()

    def processingFailed(self, reason: Failure) -> Failure:
        counts: MetricsServerCounts = getattr(self.site, "counts", MetricsServerCounts())
        counts.failed += 1
        if _rateLimited(counts.failed):
            self.logger.error(
                "hostpid-broker: metrics request {path} failed: {error} (failures so far: {count})",
                path=self.path.decode("ascii", "replace"),
                error=reason.getErrorMessage(),
                count=counts.failed,
            )
        internal_error(self)
        return reason


class MetricsSite(BoundedSite):
    """
    The metrics server's factory: at most C{maxConnections} connections, a
    newcomer at the cap evicting the oldest (L{BoundedSite}; the broker's
    own rule for its transactions), counted in L{MetricsServerCounts} and
    logged at a bounded rate.
    """

    protocol = MetricsChannel
    requestFactory = MetricsRequest
    logger = Logger()

    def __init__(
        self,
        resource: Resource,
        counts: MetricsServerCounts | None = None,
        maxConnections: int = defaults.METRICS_MAX_CONNECTIONS,
        timeout: float = defaults.METRICS_REQUEST_TIMEOUT,
        reactor: Any = None,
    ) -> None:
        super().__init__(resource, maxConnections, timeout, reactor=reactor)
        self.counts = counts if counts is not None else MetricsServerCounts()

    def countOverLimit(self) -> None:
        self.counts.overLimit += 1

    def countEviction(self) -> None:
        counts = self.counts
        counts.evicted += 1
        if _rateLimited(counts.evicted):
            self.logger.warn(
                "hostpid-broker: metrics server at its limit of {limit} connections; "
                "closed the oldest for a new one (so far: {count})",
                limit=self.maxConnections, count=counts.evicted,
            )

    def countTimeout(self) -> None:
        self.counts.timedOut += 1

    def countRefusal(self, code: int) -> None:
        if code == 413:
            self.counts.body += 1
        elif code == 405:
            self.counts.method += 1


def metrics_site(broker: BrokerService, reactor: Any = None) -> MetricsSite:
    """The HTTP site for C{--metrics}: /metrics, /healthz, /readyz."""
    counts = MetricsServerCounts()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BrokerCollector(broker, counts))
    root = Resource()
    root.putChild(b"metrics", PrometheusResource(registry))
    root.putChild(b"healthz", HealthResource())
    root.putChild(b"readyz", ReadyResource(broker))
    return MetricsSite(root, counts, reactor=reactor)

