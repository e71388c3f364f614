"""
The systemd side of a reload, deterministically: what the notifier tells a
real notify socket and when (L{hostpid.broker.sdnotify.ReadinessNotifier}),
and the reloader's rules (L{hostpid.broker.reload.Reloader}) on a clock.
The reload itself, with real processes: tests/integration/test_reload.py.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from hostpid.broker.reload import Reloader
from hostpid.broker.sdnotify import ReadinessNotifier


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    yield sock, {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    sock.close()


def told(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


def test_ready_waits_for_the_takeover_to_settle(
    systemd: tuple[socket.socket, dict[str, str]]
) -> None:
    sock, environ = systemd
    reactor = MemoryReactorClock()
    settled: Deferred[None] = Deferred()
    notifier = ReadinessNotifier(environ, reactor, ready=lambda: settled)
    notifier.startService()
    reactor.run()
    assert told(sock) == [], "not the main process yet"
    settled.callback(None)
    assert told(sock) == ["READY=1"]


def test_a_process_that_passed_the_main_pid_does_not_say_stopping(
    systemd: tuple[socket.socket, dict[str, str]]
) -> None:
    sock, environ = systemd
    reactor = MemoryReactorClock()
    notifier = ReadinessNotifier(environ, reactor)
    notifier.startService()
    reactor.run()
    notifier.passMainPid(4711)
    notifier.stopService()
    assert told(sock) == ["READY=1", "MAINPID=4711"]


def test_a_stop_without_a_reload_says_stopping(
    systemd: tuple[socket.socket, dict[str, str]]
) -> None:
    sock, environ = systemd
    notifier = ReadinessNotifier(environ, MemoryReactorClock())
    notifier.startService()
    notifier.stopService()
    assert told(sock) == ["STOPPING=1"]


class FakeBroker:
    """What the reloader reads of the broker."""

    def __init__(self) -> None:
        self.running = True
        self.enabled = True
        self.handedOver = False
        self.control: object | None = object()
        self.serving = True
        self.handOverObservers: list[Any] = []

    def ready(self) -> bool:
        return self.serving


class SpawningReactor(MemoryReactorClock):
    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[tuple[Any, list[str]]] = []

    def spawnProcess(self, protocol: Any, executable: str, args: list[str], **kwargs: Any) -> None:
        self.spawned.append((protocol, args))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process to stand for the new broker the launcher started."""
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


def launched(reactor: SpawningReactor, pid: int | None) -> None:
    """The launcher reports C{pid} (or nothing) and exits."""
    launcher = reactor.spawned[-1][0]
    if pid is not None:
        launcher.childDataReceived(3, f"{pid}\n".encode())
    launcher.processEnded(Failure(ProcessDone(0)))


def reloader(broker: FakeBroker, reactor: SpawningReactor, notifier: Any) -> Reloader:
    return Reloader(
        broker, notifier, reactor, environ={}, argv=["/venv/bin/python", "/venv/bin/twistd"],
        timeout=60.0,
    )


class RecordingNotifier:
    def __init__(self) -> None:
        self.passed: list[int] = []

    def passMainPid(self, pid: int) -> None:
        self.passed.append(pid)


def test_one_reload_at_a_time_and_the_main_pid_only_to_its_own_broker(
    sleeper: subprocess.Popen[bytes],
) -> None:
    broker, reactor, notifier = FakeBroker(), SpawningReactor(), RecordingNotifier()
    reloading = reloader(broker, reactor, notifier)
    reloading.reload()
    reloading.reload()
    assert len(reactor.spawned) == 1, "a second SIGHUP while one new broker starts is ignored"
    _, args = reactor.spawned[0]
    assert args[1:4] == ["-I", "-S", "-c"] and args[5:] == ["/venv/bin/python", "/venv/bin/twistd"]
    launched(reactor, sleeper.pid)
    assert reloading.pid == sleeper.pid
    reloading.reload()
    assert len(reactor.spawned) == 1
    reloading._handingOver(4711)
    assert notifier.passed == [], "a broker this one did not start gets no MAINPID="
    reloading._handingOver(sleeper.pid)
    assert notifier.passed == [sleeper.pid]
    assert reloading.pid is None and reactor.readers == set(), "its exit is no longer watched"


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({"enabled": False}, "disabled"),
        ({"handedOver": True}, "already handed over"),
        ({"control": None}, "not serving with a handover control socket"),
        ({"serving": False}, "not serving with a handover control socket"),
    ],
)
def test_a_broker_that_cannot_hand_over_starts_nothing(state: dict[str, object], why: str) -> None:
    broker, reactor = FakeBroker(), SpawningReactor()
    for name, value in state.items():
        setattr(broker, name, value)
    reloading = reloader(broker, reactor, RecordingNotifier())
    assert reloading._problem() is not None and why in reloading._problem()  # type: ignore[operator]
    reloading.reload()
    assert reactor.spawned == []


def test_a_new_broker_that_neither_takes_over_nor_exits_is_killed(
    sleeper: subprocess.Popen[bytes],
) -> None:
    broker, reactor = FakeBroker(), SpawningReactor()
    reloading = reloader(broker, reactor, RecordingNotifier())
    reloading.reload()
    launched(reactor, sleeper.pid)
    reactor.advance(59.9)
    assert sleeper.poll() is None
    reactor.advance(0.2)
    assert sleeper.wait(10) == -signal.SIGKILL
    assert reloading.pid is None, "a later reload may start"
    reloading.reload()
    assert len(reactor.spawned) == 2


def test_a_new_broker_that_exits_ends_the_reload(sleeper: subprocess.Popen[bytes]) -> None:
    broker, reactor = FakeBroker(), SpawningReactor()
    reloading = reloader(broker, reactor, RecordingNotifier())
    reloading.reload()
    launched(reactor, sleeper.pid)
    (watch,) = reactor.readers
    sleeper.kill()
    sleeper.wait()
    assert select.select([watch], [], [], 10)[0], "a pidfd is readable once its process exits"
    watch.doRead()  # type: ignore[attr-defined]
    assert reloading.pid is None and reactor.readers == set()
    reactor.advance(120)
    assert reactor.getDelayedCalls() == []


def test_a_launcher_that_reports_nothing_ends_the_reload() -> None:
    broker, reactor = FakeBroker(), SpawningReactor()
    reloading = reloader(broker, reactor, RecordingNotifier())
    reloading.reload()
    launched(reactor, None)
    assert reloading.pid is None
    assert reactor.getDelayedCalls() == []


class FailingReactor(SpawningReactor):
    def spawnProcess(self, protocol: Any, executable: str, args: list[str], **kwargs: Any) -> None:
        raise OSError(11, "Resource temporarily unavailable")


def test_a_launcher_that_cannot_start_leaves_reloads_possible() -> None:
    reactor = FailingReactor()
    reloading = reloader(FakeBroker(), reactor, RecordingNotifier())
    reloading.reload()
    assert reloading.pid is None and reactor.getDelayedCalls() == []
