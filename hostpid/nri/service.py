"""
The plugin's lifecycle: the decision wired to metrics and logs, the
connection kept up, readiness.

  - L{Adjuster}: L{hostpid.nri.decision.decide} with the broker directory
    looked at, timed, counted and logged; whatever goes wrong (the decision
    raising, a decision slower than L{DECISION_BUDGET}) is an empty
    adjustment and a log line, never an error to the runtime.
  - L{Backoff}: the reconnection delay.  It grows with every connection
    that ends without a registration, and is reset only by a registration,
    not by a connection: a runtime that accepts and closes at once, again
    and again, is reconnected to at a bounded rate (Twisted's
    C{ClientService} counts a made connection as a success and would retry
    it after its first delay forever).
  - L{NRIPluginService}: Twisted's C{ClientService} over the Unix socket
    with that backoff; ready while a connection is registered.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from twisted.application.internet import ClientService
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from hostpid.nri import api_pb2
from hostpid.nri.decision import (
    ADJUSTED,
    ERROR,
    REASONS,
    SHADOWED,
    Config,
    Decision,
    decide,
    to_adjustment,
)
from hostpid.nri.plugin import (
    DEFAULT_INDEX,
    REGISTRATION_TIMEOUT,
    IAdjuster,
    IRegistrationObserver,
    NRIPluginProtocol,
)

#: A decision is a few dozen microseconds; one slower than this (a stalled
#: C{stat} of the broker directory, a pathological container) is still
#: answered, but logged: the runtime's request timeout is 2 s, and the
#: answer must stay well under it.
DECISION_BUDGET = 0.1
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0)

#: Reconnection delays, seconds: from the first to the cap, doubling.  The cap
#: bounds how long after a runtime restart containers go unadjusted (a few
#: seconds of downtime cost at most one delay of 10 s more) and how often a
#: runtime that closes at once is retried (once in 10 s).
BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 10.0


class NRIMetrics:
    """This plugin's own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter(
            "hostpid_nri_containers", "CreateContainer requests answered, per reason "
            "(adjusted, unchanged, or the reason the container was skipped).",
            ["reason"], registry=self.registry)
        for reason in REASONS:
            self.decisions.labels(reason)
        self.latency = Histogram(
            "hostpid_nri_decision_seconds",
            "Time to decide one CreateContainer (decode to encode excluded).",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registered = Gauge(
            "hostpid_nri_registered", "1 while the plugin is registered with the runtime.",
            registry=self.registry)
        self.connections = Counter(
            "hostpid_nri_connections", "Connections to the runtime's NRI socket, per end "
            "(registered: the runtime accepted the registration; dropped: closed before).",
            ["outcome"], registry=self.registry)
        for outcome in ("registered", "dropped"):
            self.connections.labels(outcome)


def _describe(request: api_pb2.CreateContainerRequest) -> dict[str, str]:
    return {
        "namespace": request.pod.namespace,
        "pod": request.pod.name,
        "container": request.container.name,
        "container_id": request.container.id[:12],
    }


@implementer(IAdjuster)
class Adjuster:
    """
    The decision, with the broker directory's presence, metrics and logs.

    @param broker_present: looks at the host: both host paths the mounts
        name (the broker directory and the lock parent) are directories.  A
        bind mount of a missing source fails the container's creation, so
        without them the container is left as it is.  Injected for tests.
    """

    log = Logger()

    def __init__(self, config: Config, metrics: NRIMetrics,
                 broker_present: Callable[[], bool] | None = None,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.metrics = metrics
        self.broker_present = broker_present or (
            lambda: os.path.isdir(config.broker_dir) and os.path.isdir(config.lock_parent))
        self.timer = timer

    def adjust(self, request: api_pb2.CreateContainerRequest) -> api_pb2.ContainerAdjustment:
        started = self.timer()
        try:
            decision = decide(request.pod, request.container, self.config,
                              broker_present=self.broker_present())
            adjustment = to_adjustment(decision)
        except Exception:
            self.metrics.decisions.labels(ERROR).inc()
            self.log.failure("hostpid-nri: {namespace}/{pod} container {container}: the "
                             "decision failed; the container is created unadjusted",
                             Failure(), **_describe(request))  # type: ignore[arg-type]
            return api_pb2.ContainerAdjustment()
        elapsed = self.timer() - started
        self.metrics.latency.observe(elapsed)
        self.metrics.decisions.labels(decision.reason).inc()
        self._log(request, decision, elapsed)
        return adjustment

    def _log(self, request: api_pb2.CreateContainerRequest, decision: Decision,
             elapsed: float) -> None:
        if elapsed > DECISION_BUDGET:
            self.log.warn("hostpid-nri: a decision took {elapsed:.3f} s (budget {budget} s)",
                          elapsed=elapsed, budget=DECISION_BUDGET)
        if decision.reason == ADJUSTED:
            self.log.info(
                "hostpid-nri: {namespace}/{pod} container {container}: broker mounts and gate "
                "added ({detail})", detail=decision.detail, **_describe(request))
        elif decision.reason == SHADOWED:
            self.log.warn(
                "hostpid-nri: {namespace}/{pod} container {container}: not adjusted: {detail}",
                detail=decision.detail, **_describe(request))
        elif decision.detail:
            self.log.debug(
                "hostpid-nri: {namespace}/{pod} container {container}: {reason}: {detail}",
                reason=decision.reason, detail=decision.detail, **_describe(request))


@attrs.define
class Backoff:
    """
    Reconnection delays: L{initial} doubling to L{maximum}, with up to 10 %
    jitter; reset only by L{reset} (a registration).
    """

    initial: float = BACKOFF_INITIAL
    maximum: float = BACKOFF_MAX
    random: Callable[[], float] = random.random
    failures: int = 0

    def __call__(self, attempt: int) -> float:
        """C{ClientService}'s retry policy; its own attempt count is ignored."""
        self.failures += 1
        delay = min(self.initial * (2 ** min(self.failures - 1, 30)), self.maximum)
        return delay * (1 + 0.1 * self.random())

    def reset(self) -> None:
        self.failures = 0


@implementer(IRegistrationObserver)
class PluginFactory(Factory):
    """Builds one L{NRIPluginProtocol} per connection and keeps readiness."""

    log = Logger()
    noisy = False

    def __init__(self, adjuster: IAdjuster, clock: IReactorTime, metrics: NRIMetrics,
                 backoff: Backoff, index: str = DEFAULT_INDEX,
                 registration_timeout: float = REGISTRATION_TIMEOUT) -> None:
        self.adjuster = adjuster
        self.clock = clock
        self.metrics = metrics
        self.backoff = backoff
        self.index = index
        self.registration_timeout = registration_timeout
        self.current: NRIPluginProtocol | None = None

    def buildProtocol(self, addr: Any) -> Protocol:
        protocol = NRIPluginProtocol(self.adjuster, self.clock, index=self.index,
                                     observer=self,
                                     registration_timeout=self.registration_timeout)
        protocol.factory = self
        return protocol

    @property
    def ready(self) -> bool:
        return self.current is not None and self.current.registered and not self.current.closed

    def registered(self, protocol: Any) -> None:
        self.current = protocol
        self.backoff.reset()
        self.metrics.registered.set(1)
        self.metrics.connections.labels("registered").inc()

    def disconnected(self, protocol: Any, was_registered: bool) -> None:
        if self.current is protocol:
            self.current = None
            self.metrics.registered.set(0)
        if not was_registered:
            self.metrics.connections.labels("dropped").inc()
        self.log.info("hostpid-nri: disconnected from the runtime{after}; reconnecting",
                      after=" after registration" if was_registered else "")


class NRIPluginService(ClientService):
    """The connection kept up: Twisted's C{ClientService} with L{Backoff}."""

    def __init__(self, endpoint: IStreamClientEndpoint, factory: PluginFactory,
                 clock: IReactorTime, socket_path: str = "") -> None:
        super().__init__(endpoint, factory, retryPolicy=factory.backoff, clock=clock)
        self.pluginFactory = factory
        self.socketPath = socket_path

    @property
    def ready(self) -> bool:
        return self.pluginFactory.ready
