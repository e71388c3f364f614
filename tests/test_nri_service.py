"""
The plugin's lifecycle pieces (L{hostpid.nri.service}), in memory.

Why each check exists:

- L{Adjuster}: the decision raising gives an empty adjustment, an C{error}
  count and a log line (never an error to the runtime, which would fail
  the container); each decision is counted by reason and timed; the broker
  directory is looked at on each decision (it can appear after the plugin
  starts).
- L{Backoff}: doubles to its cap with bounded jitter and is reset only by a
  registration, so a runtime that accepts and closes at once is retried at
  a falling rate, never in a loop.
- L{PluginFactory}: readiness follows the registered connection.
"""

from __future__ import annotations

import pytest
from nrilib import gpu_container, pod
from twisted.internet.testing import MemoryReactorClock

from hostpid.nri import api_pb2, service
from hostpid.nri.decision import Config
from hostpid.nri.service import Adjuster, Backoff, NRIMetrics, PluginFactory


def sample(metrics: NRIMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("hostpid_nri_containers_total", {"reason": reason})
    assert value is not None
    return value


def test_adjuster_counts_and_adjusts() -> None:
    metrics = NRIMetrics()
    present = [False]
    adjuster = Adjuster(Config(gate=True), metrics, broker_present=lambda: present[0])
    request = api_pb2.CreateContainerRequest(pod=pod(), container=gpu_container())
    assert adjuster.adjust(request) == api_pb2.ContainerAdjustment()
    assert sample(metrics, "broker_absent") == 1
    present[0] = True
    assert len(adjuster.adjust(request).mounts) == 2
    assert sample(metrics, "adjusted") == 1
    count = metrics.registry.get_sample_value("hostpid_nri_decision_seconds_count")
    assert count == 2


def test_adjuster_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the decision")

    monkeypatch.setattr(service, "qualify", broken)
    metrics = NRIMetrics()
    adjuster = Adjuster(Config(gate=True), metrics, broker_present=lambda: True)
    request = api_pb2.CreateContainerRequest(pod=pod(), container=gpu_container())
    assert adjuster.adjust(request) == api_pb2.ContainerAdjustment()
    assert sample(metrics, "error") == 1


def test_backoff_grows_caps_and_resets_on_registration() -> None:
    backoff = Backoff(initial=0.5, maximum=30.0, random=lambda: 1.0)
    delays = [backoff(1) for _ in range(10)]
    assert delays[:4] == pytest.approx([0.55, 1.1, 2.2, 4.4])
    assert max(delays) == pytest.approx(33.0)
    backoff.reset()
    assert backoff(7) == pytest.approx(0.55)
    jittered = Backoff(random=lambda: 0.0)
    assert jittered(1) == 0.5


def test_factory_readiness() -> None:
    metrics = NRIMetrics()
    factory = PluginFactory(Adjuster(Config(), metrics), MemoryReactorClock(), metrics,
                            Backoff())
    protocol = factory.buildProtocol(None)
    assert not factory.ready
    factory.backoff(1)
    factory.backoff(2)
    protocol.registered = True  # type: ignore[attr-defined]
    factory.registered(protocol)
    # Registered, not yet configured: not ready (the runtime sends nothing yet).
    assert factory.connected and not factory.ready and factory.backoff.failures == 0
    protocol.configured = True  # type: ignore[attr-defined]
    assert factory.ready
    assert metrics.registry.get_sample_value("hostpid_nri_registered") == 1
    factory.disconnected(protocol, True)
    assert not factory.ready
    assert metrics.registry.get_sample_value("hostpid_nri_registered") == 0
