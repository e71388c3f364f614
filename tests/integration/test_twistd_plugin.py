"""
C{twistd hostpid-broker} as an operator runs it: the gate, options, startup
refusals (one clear line, non-zero exit) and signals.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import (
    BrokerProcess,
    as_user_argv,
    ask_pid,
    require_root,
    subprocess_env,
    twistd_argv,
    wait_for,
)


@pytest.mark.parametrize("value", ["", "0", "true", "false", "01", " 1", "1 ", "yes", "1\n"])
def test_gate_not_exactly_1_creates_nothing(tmp_path: Path, value: str) -> None:
    directory = tmp_path / "broker"
    with BrokerProcess(directory, gate=value) as broker:
        wait_for(lambda: "disabled" in broker.output(), "the disabled message")
        assert broker.process.poll() is None, "the service keeps running"
        assert not directory.exists(), "no directory, lock or socket is created"
        broker.terminate()
    assert not directory.exists()


def test_gate_unset_creates_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    with BrokerProcess(directory, gate=None) as broker:
        wait_for(lambda: "disabled" in broker.output(), "the disabled message")
        broker.terminate()
    assert not directory.exists()


def test_gate_1_serves(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "broker", gate="1") as broker:
        broker.wait_listening()
        assert ask_pid(broker.socket_path) == os.getpid()
        broker.terminate()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-connections", "0"], "must be a positive integer"),
        (["--max-connections", "many"], "invalid literal"),
        (["--deadline", "-1"], "must be a positive number of seconds"),
        (["--deadline", "nan"], "must be a positive number of seconds"),
        (["--no-such-option"], "no-such-option"),
    ],
)
def test_bad_option_exits_non_zero_with_a_message(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = subprocess.run(
        twistd_argv("--directory", str(tmp_path / "broker"), *args),
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert not (tmp_path / "broker").exists()


def test_refusal_is_one_line_without_traceback(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    directory.mkdir()
    (directory / "broker.sock").write_text("x")
    with BrokerProcess(directory) as broker:
        assert broker.wait_exit() == 1
        output = broker.output()
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if "cannot start" in line]
    assert len(lines) == 1
    assert f"{directory}/broker.sock: is a regular file" in lines[0]


def test_default_directory_as_non_root_exits_non_zero() -> None:
    require_root()  # to become UID 1000
    with BrokerProcess(None, argv_prefix=as_user_argv(1000, [])) as broker:
        assert broker.wait_exit() == 1
        output = broker.output()
    assert (
        "/var/run/hami/hostpid: the default broker directory requires effective UID 0 "
        "(running as UID 1000)" in output
    )


def test_non_root_broker_serves_its_own_directory(public_tmp: Path) -> None:
    """Another --directory takes the effective UID as the expected UID."""
    require_root()
    home = public_tmp / "home"
    home.mkdir()
    os.chown(home, 1000, 1000)
    with BrokerProcess(home / "broker", argv_prefix=as_user_argv(1000, [])) as broker:
        broker.wait_listening()
        assert os.lstat(broker.socket_path).st_uid == 1000
        assert os.lstat(home / "broker" / "broker.lock").st_uid == 1000
        assert ask_pid(broker.socket_path) == os.getpid()
        broker.terminate()
    assert not (home / "broker" / "broker.sock").exists()


def test_service_is_composable_in_a_larger_application(tmp_path: Path) -> None:
    """A device plugin can add the broker to its own MultiService."""
    directory = tmp_path / "broker"
    script = f"""
import os, sys
from twisted.application.service import MultiService
from twisted.internet import reactor
from hostpid.broker.service import BrokerService
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from support import ask_pid

top = MultiService()
broker = BrokerService(directory={str(directory)!r}, reactor=reactor,
                       environ={{"LIBVGPU_HOSTPID_BROKER": "1"}})
broker.setServiceParent(top)

def check():
    from twisted.internet.threads import deferToThread
    d = deferToThread(ask_pid, {str(directory / "broker.sock")!r})
    def done(pid):
        print("answered", pid == os.getpid(), flush=True)
        return top.stopService()
    d.addCallback(done)
    d.addBoth(lambda _: reactor.stop())

top.startService()
reactor.callWhenRunning(check)
reactor.run()
print("socket left", os.path.exists({str(directory / "broker.sock")!r}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "answered True" in result.stdout
    assert "socket left False" in result.stdout
