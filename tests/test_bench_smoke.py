"""
Keep the benchmark's load generator honest: compile C{bench/loadgen.c} and
run each of its modes very briefly against a real broker.

These assert correctness only (own PID, every process served, probes
answered), never speed: speed lives in C{bench/run}.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO, require_tool, running_broker

LOADGEN_SOURCE = REPO / "bench" / "loadgen.c"


@pytest.fixture(scope="module")
def loadgen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = require_tool("cc")
    binary = tmp_path_factory.mktemp("loadgen") / "loadgen"
    subprocess.run(
        [compiler, "-O2", "-Wall", "-o", str(binary), str(LOADGEN_SOURCE), "-lm"],
        check=True,
    )
    return binary


@pytest.fixture(scope="module")
def broker_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("broker")
    directory.chmod(0o711)
    with running_broker(directory, "--max-connections", "32", "--deadline", "0.5") as broker:
        yield str(broker.socket_path)


def run_loadgen(loadgen: Path, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [str(loadgen), *args], capture_output=True, text=True, timeout=30, check=True
    )
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    result: dict[str, object] = json.loads(lines[0])
    return result


def test_closed_loop_gets_own_pid(loadgen: Path, broker_socket: str) -> None:
    result = run_loadgen(
        loadgen, "--socket", broker_socket, "--clients", "4", "--duration", "0.5", "--expect-pid"
    )
    assert result["mode"] == "closed"
    assert result["wrong_pid"] == 0
    assert isinstance(result["ok"], int) and result["ok"] > 0
    assert result["errors"] == 0, result


def test_burst_every_process_gets_its_own_pid(loadgen: Path, broker_socket: str) -> None:
    result = run_loadgen(loadgen, "--socket", broker_socket, "--burst", "20", "--times")
    assert result["all_ok"] is True, result
    assert result["wrong_pid"] == 0
    assert result["ok"] == 20
    assert isinstance(result["done_ms"], list) and len(result["done_ms"]) == 20


def test_silent_attack_probe_is_answered(loadgen: Path, broker_socket: str) -> None:
    # 50 silent connections against a limit of 32: some are closed at once,
    # the rest at the deadline; the probe's waiting requests are answered.
    result = run_loadgen(loadgen, "--socket", broker_socket, "--idle", "50", "--hold", "1")
    assert result["probe_ok"] is True
    assert result["probes_wrong_pid"] == 0
    assert isinstance(result["probes_answered"], int) and result["probes_answered"] > 0
    assert result["idle_connects"] == 50


def test_wrong_pid_is_detected(loadgen: Path, tmp_path: Path) -> None:
    """
    The generator must notice a server that lies: a fake server that always
    answers PID 1 makes every --expect-pid transaction a wrong PID.
    """
    import socket
    import threading

    path = str(tmp_path / "liar.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    conn.recv(8)
                    conn.sendall(b"HPID\x00\x01\x00\x00\x00\x00\x00\x01")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        result = run_loadgen(
            loadgen, "--socket", path, "--clients", "1", "--duration", "0.2", "--expect-pid"
        )
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert result["ok"] == 0
    assert isinstance(result["wrong_pid"], int) and result["wrong_pid"] > 0
