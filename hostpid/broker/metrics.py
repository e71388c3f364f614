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
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

import hostpid
from hostpid.broker.descriptors import DescriptorMode
from hostpid.broker.server import LATENCY_BUCKETS, Outcome
from hostpid.broker.service import BrokerService


class BrokerCollector:
    """A Prometheus collector over one L{BrokerService}."""

    def __init__(self, broker: BrokerService) -> None:
        self.broker = broker

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
            "(SO_PEERCRED alone), -1 before the first caller.",
            -1 if supported is None else int(supported),
        )
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
            "Passed descriptors waiting for, or in, a close on the background closer's threads.",
            passed.closer.pending if passed is not None else 0,
        )
        resource_errors = broker.port.resourceErrors if broker.port is not None else 0
        errors = CounterMetricFamily(
            "hostpid_broker_accept_resource_errors",
            "Accept attempts that failed for lack of descriptors or memory (then backed off).",
        )
        errors.add_metric([], resource_errors)
        yield errors
        info = GaugeMetricFamily(
            "hostpid_broker_build_info", "Build information.", labels=["version"]
        )
        info.add_metric([hostpid.__version__], 1)
        yield info

    @staticmethod
    def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, documentation, value=value)


class MetricsResource(Resource):
    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)


def _text(request: Request, code: int, body: str) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    return (body + "\n").encode("utf-8")


class HealthResource(Resource):
    """C{/healthz}: answering at all means the reactor is running."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return _text(request, 200, "ok")


class ReadyResource(Resource):
    """C{/readyz}: whether workloads can be served right now."""

    isLeaf = True

    def __init__(self, broker: BrokerService) -> None:
        super().__init__()
        self.broker = broker

    def render_GET(self, request: Request) -> bytes:
        broker = self.broker
        if not broker.enabled:
            return _text(
                request, 200,
                "ready: broker disabled (LIBVGPU_HOSTPID_BROKER is not exactly 1); "
                "workloads use their existing discovery path",
            )
        if broker.ready():
            return _text(request, 200, f"ready: listening on {broker.socketPath}")
        problem = broker.socketPathProblem() if broker.listening else None
        return _text(request, 503, f"not ready: {broker.socketPath}: {problem or 'not listening'}")


class _QuietSite(Site):
    """A Site without access logs: probes every few seconds would drown the broker's log."""

    def log(self, request: http.Request) -> None:
        pass


def metrics_site(broker: BrokerService) -> Site:
    """The HTTP site for C{--metrics}: /metrics, /healthz, /readyz."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BrokerCollector(broker))
    root = Resource()
    root.putChild(b"metrics", MetricsResource(registry))
    root.putChild(b"healthz", HealthResource())
    root.putChild(b"readyz", ReadyResource(broker))
    site = _QuietSite(root)
    site.displayTracebacks = False
    site.noisy = False
    return site

