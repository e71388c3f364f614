"""
Keep C{bench/tenants} and its C yardstick working: the yardstick builds and
answers each process with its own PID in both descriptor modes (the liveness
check included: a caller that has exited gets no reply), and one tiny run of
the benchmark measures the broker beside it and writes its report.

Correctness only, never speed: the figures live in the benchmark's reports.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import REPO, require_tool

sys.path.insert(0, str(REPO / "bench"))

from benchlib import (  # noqa: E402 - the bench directory is not a package
    ServerProcess,
    build_loadgen,
    build_yardstick,
    yardstick_command,
)

from hostpid.broker.descriptors import SO_PASSRIGHTS  # noqa: E402


def passrights_supported() -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    require_tool("cc")
    out = tmp_path_factory.mktemp("yardstick")
    return build_loadgen(out), build_yardstick(out)


@pytest.mark.parametrize("mode", ["refused", "received"])
def test_yardstick_answers_own_pid(binaries: tuple[Path, Path], mode: str) -> None:
    loadgen, yardstick = binaries
    if mode == "refused" and not passrights_supported():
        pytest.skip(f"not applicable: SO_PASSRIGHTS absent on {os.uname().release}")
    with ServerProcess(yardstick_command(yardstick, mode), cpu=None, max_connections=64,
                       deadline=0.5) as server:
        server.wait_ready()
        done = subprocess.run(
            [str(loadgen), "--socket", server.socket_path, "--burst", "20"],
            capture_output=True, text=True, timeout=60, check=True,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["ok"] == 20 and result["wrong_pid"] == 0, result
        # The liveness check: a connection whose maker has exited is closed
        # with no reply, as the broker closes it (outcome peer_gone).
        parent, child = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(server.socket_path)
                socket.send_fds(child, [b"x"], [conn.fileno()])
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        _data, fds, _flags, _addr = socket.recv_fds(parent, 1, 1)
        parent.close()
        child.close()
        with socket.socket(fileno=fds[0]) as orphan:
            orphan.settimeout(5)
            orphan.sendall(b"HPID\x00\x01\x00\x01")
            assert orphan.recv(64) == b"", "no reply for a caller that has exited"


def test_tenants_benchmark_runs_and_reports(tmp_path: Path) -> None:
    """One tiny run of every step, the broker beside the yardstick, in one mode."""
    require_tool("cc")
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "tenants"), "--quick", "--modes", "received",
         "--servers", "hostpid,yardstick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        cwd=tempfile.gettempdir(),
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    assert {(r["server"], r["mode"]) for r in rows} == {
        ("hostpid", "received"), ("yardstick", "received")}
    for row in rows:
        assert "error" not in row, row
        tenants = row["tenants"]
        assert [v["pacing"] for v in tenants["variants"]] == ["at-once", "spread", "waves"]
        assert tenants["clients"] == 12 and tenants["wrong_pid"] == 0
        assert tenants["flood_connects"] >= 2 * 50, "both floods connected"
        assert row["closed"]["tx"] > 0 and row["closed"]["cpu_us_per_tx"] > 0
        assert row["burst"]["n"] == 16 and row["burst"]["wrong_pid"] == 0
    env = json.loads((out / "environment.json").read_text())
    assert env["revision"]["commit"] and "bench/yardstick (built)" in env["sha256"]
    summary = (out / "summary.md").read_text()
    assert summary == done.stdout.strip() + "\n" or summary.strip() == done.stdout.strip()
    assert "## Mode `received`" in summary and "| yardstick |" in summary
