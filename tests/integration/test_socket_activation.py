"""
systemd socket activation and the service's descriptor store, with the
service manager's side played by the test (L{servicemanager}): the broker
takes a passed listener only once checked, stores the listener it bound, and
20 restarts (SIGTERM, exit, start with what systemd passes) under continuous
HAMi-core-like load keep the socket, its inode and its queue.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from continuity import assert_never_gone, continuous_load, no_fallbacks
from servicemanager import ServiceManager, bind_listener, managed
from support import BrokerProcess, ask_pid, require_root

RESTARTS = 20
#: Clients that may fall back over the restarts.  A client that connects
#: after the old broker's last turn waits in the queue for the new broker's
#: first answer, a Python start (0.25-0.5 s here) against its own 0.5 s
#: deadline, so a slow start on a busy machine still costs a few (0-15 of
#: about 1,500 measured).  Half of them fell back when a stopping broker
#: left its queue to the next start.
FALLBACK_SHARE = 0.05


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ServiceManager]:
    require_root()
    with managed(tmp_path) as made:
        yield made


@pytest.fixture
def brokers() -> Iterator[list[BrokerProcess]]:
    started: list[BrokerProcess] = []
    yield started
    for broker in started:
        broker.kill()


def restart_under_load(
    manager: ServiceManager, brokers: list[BrokerProcess], hamiload: Path,
    passed: Callable[[], list[tuple[int, str]]],
) -> dict[str, object]:
    socket_path = manager.directory / "broker.sock"
    first = manager.start(passed())
    brokers.append(first)
    first.wait_listening()
    original = os.stat(socket_path).st_ino
    report: dict[str, object] = {}
    with continuous_load(hamiload, socket_path, report):
        for _ in range(RESTARTS):
            manager.collect()
            old = brokers[-1]
            old.terminate()
            assert "socket left in place: systemd keeps the listener" in old.output(), old.output()
            manager.collect()
            new = manager.start(passed())
            brokers.append(new)
            new.wait_listening()
            assert "listener passed by systemd" in new.output(), new.output()
            assert os.stat(socket_path).st_ino == original, "the same socket throughout"
    assert ask_pid(socket_path) == os.getpid()
    manager.collect()
    assert manager.rejected == [], "systemd takes notifications from the main process only"
    return report


def test_socket_activation_keeps_the_listener_across_restarts(
    manager: ServiceManager, brokers: list[BrokerProcess], hamiload: Path
) -> None:
    listener = bind_listener(manager.directory)
    try:
        report = restart_under_load(
            manager, brokers, hamiload, lambda: [(listener.fileno(), "broker")]
        )
    finally:
        for broker in brokers:
            broker.kill()
        listener.close()
    print(f"socket activation, {RESTARTS} restarts: {report}")
    assert_never_gone(report)
    assert report["fallbacks"] <= FALLBACK_SHARE * report["clients"], no_fallbacks(report)  # type: ignore[operator]


def test_descriptor_store_keeps_the_listener_across_restarts(
    manager: ServiceManager, brokers: list[BrokerProcess], hamiload: Path
) -> None:
    report = restart_under_load(manager, brokers, hamiload, lambda: list(manager.store))
    manager.collect()
    assert [name for _, name in manager.store] == ["broker"], manager.messages
    print(f"descriptor store, {RESTARTS} restarts: {report}")
    assert_never_gone(report)
    assert report["fallbacks"] <= FALLBACK_SHARE * report["clients"], no_fallbacks(report)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        ("datagram", "is not an AF_UNIX stream socket"),
        ("not-listening", "is not listening"),
        ("elsewhere", "not at this broker's socket path"),
        ("mode-0600", "mode 0600; the rules require UID 0 mode 0666"),
    ],
)
def test_a_passed_descriptor_that_breaks_a_rule_is_refused_in_one_line(
    manager: ServiceManager, brokers: list[BrokerProcess], tmp_path: Path, make: str,
    expected: str,
) -> None:
    directory = manager.directory
    if make == "datagram":
        directory.mkdir(mode=0o711)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(directory / "broker.sock"))
    elif make == "not-listening":
        directory.mkdir(mode=0o711)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(directory / "broker.sock"))
    elif make == "elsewhere":
        directory.mkdir(mode=0o711)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp_path / "elsewhere.sock"))
        sock.listen()
    else:
        sock = bind_listener(directory, mode=0o600)
    os.chmod(directory, 0o711)
    try:
        broker = manager.start([(sock.fileno(), "broker")])
        brokers.append(broker)
        assert broker.wait_exit() != 0
    finally:
        sock.close()
    lines = [line for line in broker.output().splitlines() if "cannot start:" in line]
    assert lines and expected in lines[-1], broker.output()
