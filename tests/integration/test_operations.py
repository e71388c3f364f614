"""
Operations: metrics and health over real HTTP (treq against the real server,
the real broker moving the counters), systemd readiness over a real datagram
socket, and JSON-lines logs from a real twistd.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_twisted  # type: ignore[import-untyped]
import treq
from prometheus_client.parser import text_string_to_metric_families
from support import TWISTD, BrokerProcess, ask_pid, exchange, subprocess_env, wait_for
from treq.testing import StubTreq
from twisted.internet.defer import gatherResults, maybeDeferred
from twisted.internet.threads import deferToThread

from hostpid import wire
from hostpid.broker.metrics import HealthResource, ReadyResource, metrics_site
from hostpid.broker.service import LIVENESS_ENV, BrokerService

ENABLED = {"LIBVGPU_HOSTPID_BROKER": "1"}


class Running:
    """A real broker service and its real metrics site, in this reactor."""

    def __init__(self, broker: BrokerService, base: str) -> None:
        self.broker = broker
        self.base = base

    async def get(self, path: str) -> tuple[int, str]:
        response = await treq.get(self.base + path, persistent=False)
        return response.code, await treq.text_content(response)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        code, body = await self.get("/metrics")
        assert code == 200
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body)
            for sample in family.samples
        }


@pytest_twisted.async_yield_fixture
async def running(tmp_path: Path, clean_reactor: None) -> AsyncIterator[Running]:
    async for value in _running(tmp_path, ENABLED):
        yield value


@pytest_twisted.async_yield_fixture
async def forced_pidfd_open(tmp_path: Path, clean_reactor: None) -> AsyncIterator[Running]:
    async for value in _running(tmp_path, {**ENABLED, LIVENESS_ENV: "pidfd_open"}):
        yield value


@pytest_twisted.async_yield_fixture
async def disabled(tmp_path: Path, clean_reactor: None) -> AsyncIterator[Running]:
    async for value in _running(tmp_path, {}):
        yield value


async def _running(tmp_path: Path, environ: dict[str, str]) -> AsyncIterator[Running]:
    from twisted.internet import reactor

    fatal: list[None] = []
    broker = BrokerService(
        directory=str(tmp_path / "broker"),
        reactor=reactor,
        environ=environ,
        onFatal=lambda: fatal.append(None),
        watchInterval=3600,  # readiness is judged on request, not by the watch
    )
    broker.startService()
    port = reactor.listenTCP(0, metrics_site(broker), interface="127.0.0.1")
    try:
        yield Running(broker, f"http://127.0.0.1:{port.getHost().port}")
    finally:
        await port.stopListening()
        await maybeDeferred(broker.stopService)


def ok_count(metrics: dict) -> float:
    return metrics[("hostpid_broker_transactions_total", (("outcome", "ok"),))]


@pytest_twisted.ensureDeferred
async def test_counters_move_with_real_traffic(running: Running) -> None:
    socket_path = running.broker.socketPath
    before = await running.metrics()
    pids = await gatherResults([deferToThread(ask_pid, socket_path) for _ in range(5)])
    assert pids == [os.getpid()] * 5
    reply = await deferToThread(exchange, socket_path, b"HPID\x00\x01\x00\x09")
    assert reply == wire.INVALID_REQUEST_RESPONSE
    after = await running.metrics()
    assert ok_count(after) == ok_count(before) + 5
    assert after[("hostpid_broker_transactions_total", (("outcome", "invalid"),))] == 1
    assert after[("hostpid_broker_transaction_seconds_count", ())] == ok_count(after)
    assert after[("hostpid_broker_transaction_seconds_bucket", (("le", "+Inf"),))] == 5
    assert after[("hostpid_broker_max_connections", ())] == 512
    assert after[("hostpid_broker_enabled", ())] == 1
    assert after[("hostpid_broker_listening", ())] == 1
    assert after[("hostpid_broker_pidfd_check", ())] == 1
    assert after[("hostpid_broker_liveness_check", (("check", "peerpidfd"),))] == 1
    assert after[("hostpid_broker_liveness_check", (("check", "pidfd_open"),))] == 0
    assert after[("hostpid_broker_active_connections", ())] == 0
    assert ("hostpid_broker_build_info", (("version", "0.1.0"),)) in after


@pytest_twisted.ensureDeferred
async def test_the_liveness_check_in_force_is_named(forced_pidfd_open: Running) -> None:
    """Forced to the older kernels' check: named from the start, and callers still answered."""
    before = await forced_pidfd_open.metrics()
    checks = {"peerpidfd": 0, "pidfd_open": 1, "none": 0}
    for check, value in checks.items():
        assert before[("hostpid_broker_liveness_check", (("check", check),))] == value
    assert before[("hostpid_broker_pidfd_check", ())] == 0
    assert await deferToThread(ask_pid, forced_pidfd_open.broker.socketPath) == os.getpid()
    after = await forced_pidfd_open.metrics()
    assert ok_count(after) == 1
    assert after[("hostpid_broker_liveness_check", (("check", "pidfd_open"),))] == 1


@pytest_twisted.ensureDeferred
async def test_active_connections_gauge_counts_a_silent_client(running: Running) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await deferToThread(sock.connect, running.broker.socketPath)
        metrics = await running.metrics()  # the broker accepted it before serving HTTP
        assert metrics[("hostpid_broker_active_connections", ())] == 1
    finally:
        sock.close()


