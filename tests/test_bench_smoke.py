"""
Keep the benchmark's load generator honest: compile C{bench/loadgen.c} and
run each of its modes very briefly against a real broker.

These assert correctness only (own PID, every process served, probes
answered), never speed: speed lives in C{bench/run}.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    # One generator process is one peer: its clients may all wait at once, so
    # the per-peer share (2 of 32 slots by default) would close the third
    # one accepted before its request, as the fairness rule means to.
    with running_broker(
        directory, "--max-connections", "32", "--deadline", "0.5",
        "--max-waiting-per-peer", "32",
    ) as broker:
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


# --- Progress: bench/run and bench/soak say what they are doing, on stderr. ---

#: One progress line in the plain (not a terminal) form.
PROGRESS_LINE = re.compile(
    r"(?P<tool>bench|soak): (?P<step>.+?)(?: \[(?P<server>[\w-]+)\])?; "
    r"elapsed (?P<elapsed>\d+:\d\d)(?:, about (?P<left>\d+:\d\d) left)?"
)


def seconds(clock: str) -> int:
    minutes, secs = clock.split(":")
    return int(minutes) * 60 + int(secs)


def progress_lines(stderr: str, tool: str) -> list[re.Match[str]]:
    """The progress lines, checked to be plain lines with a clock that never goes back."""
    assert "\r" not in stderr and "\x1b" not in stderr, "not a terminal: plain lines only"
    found = [m for line in stderr.splitlines() if (m := PROGRESS_LINE.fullmatch(line))]
    assert all(m["tool"] == tool for m in found)
    elapsed = [seconds(m["elapsed"]) for m in found]
    assert elapsed == sorted(elapsed), elapsed
    return found


def run_bench_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """C{bench/NAME} with stdout and stderr on pipes (not a terminal), in a scratch cwd."""
    require_tool("cc")
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / name), *args], capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir(),
    )


def test_bench_run_reports_progress_on_stderr(tmp_path: Path) -> None:
    done = run_bench_script(
        "run", "--quick", "--scenarios", "closed-1,burst-256", "--burst-repeat", "1",
        "--no-plots", "--progress-every", "0.3", "--out", str(tmp_path / "report"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# hostpid benchmark report"), "stdout: the report alone"
    assert "bench:" not in done.stdout and "elapsed" not in done.stdout
    assert (tmp_path / "report" / "summary.md").is_file()
    found = progress_lines(done.stderr, "bench")
    steps = [m["step"] for m in found]
    assert steps[0] == "[1/2] closed-1 (run 1)" and steps[-1] == "[2/2] burst-256 (run 1)"
    assert set(steps) == {"[1/2] closed-1 (run 1)", "[2/2] burst-256 (run 1)"}
    assert {m["server"] for m in found} == {"hostpid"}
    assert all(m["left"] is not None for m in found), "an estimate of what is left"
    assert seconds(found[-1]["left"]) <= seconds(found[0]["left"])
    # The ticker kept the line moving during the first step (about 3 s at 0.3 s a line).
    assert steps.count("[1/2] closed-1 (run 1)") >= 3, done.stderr


def test_bench_soak_reports_progress_on_stderr(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    done = run_bench_script(
        "soak", "--minutes", "0.1", "--flood-clients", "50", "--progress-every", "0.5",
        "--out", str(report),
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a violation, reported in the JSON
    summary = json.loads(done.stdout)  # stdout is the JSON summary and nothing else
    assert json.loads(report.read_text()) == summary, "and the same summary in the report"
    assert summary["minutes"] == 0.1
    found = progress_lines(done.stderr, "soak")
    steps = [m["step"] for m in found]
    for prefix in ("starting the server", "warm-up: ", "settling after the warm-up",
                   "main phase: ", "settling and stopping the server"):
        assert any(step.startswith(prefix) for step in steps), (prefix, done.stderr)
    main = [m for m in found if m["step"].startswith("main phase: ")]
    assert len(main) >= 3, "about 5 s of main phase at 0.5 s a line"
    assert all(m["left"] is not None for m in main)
    assert seconds(main[-1]["left"]) < seconds(main[0]["left"])


@pytest.mark.parametrize("mode", ["refused", "received"])
def test_bench_micro_serves_every_connection_in_both_modes(mode: str) -> None:
    """
    C{bench/micro} times the broker's own accept path: every connection must
    be answered (it loops until the factory counts them all), in either mode,
    and the bare floor loop alongside.  Figures only, no speed asserted.
    """
    done = run_bench_script(
        "micro", "--mode", mode, "--connections", "50", "--rounds", "2", "--floor"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"{mode} broker", f"{mode} floor"]
    assert all(re.search(r"best \d+\.\d\d us, median \d+\.\d\d us", line) for line in lines)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def benchlib() -> Any:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import benchlib as module
    finally:
        sys.path.remove(str(REPO / "bench"))
    return module


def test_progress_on_a_terminal_rewrites_one_line() -> None:
    """The terminal form, with a clock driven by hand and no ticker thread."""
    now = [100.0]
    terminal = FakeTerminal()
    progress = benchlib().Progress("bench", stream=terminal, clock=lambda: now[0])
    assert progress.tty and progress.every == 0.5
    progress.set("[1/2] closed-1 (run 1)", server="hostpid", remaining=lambda: 75.0)
    now[0] += 61
    progress.tick()
    progress.note("step failed: boom")
    progress.__exit__(None, None, None)
    assert terminal.getvalue() == (
        "\r\x1b[Kbench: [1/2] closed-1 (run 1) [hostpid]; elapsed 0:00, about 1:15 left"
        "\r\x1b[Kbench: [1/2] closed-1 (run 1) [hostpid]; elapsed 1:01, about 1:15 left"
        "\r\x1b[Kbench: step failed: boom\n"
        "\r\x1b[Kbench: [1/2] closed-1 (run 1) [hostpid]; elapsed 1:01, about 1:15 left"
        "\r\x1b[K"
    )


def test_progress_elsewhere_is_plain_lines_every_ten_seconds() -> None:
    plain = io.StringIO()
    progress = benchlib().Progress("soak", stream=plain, clock=lambda: 0.0)
    assert not progress.tty and progress.every == 10.0
    progress.set("warm-up", server="hostpid")
    progress.note("after warm-up: 11 fds")
    assert plain.getvalue() == (
        "soak: warm-up [hostpid]; elapsed 0:00\nsoak: after warm-up: 11 fds\n"
    )


def test_reports_go_under_bench_reports_by_default() -> None:
    """
    A run without C{--out} writes its report under C{bench/reports/DATE/},
    one entry per run, never into docs/ (which holds the guides) nor into
    whatever directory the tool was started from.
    """
    lib = benchlib()
    path = lib.default_report("run")
    assert path.parent.parent == REPO / "bench" / "reports"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", path.parent.name), path
    assert re.fullmatch(r"run-\d{6}Z", path.name), path
    assert lib.default_report("soak", ".json").name.endswith(".json")
    for tool in ("run", "soak", "paired"):
        text = (REPO / "bench" / tool).read_text()
        assert "default_report(" in text, f"bench/{tool} must default to bench/reports/"
