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

from hostpid.admission.decision import clip
from hostpid.nri import api_pb2
from hostpid.nri.decision import (
    ADJUSTED,
    ERROR,
    MOUNTPOINT_UNSAFE,
    OVERSIZED,
    REASONS,
    SHADOWED,
    Config,
    Decision,
    qualify,
    to_adjustment,
)
from hostpid.nri.decision import adjust as adjust_decision
from hostpid.nri.hostcheck import HostCheck, HostState
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
        self.repairs = Counter(
            "hostpid_nri_mountpoint_repairs", "Broker mountpoints (<lock parent>/hostpid) "
            "found replaced (a file, a symlink, another's directory) and repaired before an "
            "adjustment.", registry=self.registry)
        self.host_ready = Gauge(
            "hostpid_nri_host_ready", "1 while the broker directory and the lock parent exist "
            "and the broker mountpoint is sound (as last looked at).", registry=self.registry)
        self.immutable = Gauge(
            "hostpid_nri_mountpoint_immutable", "1 while the broker mountpoint carries the "
            "immutable attribute, which no tenant can rename, remove or replace whatever the "
            "lock parent's mode (as last looked at); 0 where it cannot be set: GPU containers "
            "then get the lock parent alone (mountpoint_unsafe).", registry=self.registry)


def _describe(request: api_pb2.CreateContainerRequest) -> dict[str, str]:
    """
    The log fields naming the container: each clipped (L{clip}, the
    webhook's bound), since the runtime passes on whatever names the pod
    spec chose (one CreateContainer with megabyte names wrote 3.9 MB of log).
    """
    return {
        "namespace": clip(request.pod.namespace),
        "pod": clip(request.pod.name),
        "container": clip(request.container.name),
        "container_id": clip(request.container.id[:12]),
    }


#: Characters kept of a decision's detail in a log line: it quotes a mount's
#: source and destination, which the pod spec chose.
MAX_DETAIL = 512


def _bounded_detail(detail: str) -> str:
    if len(detail) <= MAX_DETAIL:
        return detail
    return f"{detail[:MAX_DETAIL]}...({len(detail):,} characters)"


def removed_since_mounted(paths: tuple[str, ...]) -> tuple[str, ...]:
    """
    Those of C{paths} that are directories with no link left: removed on the
    host since they were bind-mounted here.  The chart's pod mounts the lock
    parent and the broker directory themselves, so when the host removes one
    and makes it again (an operator, a C{/tmp} cleaner, a preparation), this
    container still sees the removed one, and a look at it would say nothing
    of what the runtime will mount.  A restart of the container binds the
    new one.
    """
    gone = []
    for path in paths:
        try:
            if os.stat(path).st_nlink == 0:
                gone.append(path)
        except OSError:
            pass  # missing: the presence look says so
    return tuple(gone)