@pytest_twisted.ensureDeferred
async def test_evicted_outcome_is_counted(running: Running) -> None:
    """Every slot held by a silent client: the next one evicts the oldest."""
    limit = running.broker.factory.maxConnections
    running.broker.factory.maxConnections = 2
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    try:
        for sock in socks:
            await deferToThread(sock.connect, running.broker.socketPath)
        metrics = await running.metrics()  # the broker accepted them before serving HTTP
        assert metrics[("hostpid_broker_transactions_total", (("outcome", "evicted"),))] == 1
        assert metrics[("hostpid_broker_active_connections", ())] == 2
        assert await deferToThread(socks[0].recv, 64) == b"", "the oldest, closed"
    finally:
        running.broker.factory.maxConnections = limit
        for sock in socks:
            sock.close()


@pytest_twisted.ensureDeferred
async def test_healthz(running: Running) -> None:
    assert await running.get("/healthz") == (200, "ok\n")


@pytest_twisted.ensureDeferred
async def test_readyz_while_listening(running: Running) -> None:
    code, body = await running.get("/readyz")
    assert code == 200
    assert f"listening on {running.broker.socketPath}" in body


@pytest_twisted.ensureDeferred
async def test_readyz_turns_503_when_the_socket_is_removed(running: Running) -> None:
    os.unlink(running.broker.socketPath)
    code, body = await running.get("/readyz")
    assert code == 503
    assert "the socket was removed" in body
    metrics = await running.metrics()
    assert metrics[("hostpid_broker_listening", ())] == 0


@pytest_twisted.ensureDeferred
async def test_readyz_turns_503_when_the_socket_is_replaced(running: Running) -> None:
    path = Path(running.broker.socketPath)
    path.unlink()
    path.write_text("planted")
    code, body = await running.get("/readyz")
    assert code == 503
    assert "replaced by another file" in body
    await running.broker.stopService()
    assert path.read_text() == "planted", "the newcomer survives the stop"


@pytest_twisted.ensureDeferred
async def test_gate_off_is_ready_and_says_so(disabled: Running) -> None:
    code, body = await disabled.get("/readyz")
    assert code == 200
    assert "broker disabled" in body
    metrics = await disabled.metrics()
    assert metrics[("hostpid_broker_enabled", ())] == 0
    assert metrics[("hostpid_broker_listening", ())] == 0
    assert ok_count(metrics) == 0


@pytest_twisted.ensureDeferred
async def test_resources_alone_with_stubtreq(tmp_path: Path) -> None:
    health = StubTreq(HealthResource())
    response = await health.get("http://broker/healthz")
    assert response.code == 200
    not_started = BrokerService(directory=str(tmp_path / "b"), environ=ENABLED)
    ready = StubTreq(ReadyResource(not_started))
    response = await ready.get("http://broker/readyz")
    assert response.code == 503
    assert "not listening" in await response.text()


def test_metrics_option_serves_from_twistd(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with BrokerProcess(
        tmp_path / "broker", ["--metrics", f"tcp:{port}:interface=127.0.0.1"]
    ) as broker:
        broker.wait_listening()

        def scrape() -> str:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as http:
                http.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
                return http.recv(4096).decode()

        assert scrape().startswith("HTTP/1.0 200 OK")
        broker.terminate()
        assert "GET /readyz" not in broker.output(), "probes are not access-logged"


def test_metrics_port_in_use_refuses_startup_before_the_socket(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with BrokerProcess(
            tmp_path / "broker", ["--metrics", f"tcp:{port}:interface=127.0.0.1"]
        ) as broker:
            assert broker.wait_exit() == 1
            output = broker.output()
    endpoint = f"tcp:{port}:interface=127.0.0.1"
    assert f"cannot start: --metrics {endpoint}: the metrics endpoint cannot listen" in output
    assert "Traceback" not in output
    assert not (tmp_path / "broker" / "broker.sock").exists()


@pytest.mark.parametrize("abstract", [False, True])
@pytest.mark.parametrize("gate", ["1", "0"])
def test_sd_notify_ready_then_stopping(tmp_path: Path, abstract: bool, gate: str) -> None:
    """
    A real datagram socket stands in for systemd: READY=1 arrives once the
    broker serves (or has said it is disabled), STOPPING=1 on SIGTERM.
    """
    address = f"\0hostpid-test-{os.getpid()}-{gate}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(address)
        systemd.settimeout(30)
        announced = "@" + address[1:] if abstract else address
        with BrokerProcess(
            tmp_path / "broker", env={"NOTIFY_SOCKET": announced}, gate=gate
        ) as broker:
            assert systemd.recv(256) == b"READY=1"
            socket_path = tmp_path / "broker" / "broker.sock"
            if gate == "1":
                assert ask_pid(socket_path) == os.getpid(), "ready means serving"
            else:
                assert not socket_path.exists()
            broker.process.send_signal(signal.SIGTERM)
            assert systemd.recv(256) == b"STOPPING=1"
            assert broker.wait_exit() == -signal.SIGTERM


def test_json_lines_logger(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    process = subprocess.Popen(
        [*TWISTD, "--nodaemon", "--pidfile=", "--logger", "hostpid.logs.json_lines",
         "hostpid-broker", "--directory", str(directory)],
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_for(lambda: ask_pid(directory / "broker.sock") == os.getpid(), "the broker")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    events = [json.loads(line) for line in output.splitlines() if line.strip()]
    listening = [e for e in events if "listening on" in e.get("log_format", "")]
    assert len(listening) == 1
    assert listening[0]["path"] == str(directory / "broker.sock")
    assert listening[0]["maxConnections"] == 512
    assert any("socket removed" in e.get("log_format", "") for e in events)
