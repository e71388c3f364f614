"""
The NRI plugin's probes and C{/readyz} against a hostile neighbour, with the
real plugin process (C{twistd hostpid-nri}) and a fake runtime on a real Unix
socket (L{nrilib.FakeRuntime}).

Why each check exists:

- Probes no pod can fail: the kubelet probed the plugin with C{httpGet} on
  its metrics port, which listens on the pod's address for Prometheus, and
  one flooding process (any pod) failed 8 of 9 liveness probes, 7 in a row
  (3 restart the container; flooding the standby's port too restarts both).
  Here a real flooding process (L{attackers.TCP_CONNECT_FLOOD}) floods the
  metrics port while probes run as the kubelet runs them: the old probe
  (one C{GET /healthz} on the flooded port, 3 s) fails at least a
  restart's worth of times, the control that shows the flood bites; the
  chart's probe (C{hostpid nri-probe} in the container, on the
  C{--health} listener on the pod's loopback) never fails.
- C{/readyz} reports, never acts: each request used to look at the host,
  which repairs the broker mountpoint a tenant replaced and logs the repair,
  so requests made the root plugin act on the host and write its log at
  the sender's rate (200 requests, 69,400 bytes).  Here a tenant's entry is
  planted at the mountpoint and C{/readyz} asked 200 times: the entry is
  still the tenant's afterwards and the log has not grown; the next GPU
  container's creation repairs it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from attackers import TCP_CONNECT_FLOOD
from nrilib import (
    FakeRuntime,
    NRIPluginProcess,
    gpu_container,
    host_tree,
    http_get,
    pod,
    unfreeze,
)
from support import WAIT_SECONDS, hostpid_argv, require_root, scaled, subprocess_env

#: The kubelet's probe timeout in the chart (C{timeoutSeconds}) and its
#: liveness C{failureThreshold}: that many failures restart the container.
PROBE_TIMEOUT = 3.0
FAILURE_THRESHOLD = 3
#: Probes of each kind made at most during the flood: the old one fails
#: more than half the time under this flood (5 of 8, 8 of 9 in the
#: report), so 3 failures come long before 30 tries.
MAX_ROUNDS = 30


@pytest.fixture
def where(tmp_path: Path) -> Path:
    require_root()
    return host_tree(tmp_path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_probe(port: int, path: str) -> bool:
    """
    The kubelet's C{httpGet} probe: connect, one C{GET}, a 2xx or 3xx status
    within L{PROBE_TIMEOUT}.
    """
    deadline = time.monotonic() + PROBE_TIMEOUT
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                         "Connection: close\r\n\r\n".encode())
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            head = sock.recv(64)
    except OSError:
        return False
    status = head.split()[1:2]
    return bool(status) and status[0][:1] in (b"2", b"3")


def exec_probe(address: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """The chart's exec probe: C{hostpid nri-probe} as the kubelet runs it."""
    return subprocess.run(
        hostpid_argv("nri-probe", "--address", address, *flags), env=subprocess_env(),
        capture_output=True, text=True, timeout=scaled(60))


def test_a_flooded_metrics_port_fails_no_exec_probe(where: Path) -> None:
    metrics, health = free_port(), free_port()
    lock_parent = where / "tmp" / "vgpulock"
    with FakeRuntime(where / "nri.sock") as runtime, NRIPluginProcess(where / "nri.sock", [
            "--broker-dir", str(where / "broker"), "--lock-parent", str(lock_parent),
            "--metrics", f"tcp:{metrics}:interface=127.0.0.1",
            "--health", f"tcp:{health}:interface=127.0.0.1"]) as process:
        runtime.accept(WAIT_SECONDS).handshake()
        address = f"127.0.0.1:{health}"
        ready = exec_probe(address, "--ready")
        assert ready.returncode == 0, (ready.stderr, process.output())
        assert http_probe(metrics, "/healthz"), "the metrics port answers before the flood"

        flood = subprocess.Popen([sys.executable, "-c", TCP_CONNECT_FLOOD, "127.0.0.1",
                                  str(metrics), "512"], stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None and flood.stdout.readline() == "ready\n"
            old_failed, rounds, failed_exec = 0, 0, []
            while old_failed < FAILURE_THRESHOLD and rounds < MAX_ROUNDS:
                rounds += 1
                old_failed += not http_probe(metrics, "/healthz")
                for flags in ((), ("--ready",)):
                    probe = exec_probe(address, *flags)
                    if probe.returncode != 0:
                        failed_exec.append(probe.stderr)
            assert flood.poll() is None, "the flood ran throughout"
        finally:
            flood.send_signal(signal.SIGTERM)
            connects = flood.communicate(timeout=WAIT_SECONDS)[0].strip()
        print(f"{connects}; old httpGet probe: {old_failed} of {rounds} failed; "
              f"exec probe: {len(failed_exec)} of {2 * rounds} failed")
        assert old_failed >= FAILURE_THRESHOLD, (
            f"the flood ({connects}) failed only {old_failed} of {rounds} httpGet probes: "
            "it no longer shows what the exec probe is for")
        assert failed_exec == [], failed_exec
        assert process.process.poll() is None, process.output()


def plant(entry: Path) -> int:
    """A tenant's regular file at the broker mountpoint; its inode."""
    if entry.is_dir() and not entry.is_symlink():
        unfreeze(entry)
        entry.rmdir()
    elif entry.exists() or entry.is_symlink():
        entry.unlink()
    entry.write_text("a tenant's")
    os.chown(entry, 1000, 1000)
    return entry.lstat().st_ino


def test_readyz_reports_the_last_look_and_never_acts_on_the_host(where: Path) -> None:
    lock_parent = where / "tmp" / "vgpulock"
    entry = lock_parent / "hostpid"
    metrics = where / "metrics.sock"
    with FakeRuntime(where / "nri.sock") as runtime, NRIPluginProcess(where / "nri.sock", [
            "--broker-dir", str(where / "broker"), "--lock-parent", str(lock_parent),
            # No periodic look while /readyz is asked: only requests could act.
            "--host-look-interval", "3600"], metrics=metrics) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        process.wait_registered()
        assert entry.is_dir(), "the look at start made the mountpoint"
        logged = len(process.output())
        planted = plant(entry)
        acted = 0
        for _ in range(200):
            code, body = http_get(metrics, "/readyz")
            assert code == 200, body  # the last look found the mountpoint sound
            if entry.lstat().st_ino != planted:
                acted += 1
                planted = plant(entry)
        grown = process.output()[logged:]
        print(f"200 /readyz: the host acted on {acted} times, {len(grown)} bytes of log")
        assert acted == 0 and entry.read_text() == "a tenant's"
        assert len(grown) < 1024, grown

        adjustment = connection.create_container(pod(), gpu_container()).adjust
        assert [m.destination for m in adjustment.mounts] == [
            "/tmp/vgpulock", "/tmp/vgpulock/hostpid"]
        assert entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == 0
        assert process.metric("hostpid_nri_mountpoint_repairs_total") == 1
