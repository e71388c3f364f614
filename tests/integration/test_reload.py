"""
A reload by handover, as C{systemctl reload} drives it (C{ExecReload=} sends
C{SIGHUP} to the main process), with systemd's side played by the test
(L{servicemanager}, which takes notifications from the main process only and
follows C{MAINPID=}): 20 reloads back to back under continuous HAMi-core-like
load leave every client answered, each old broker exits 0 after passing
systemd the new one's PID, and the socket is the same throughout.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from continuity import assert_never_gone, continuous_load, no_fallbacks
from servicemanager import ServiceManager, bind_listener, managed
from support import WAIT_SECONDS, BrokerProcess, ask_pid, require_root, wait_for

RELOADS = 20

#: C{prctl(2)}: orphaned descendants are re-parented to this process, so a
#: test can reap (and read the status of) brokers started by brokers.
_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ServiceManager]:
    require_root()
    with managed(tmp_path) as made:
        _set_subreaper(True)
        try:
            yield made
        finally:
            _set_subreaper(False)


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Brokers started by reloads (this test's descendants): killed and reaped at the end."""
    started: list[int] = []
    yield started
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def readyz(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
        return int(response.status)


def exit_status(pid: int) -> int:
    """Wait for a broker this test reaps; its exit status (negative: a signal)."""

    def ended() -> tuple[int, int] | None:
        reaped, status = os.waitpid(pid, os.WNOHANG)
        return (reaped, status) if reaped else None

    _, status = wait_for(ended, f"PID {pid} to exit", WAIT_SECONDS)  # type: ignore[misc]
    return os.waitstatus_to_exitcode(status)


def reload(manager: ServiceManager, brokers: list[int]) -> int:
    """SIGHUP to the main process; the new main PID, once the old one has exited."""
    old = manager.main_pid
    assert old is not None
    os.kill(old, signal.SIGHUP)

    def passed() -> int | None:
        manager.collect()
        return manager.main_pid if manager.main_pid != old else None

    new = wait_for(passed, f"MAINPID= from PID {old}", WAIT_SECONDS)
    assert isinstance(new, int)
    brokers.append(new)
    if brokers[0] != old:
        assert exit_status(old) == 0, "an old broker exits 0 once it handed over"

    def ready() -> bool:
        manager.collect()
        return (new, "READY=1") in manager.taken

    wait_for(ready, f"READY=1 from the new main PID {new}", WAIT_SECONDS)
    return new


@pytest.mark.parametrize("how", ["socket-activation", "descriptor-store"])
def test_reloads_back_to_back_leave_every_client_answered(
    manager: ServiceManager, hamiload: Path, pids: list[int], how: str
) -> None:
    """
    Then a restart: systemd still keeps the listener, so the last broker
    leaves the socket in place at its stop (it learnt that from the offer),
    and the next start takes it back.
    """
    listener = bind_listener(manager.directory) if how == "socket-activation" else None

    def passed() -> list[tuple[int, str]]:
        return [(listener.fileno(), "broker")] if listener is not None else list(manager.store)

    socket_path = manager.directory / "broker.sock"
    # As the shipped unit runs it: with a metrics port, which each new broker
    # binds while the old one still listens on it.
    metrics = free_port()
    args = ["--metrics", f"tcp:{metrics}:interface=127.0.0.1"]
    first: BrokerProcess = manager.start(passed(), args=args)
    again: BrokerProcess | None = None
    try:
        first.wait_listening()
        original = os.stat(socket_path).st_ino
        report: dict[str, object] = {}
        brokers = [first.pid]
        with continuous_load(hamiload, socket_path, report):
            for round_ in range(RELOADS):
                new = reload(manager, brokers)
                pids.append(new)
                if round_ == 0:
                    assert first.wait_exit() == 0, first.output()
                assert os.stat(socket_path).st_ino == original, "the same socket throughout"
        assert ask_pid(socket_path) == os.getpid()
        assert readyz(metrics) == 200, "the last broker's metrics server answers"
        last = manager.main_pid
        assert last is not None
        os.kill(last, signal.SIGTERM)
        assert exit_status(last) == -signal.SIGTERM, first.output()
        assert os.stat(socket_path).st_ino == original, (
            "systemd keeps the listener: its last owner leaves the path in place"
        )
        manager.collect()
        again = manager.start(passed(), args=args)
        again.wait_listening()
        assert "listener passed by systemd" in again.output(), again.output()
        assert os.stat(socket_path).st_ino == original
    finally:
        first.kill()
        if again is not None:
            again.kill()
        if listener is not None:
            listener.close()
    manager.collect()
    log = first.output()  # every broker's output: each new one inherits it
    assert log.count("handed over to PID") == RELOADS, log
    assert log.count("systemd keeps the listener too") == RELOADS, log
    assert "reload failed" not in log, log
    assert manager.rejected == [], (manager.rejected, log)
    assert (last, "STOPPING=1") in manager.taken, manager.taken
    print(f"reloads {RELOADS} ({how}): {report}")
    assert report["clients"] and report["clients"] > RELOADS * 10, report  # type: ignore[operator]
    assert_never_gone(report)
    assert report["fallbacks"] == 0, no_fallbacks(report)


def test_a_reload_that_fails_leaves_the_old_broker_serving(
    manager: ServiceManager, tmp_path: Path
) -> None:
    """
    The new broker refuses to start after it was offered the listener (its
    CDI directory became a symlink since the old one started): the old one
    keeps the main PID, keeps serving and logs the reload as failed.
    """
    cdi = tmp_path / "cdi"
    first = manager.start(
        [], args=["--cdi-dir", str(cdi), "--lock-parent", str(tmp_path / "vgpulock")]
    )
    try:
        first.wait_listening()
        cdi.rename(tmp_path / "cdi-old")
        cdi.symlink_to("/etc")
        os.kill(first.pid, signal.SIGHUP)
        wait_for(lambda: "reload failed" in first.output(), "the failed reload", WAIT_SECONDS)
        log = first.output()
        assert f"cannot start: {cdi}: is a symlink, not a directory" in log, log
        assert "still serving" in log, log
        manager.collect()
        assert manager.main_pid == first.pid
        assert manager.rejected == [], manager.rejected
        assert ask_pid(first.socket_path) == os.getpid()
        assert first.process.poll() is None, log
        # A second reload after the cause is gone succeeds.
        cdi.unlink()
        (tmp_path / "cdi-old").rename(cdi)
        pids = [first.pid]
        reload(manager, pids)
        assert first.wait_exit() == 0, first.output()
        os.kill(pids[-1], signal.SIGTERM)
        assert exit_status(pids[-1]) == -signal.SIGTERM, first.output()
    finally:
        first.kill()