@implementer(IAdjuster)
class Adjuster:
    """
    The decision, with the host looked at, metrics and logs.

    @param host: looks at the host before the adjustment of a qualifying
        container (L{HostCheck}: the broker directory and the lock parent
        exist, the broker mountpoint is a directory of the trusted UID or is
        repaired).  Only a qualifying container costs the look.
    @param broker_present: for tests: replaces the presence look with this
        callable, and the mountpoint is taken as sound.
    """

    log = Logger()

    def __init__(self, config: Config, metrics: NRIMetrics,
                 broker_present: Callable[[], bool] | None = None,
                 timer: Callable[[], float] = time.perf_counter,
                 host: HostCheck | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.host = host or HostCheck(config.lock_parent, config.broker_dir)
        self._present = broker_present
        self.timer = timer
        #: What the host looked like last (L{_observe} logs each change once).
        self.last: HostState | None = None
        #: The host paths the last look found removed since they were mounted
        #: here (L{removed_since_mounted}): counted missing, and C{/healthz}
        #: fails so that the kubelet restarts the container.
        self.stale: tuple[str, ...] = ()

    def look(self) -> HostState:
        """The host's state now, each change logged once (L{HostCheck.check})."""
        if self._present is not None:
            present = self._present()
            state = HostState(missing=() if present else (self.config.broker_dir,),
                              immutable=present)
        else:
            self.stale = removed_since_mounted((self.config.broker_dir, self.config.lock_parent))
            state = HostState(missing=self.stale) if self.stale else self.host.check()
        self._observe(state)
        return state

    def _observe(self, state: HostState) -> None:
        for repair in state.repairs:
            self.metrics.repairs.inc()
            self.log.warn(
                "hostpid-nri: repaired the broker mountpoint {mountpoint}: found a {found} "
                "owned by UID {owner_uid} (mode {mode:04o}); {action}",
                mountpoint=f"{self.config.lock_parent}/hostpid", found=repair.found,
                owner_uid=repair.owner_uid, mode=repair.mode, action=repair.action)
        if state.made:
            self.log.info("hostpid-nri: made the broker mountpoint {mountpoint}",
                          mountpoint=f"{self.config.lock_parent}/hostpid")
        previous, self.last = self.last, state
        self.metrics.host_ready.set(0 if state.missing or state.mountpoint_problem else 1)
        self.metrics.immutable.set(1 if state.immutable else 0)
        if previous is not None and previous.missing == state.missing and (
                previous.mountpoint_problem == state.mountpoint_problem) and (
                previous.repair_failure == state.repair_failure):
            return
        was_missing = previous.missing if previous is not None else ()
        if state.missing and self.stale:
            self.log.warn(
                "hostpid-nri: {missing} removed on the host since this container started: "
                "GPU containers are created without the broker until it is restarted (its "
                "/healthz fails, the kubelet restarts it and binds the host's new one)",
                missing=" and ".join(self.stale), paths=list(self.stale))
        elif state.missing:
            self.log.warn(
                "hostpid-nri: {missing} missing on the host: GPU containers are created "
                "without the broker until it exists (prepare the lock parent with "
                "`hostpid prepare-lock-parent` or the broker's --cdi-dir, docs/nri.md)",
                missing=" and ".join(state.missing), paths=list(state.missing))
        elif was_missing:
            self.log.info("hostpid-nri: the broker directory and the lock parent exist again")
        if state.mountpoint_problem:
            self.log.warn(
                "hostpid-nri: the broker mountpoint is unsafe and cannot be repaired: "
                "{problem}{failure_note}; GPU containers get the lock parent only, no broker",
                problem=state.mountpoint_problem, failure=state.repair_failure,
                failure_note=f" ({state.repair_failure})" if state.repair_failure else "")
        elif state.repair_failure:
            self.log.warn(
                "hostpid-nri: the lock parent cannot be prepared ({failure}); its broker "
                "mountpoint is sound, GPU containers still get the broker",
                failure=state.repair_failure)
        elif previous is not None and (previous.mountpoint_problem or previous.repair_failure) \
                and not state.missing:
            self.log.info("hostpid-nri: the broker mountpoint is sound again")

    def adjust(self, request: api_pb2.CreateContainerRequest) -> api_pb2.ContainerAdjustment:
        started = self.timer()
        try:
            qualified = qualify(request.pod, request.container, self.config)
            if isinstance(qualified, Decision):
                decision = qualified
            else:
                state = self.look()
                decision = adjust_decision(
                    request.container, self.config, qualified,
                    broker_present=state.broker_present,
                    mountpoint_problem=state.mountpoint_problem)
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
        detail = _bounded_detail(decision.detail)
        if decision.reason == ADJUSTED:
            self.log.info(
                "hostpid-nri: {namespace}/{pod} container {container}: broker mounts and gate "
                "added ({detail})", detail=detail, **_describe(request))
        elif decision.reason in (SHADOWED, MOUNTPOINT_UNSAFE, OVERSIZED):
            self.log.warn(
                "hostpid-nri: {namespace}/{pod} container {container}: {reason}: {detail}",
                reason=decision.reason, detail=detail, **_describe(request))
        elif decision.detail:
            self.log.debug(
                "hostpid-nri: {namespace}/{pod} container {container}: {reason}: {detail}",
                reason=decision.reason, detail=detail, **_describe(request))


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
    def connected(self) -> bool:
        """A connection is registered with the runtime."""
        return self.current is not None and self.current.registered and not self.current.closed

    @property
    def ready(self) -> bool:
        """
        Registered, and configured by the runtime: it calls C{Configure} after
        the registration, and sends containers only after that (the
        C{Synchronize} that follows).  Registered alone, the plugin adjusts
        nothing yet.
        """
        return self.connected and bool(getattr(self.current, "configured", False))

    def registered(self, protocol: Any) -> None:
        self.current = protocol
        self.backoff.reset()
        self.metrics.registered.set(1)
        self.metrics.connections.labels("registered").inc()

    def disconnected(self, protocol: Any, was_registered: bool) -> None:
        self.forget(protocol, was_registered)
        self.log.info("hostpid-nri: disconnected from the runtime{after}; reconnecting",
                      after=" after registration" if was_registered else "")

    def forget(self, protocol: Any, was_registered: bool) -> None:
        """The connection C{protocol} ended: no longer registered; counted if it never was."""
        if self.current is protocol:
            self.current = None
            self.metrics.registered.set(0)
        if not was_registered:
            self.metrics.connections.labels("dropped").inc()


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
