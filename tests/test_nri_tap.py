"""
C{twistd hostpid-nri}'s options and its health endpoints, in memory.

Why each check exists:

- A wrong option is a usage error before anything starts: an index that is
  not two digits (NRI refuses it at registration, which would leave the
  plugin reconnecting forever), a signal kind that is not one of the
  unforgeable ones, a registration timeout out of range, a bad endpoint.
- The defaults are the contract's (C{/var/run/nri/nri.sock}, index 90,
  C{nvidia.com/gpu}) and the gate is read from the plugin's environment.
- C{/readyz} follows the registration; C{/metrics} serves the plugin's own
  registry; the HTTP bounds are the shared ones (no body, GET and HEAD only).
- C{/readyz} reports the plugin's last look at the host and never looks
  itself (a look repairs and logs: requests must not make the root plugin
  act on the host); the C{--health} site, the exec probe's, has no
  C{/metrics} and its own listener.
"""

from __future__ import annotations

import pytest
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python import usage

from hostpid.nri.decision import PRESETS, Signal
from hostpid.nri.health import health_site
from hostpid.nri.service import NRIMetrics
from hostpid.nri.tap import DEFAULT_SOCKET, Options, config_from, makeService


def parse(*argv: str) -> Options:
    options = Options()
    options.parseOptions(list(argv))
    return options


def test_defaults() -> None:
    options = parse()
    assert options["nri-socket"] == DEFAULT_SOCKET == "/var/run/nri/nri.sock"
    assert options["plugin-index"] == "90"
    config = config_from(options, {"LIBVGPU_HOSTPID_BROKER": "1"})
    assert config.signals == PRESETS["nvidia.com/gpu"] and config.gate
    assert not config_from(options, {"LIBVGPU_HOSTPID_BROKER": "1 "}).gate


def test_resources_replace_the_default() -> None:
    options = parse("--resource", "device:/dev/dri/renderD*", "--resource", "cdi:amd.com/gpu",
                    "--resource", "cdi:amd.com/gpu")
    assert config_from(options, {}).signals == (
        Signal("device", "/dev/dri/renderD*"), Signal("cdi", "amd.com/gpu"))


@pytest.mark.parametrize("argv", [
    ["--plugin-index", "9"], ["--plugin-index", "100"], ["--plugin-index", "a1"],
    ["--resource", "env:NVIDIA_VISIBLE_DEVICES"], ["--resource", "amd.com/gpu"],
    ["--registration-timeout", "0"], ["--registration-timeout", "61"],
    ["--registration-timeout", "soon"], ["--nri-socket", ""],
    ["--metrics", "nonsense:1"], ["--health", "nonsense:1"],
    ["--host-look-interval", "0"], ["--host-look-interval", "3601"],
    ["--host-look-interval", "often"],
])
def test_usage_errors(argv: list[str]) -> None:
    with pytest.raises(usage.UsageError):
        parse(*argv)


def test_service_builds() -> None:
    service = makeService(parse("--metrics", "tcp:0:interface=127.0.0.1"))
    names = [type(child).__name__ for child in service]  # type: ignore[attr-defined]
    assert names == ["NRIPluginService", "HealthEndpointService"]
    service = makeService(parse("--metrics", "tcp:0:interface=127.0.0.1",
                                "--health", "tcp:0:interface=127.0.0.1"))
    names = [type(child).__name__ for child in service]  # type: ignore[attr-defined]
    assert names == ["NRIPluginService", "HealthEndpointService", "HealthEndpointService"]


class Ready:
    def __init__(self) -> None:
        self.ready = False
        self.socketPath = "/run/nri/nri.sock"


def get(site: object, request: bytes) -> bytes:
    channel = site.buildProtocol(None)  # type: ignore[attr-defined]
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(request)
    return transport.value()


def test_health_endpoints() -> None:
    readiness = Ready()
    metrics = NRIMetrics()
    site = health_site(readiness, metrics, reactor=MemoryReactorClock())
    assert get(site, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
    answer = get(site, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 503") and b"not registered" in answer
    readiness.ready = True
    assert get(site, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
    answer = get(site, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b'hostpid_nri_containers_total{reason="adjusted"} 0.0' in answer
    assert get(site, b"POST /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n") \
        .startswith(b"HTTP/1.1 405")
    assert get(site, b"GET /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n") \
        .startswith(b"HTTP/1.1 413")


def test_readyz_reports_the_last_look_and_never_looks() -> None:
    from hostpid.nri.hostcheck import HostState

    readiness = Ready()
    readiness.ready = True
    looks: list[HostState | None] = [None]
    site = health_site(readiness, None, reactor=MemoryReactorClock(), host=lambda: looks[-1])
    answer = get(site, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 503") and b"not been looked at yet" in answer
    looks.append(HostState(mountpoint_problem="/tmp/vgpulock/hostpid is a symlink"))
    answer = get(site, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 503") and b"is a symlink" in answer
    # A node whose /tmp cannot carry the immutable attribute: ready (no wait
    # repairs it, and not ready would hold the DaemonSet's rollout there), saying why.
    looks.append(HostState(mountpoint_problem="/tmp/vgpulock/hostpid cannot be made immutable: "
                           "tmpfs has no such attribute before Linux 6.0",
                           not_immutable="tmpfs has no such attribute before Linux 6.0"))
    answer = get(site, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert b"degraded: GPU containers get the lock parent alone" in answer
    assert b"before Linux 6.0" in answer
    looks.append(HostState())
    answer = get(site, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and b"degraded" not in answer
    # The probes' site: no /metrics.
    assert get(site, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 404")


def test_the_service_gives_readyz_the_last_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    makeService wires /readyz to the adjuster's last look, never to a look
    (the service is not started: nothing here touches the host).
    """
    from hostpid.nri.health import ReadyResource
    from hostpid.nri.hostcheck import HostState

    monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "1")
    service = makeService(parse("--health", "tcp:0:interface=127.0.0.1"),
                          reactor=MemoryReactorClock())
    children = {type(c).__name__: c for c in service}  # type: ignore[attr-defined]
    adjuster = children["TimerService"].call[0].__self__
    ready = children["HealthEndpointService"].factory.resource.children[b"readyz"]
    assert isinstance(ready, ReadyResource) and ready.host is not None
    assert ready.host() is None
    adjuster.last = seen = HostState(missing=("/tmp/vgpulock",))
    assert ready.host() is seen
