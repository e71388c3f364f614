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
from datetime import datetime, timedelta
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


LEVELS = {"debug", "info", "warn", "error", "critical"}


def json_lines(text: str) -> list[dict[str, object]]:
    """
    Every line of C{text} as a log record, failing on the first line that
    is not one: a JSON object with an RFC 3339 UTC C{time}, a Twisted level,
    a C{logger}, a C{message} string, and none of Twisted's private C{log_*}
    keys.
    """
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        record = json.loads(line)
        assert isinstance(record, dict), (number, line)
        moment = datetime.fromisoformat(str(record["time"]))
        assert moment.utcoffset() == timedelta(0), (number, line)
        assert str(record["time"]).endswith("Z"), (number, line)
        assert record["level"] in LEVELS, (number, line)
        assert isinstance(record["logger"], str) and record["logger"], (number, line)
        assert isinstance(record["message"], str), (number, line)
        assert not [key for key in record if key.startswith("log_")], (number, line)
        records.append(record)
    return records


def run_json_broker(
    tmp_path: Path, *args: str, gate: str = "1", twistd_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """A real C{twistd hostpid-broker --log-format json}: stdout and stderr apart."""
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            [*TWISTD, "--nodaemon", "--pidfile=", *twistd_args, "hostpid-broker",
             "--log-format", "json", *args],
            env=subprocess_env(LIBVGPU_HOSTPID_BROKER=gate), stdin=subprocess.DEVNULL,
            stdout=out, stderr=err, cwd=tmp_path,
        )
    return process, stdout, stderr


def test_json_logs_every_line_from_start_to_stop(tmp_path: Path) -> None:
    """
    C{--log-format json}: every line the broker writes, through twistd's
    start-up, serving, refusals (an invalid request, a client that never
    sends one) and SIGTERM, is one record a collector can parse, and the
    broker's structured fields ride along.
    """
    directory = tmp_path / "broker"
    socket_path = directory / "broker.sock"
    process, stdout, stderr = run_json_broker(tmp_path, "--directory", str(directory))
    try:
        wait_for(lambda: process.poll() is not None or ask_pid(socket_path) == os.getpid(),
                 "the broker")
        assert process.poll() is None, stdout.read_text() + stderr.read_text()
        invalid = exchange(socket_path, b"XXXX" + wire.GET_HOST_PID_REQUEST[4:])
        assert wire.parse_response(invalid).status == wire.Status.INVALID_REQUEST
        with socket.socket(socket.AF_UNIX) as silent:  # no request: closed at the deadline
            silent.settimeout(30)
            silent.connect(str(socket_path))
            assert silent.recv(16) == b""
        wait_for(lambda: "deadline transactions so far" in stdout.read_text(),
                 "the deadline refusal's record")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    records = json_lines(stdout.read_text())
    assert stderr.read_text() == ""
    by_message = {str(record["message"]): record for record in records}
    listening = [r for m, r in by_message.items() if m.startswith("hostpid-broker: listening on")]
    assert len(listening) == 1
    assert listening[0]["path"] == str(socket_path)
    assert listening[0]["maxConnections"] == 512
    assert listening[0]["logger"] == "hostpid.broker.service.BrokerService"
    invalid_record = by_message["hostpid-broker: invalid transactions so far: 1"]
    assert (invalid_record["level"], invalid_record["outcome"], invalid_record["count"]) == \
        ("warn", "invalid", 1)
    assert "hostpid-broker: deadline transactions so far: 1" in by_message
    assert any(m.startswith("twistd ") and m.endswith("starting up.") for m in by_message)
    assert f"hostpid-broker: socket removed: {socket_path}" in by_message
    assert any("Received SIGTERM" in m for m in by_message), list(by_message)


def test_json_logs_a_refused_start(tmp_path: Path) -> None:
    """
    A refused start stays one plain line on standard error (what systemctl
    status and kubectl describe show); its record in the log is JSON, with
    the path and the rule as fields.
    """
    planted = tmp_path / "not-a-directory"
    planted.write_text("")
    process, stdout, stderr = run_json_broker(tmp_path, "--directory", str(planted))
    try:
        assert process.wait(timeout=60) == 1
    finally:
        process.kill()
        process.wait()
    (line,) = stderr.read_text().splitlines()
    assert line.startswith(f"hostpid-broker: cannot start: {planted}: ")
    records = json_lines(stdout.read_text())
    (refused,) = [r for r in records if r["message"] == line]
    assert refused["level"] == "error"
    assert refused["path"] == str(planted)
    assert refused["rule"] == line.split(f"{planted}: ", 1)[1]


def test_json_logs_go_to_twistds_logfile(tmp_path: Path) -> None:
    """C{--logfile}: the records go where twistd would write its text log."""
    logfile = tmp_path / "broker.log"
    process, stdout, stderr = run_json_broker(
        tmp_path, "--directory", str(tmp_path / "broker"), gate="0",
        twistd_args=("--logfile", str(logfile)))
    try:
        wait_for(lambda: logfile.exists() and "disabled" in logfile.read_text(),
                 "the disabled broker's record")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    assert (stdout.read_text(), stderr.read_text()) == ("", "")
    records = json_lines(logfile.read_text())
    assert any(str(r["message"]).startswith("hostpid-broker: disabled") for r in records)


@pytest.mark.parametrize("twistd_args, args, line", [
    ((), ("--log-format", "yaml"),
     "hostpid-broker: cannot start: --log-format: must be one of text, json, got 'yaml'"),
    (("--logfile", "/nonexistent/broker.log"), ("--log-format", "json"),
     "hostpid-broker: cannot start: /nonexistent/broker.log: cannot open the log file "
     "(--logfile): No such file or directory"),
    (("--syslog",), ("--log-format", "json"),
     "hostpid-broker: cannot start: --log-format json: writes JSON lines to twistd's log file "
     "or standard output; it cannot be combined with twistd --syslog (use --log-format text "
     "there)"),
])
def test_log_format_refuses_what_it_cannot_write(
    tmp_path: Path, twistd_args: tuple[str, ...], args: tuple[str, ...], line: str
) -> None:
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", *twistd_args, "hostpid-broker", "--directory",
         str(tmp_path / "broker"), *args],
        env=subprocess_env(), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [line]


def test_json_lines_logger_for_other_twistd_runs(tmp_path: Path) -> None:
    """C{twistd --logger hostpid.logs.json_lines}: the same records."""
    directory = tmp_path / "broker"
    process = subprocess.Popen(
        [*TWISTD, "--nodaemon", "--pidfile=", "--logger", "hostpid.logs.json_lines",
         "hostpid-broker", "--directory", str(directory)],
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: ask_pid(directory / "broker.sock") == os.getpid(), "the broker")
        process.send_signal(signal.SIGTERM)
        output, errors = process.communicate(timeout=30)
    finally:
        process.kill()
        process.communicate()
    assert errors == ""
    records = json_lines(output)
    listening = [r for r in records if str(r["message"]).startswith("hostpid-broker: listening")]
    assert len(listening) == 1
    assert listening[0]["path"] == str(directory / "broker.sock")
