"""
The real plugin process (C{twistd hostpid-nri}) against a fake runtime on a
real Unix socket (L{nrilib.FakeRuntime}, written apart from the plugin's own
framing).

Why each check exists:

- The contract end to end: registration as C{90-hostpid}, a GPU container
  adjusted, a forged one not, C{/readyz} following the registration, and
  the runtime restarting (its socket removed, then back) reconnected to
  and registered again, the next container adjusted.
- Hostile runtimes: a frame that claims 4 GiB closes the connection with
  the plugin's memory unchanged and the plugin back; a runtime that never
  answers the registration is left after the timeout and reconnected to;
  one that accepts and closes at once is retried at a falling rate, with
  the plugin using almost no CPU (no spin); the plugin stops on SIGTERM
  whatever the runtime does.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from kernelfeatures import kernel_feature
from nrilib import FakeRuntime, NRIPluginProcess, container, gpu_container, http_get, pod
from support import WAIT_SECONDS, wait_for

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = kernel_feature("immutable_tmp")



def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def where(tmp_path: Path) -> Path:
    (tmp_path / "broker").mkdir()
    (tmp_path / "lock").mkdir()
    return tmp_path


def plugin(where: Path, *args: str, metrics: Path | None = None) -> NRIPluginProcess:
    return NRIPluginProcess(where / "nri.sock", ["--broker-dir", str(where / "broker"),
                                                 "--lock-parent", str(where / "lock"), *args],
                            metrics=metrics)


def test_registers_adjusts_and_comes_back_after_a_runtime_restart(where: Path) -> None:
    metrics = where / "metrics.sock"
    runtime = FakeRuntime(where / "nri.sock")
    with plugin(where, metrics=metrics) as process:
        try:
            connection = runtime.accept(WAIT_SECONDS)
            registration = connection.handshake()
            assert (registration.plugin_name, registration.plugin_idx) == ("hostpid", "90")
            process.wait_registered()
            # Answered well inside the runtime's request timeout (2 s).
            adjusted = connection.create_container(pod(), gpu_container(), timeout=1.0).adjust
            assert [(m.destination, m.source) for m in adjusted.mounts] == [
                ("/tmp/vgpulock", str(where / "lock")),
                ("/tmp/vgpulock/hostpid", str(where / "broker"))]
            assert [(e.key, e.value) for e in adjusted.env] == [("LIBVGPU_HOSTPID_BROKER", "1")]
            forged = connection.create_container(pod(), container(
                env=["NVIDIA_VISIBLE_DEVICES=all", "LIBVGPU_HOSTPID_BROKER=1"]))
            assert forged.adjust == type(forged.adjust)()
        finally:
            runtime.close()
        wait_for(lambda: http_get(metrics, "/readyz")[0] == 503, "readyz 503")
        with FakeRuntime(where / "nri.sock") as again:
            connection = again.accept(WAIT_SECONDS)
            connection.handshake()
            assert len(connection.create_container(pod(), gpu_container()).adjust.mounts) == 2
            assert process.metric("hostpid_nri_containers_total", reason="adjusted") == 2
            assert process.metric("hostpid_nri_containers_total", reason="not_qualifying") == 1
            assert process.metric("hostpid_nri_registered") == 1
        assert process.stop() in (0, -15), process.output()


def test_frame_claiming_four_gibibytes(where: Path) -> None:
    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        before = rss_kib(process.pid)
        # The multiplexer's header claims 4 GiB (on an id nobody opened, whose
        # bytes would otherwise be dropped as they come)...
        connection.send_raw(b"\x00\x00\x00\x07\xff\xff\xff\xff" + b"\0" * 65536)
        assert connection.wait_closed(5), process.output()
        # ...and ttrpc's header inside a well-formed multiplexed frame, on a
        # registered connection (no registration timeout to close it).
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        connection.send_raw(b"\x00\x00\x00\x01\x00\x01\x00\x0a"
                            b"\xff\xff\xff\xff\x00\x00\x00\x01\x01\x00" + b"\1" * 65536)
        assert connection.wait_closed(5)
        assert rss_kib(process.pid) < before + 8 * 1024
        runtime.accept(WAIT_SECONDS).handshake()
        assert "broke the protocol" in process.output()


def test_runtime_that_never_answers_registration(where: Path) -> None:
    with FakeRuntime(where / "nri.sock") as runtime, plugin(
            where, "--registration-timeout", "0.5") as process:
        connection = runtime.accept(WAIT_SECONDS)
        started = time.monotonic()
        connection.expect_registration()
        assert connection.wait_closed(5)
        assert 0.4 < time.monotonic() - started < 3
        runtime.accept(WAIT_SECONDS).handshake()
        assert "did not answer the registration" in process.output()


def test_runtime_closing_at_once_is_retried_at_a_falling_rate(where: Path) -> None:
    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        runtime.accept(WAIT_SECONDS).close()
        cpu_before = cpu_seconds(process.pid)
        started = time.monotonic()
        accepted = 0
        while time.monotonic() - started < 4.0:
            try:
                runtime.accept(max(0.05, 4.0 - (time.monotonic() - started))).close()
            except TimeoutError:
                break
            accepted += 1
        # Backoff 0.5, 1, 2 s (+ up to 10 %): three more connections in 4 s at most.
        assert 1 <= accepted <= 4, accepted
        assert cpu_seconds(process.pid) - cpu_before < 0.5
        assert process.stop() in (0, -15)


def test_runtime_that_never_reads_its_answers(where: Path) -> None:
    """
    A runtime that sends requests without reading the answers: the plugin
    stops reading once its own write buffer is full (the transport is its
    own producer), so what it holds stays bounded instead of growing with
    every answer.
    """
    import threading

    from nrilib import PLUGIN_CONN, PLUGIN_SERVICE, mux_frame, request_payload, ttrpc_frame

    from hostpid.nri import api_pb2

    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        before = rss_kib(process.pid)
        body = request_payload(PLUGIN_SERVICE, "CreateContainer", api_pb2.CreateContainerRequest(
            pod=pod(), container=gpu_container()))
        sent = [0]

        def flood() -> None:
            stream = 1001
            try:
                while sent[0] < 150 * 1024 * 1024:
                    chunk = b"".join(mux_frame(PLUGIN_CONN, ttrpc_frame(
                        stream + 2 * i, 1, 1, body)) for i in range(512))
                    stream += 1024
                    connection.sock.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:
                pass

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        thread.join(3)
        grown = rss_kib(process.pid) - before
        connection.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked sendall
        thread.join(10)
        assert not thread.is_alive()
        connection.close()
        # Measured: with the pause, about 250 KiB sent (the kernel's buffers)
        # and 250 KiB grown; without it, 3 MB sent and 4 MB grown in 3 s,
        # and growing as long as the runtime sends.
        assert sent[0] < 2 * 1024 * 1024 and grown < 2 * 1024, (sent[0], grown)
