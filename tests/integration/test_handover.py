"""
Handover between an old and a new broker on one node, with real processes:
continuous HAMi-core-like load (a client process every 5 ms, each checking
that the PID answered is its own) across 20 handovers back to back, in both
descriptor modes; and attacks on the control socket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from continuity import continuous_load, no_fallbacks
from support import (
    REPO,
    WAIT_SECONDS,
    BrokerProcess,
    as_user_argv,
    ask_pid,
    require_root,
    require_tool,
    subprocess_env,
    wait_for,
)

from hostpid.broker.service import RECEIVE_DESCRIPTORS_ENV

HANDOVERS = 20


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    path = tmp_path / "broker"
    path.mkdir(mode=0o711)
    os.chmod(path, 0o711)
    return path


def mode_env(mode: str, round_: int) -> dict[str, str]:
    received = mode == "received" or (mode == "alternating" and round_ % 2 == 1)
    return subprocess_env({RECEIVE_DESCRIPTORS_ENV: "1"} if received else {})


@pytest.fixture
def brokers() -> Iterator[list[BrokerProcess]]:
    started: list[BrokerProcess] = []
    yield started
    for broker in started:
        broker.kill()


def took_over(broker: BrokerProcess) -> None:
    wait_for(lambda: "handover complete" in broker.output(), "the handover", WAIT_SECONDS)


def inode(path: Path) -> int:
    return os.stat(path).st_ino


@pytest.mark.parametrize("mode", ["refused", "received", "alternating"])
def test_handovers_back_to_back_leave_every_client_answered(
    directory: Path, hamiload: Path, brokers: list[BrokerProcess], mode: str
) -> None:
    require_root()
    socket_path = directory / "broker.sock"
    ready = [directory.parent / f"ready-{round_}" for round_ in range(HANDOVERS + 1)]
    first = BrokerProcess(directory, ["--ready-file", str(ready[0])], env=mode_env(mode, 0))
    brokers.append(first)
    first.wait_listening()
    assert ready[0].read_text() == f"{first.pid}\n"
    original = inode(socket_path)
    report: dict[str, object] = {}
    with continuous_load(hamiload, socket_path, report):
        for round_ in range(1, HANDOVERS + 1):
            old = brokers[-1]
            new = BrokerProcess(
                directory, ["--ready-file", str(ready[round_])], env=mode_env(mode, round_)
            )
            brokers.append(new)
            assert old.wait_exit() == 0, old.output()
            took_over(new)
            # Ready means "this broker holds the listener": the old one's file is gone.
            assert not ready[round_ - 1].exists() and ready[round_].exists()
            assert "socket left to the broker that took over" in old.output()
            assert new.process.poll() is None, new.output()
            assert inode(socket_path) == original, "the same socket, never a new one"
            received = RECEIVE_DESCRIPTORS_ENV in mode_env(mode, round_)
            assert ("descriptor passing refused" in new.output()) != received, new.output()
    last = brokers[-1]
    assert ask_pid(socket_path) == os.getpid()
    assert last.terminate() == -signal.SIGTERM, "twistd re-raises SIGTERM after a clean stop"
    assert not socket_path.exists(), "the last owner removes the socket at its stop"
    assert not (directory / "handover.sock").exists()
    print(f"handovers {HANDOVERS} ({mode}): {report}")
    assert report["clients"] and report["clients"] > HANDOVERS * 10, report
    assert report["fallbacks"] == 0, no_fallbacks(report)
    assert report["wrong"] == 0, no_fallbacks(report)


def test_a_sigkill_leaves_a_gap_that_the_next_broker_closes(
    directory: Path, hamiload: Path, brokers: list[BrokerProcess]
) -> None:
    """
    No handover is possible from a killed broker: this measures the gap it
    leaves (reported, not hidden), and checks that its stale control socket
    does not keep the next broker from starting and handing over in turn.
    """
    require_root()
    socket_path = directory / "broker.sock"
    first = BrokerProcess(directory)
    brokers.append(first)
    first.wait_listening()
    report: dict[str, object] = {}
    with continuous_load(hamiload, socket_path, report):
        wait_for(lambda: (directory / "handover.sock").exists(), "the control socket")
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        assert (directory / "handover.sock").exists(), "a stale control socket is left"
        second = BrokerProcess(directory)
        brokers.append(second)
        second.wait_listening()
        assert "stale socket removed" in second.output()
        wait_for(lambda: "handover control socket:" in second.output(), "a new control socket")
        third = BrokerProcess(directory)
        brokers.append(third)
        assert second.wait_exit() == 0, second.output()
        took_over(third)
    print(f"SIGKILL then restart: {report}")
    assert report["wrong"] == 0, no_fallbacks(report)
    assert ask_pid(socket_path) == os.getpid()


def test_a_new_broker_without_a_handover_refuses_in_one_line(
    directory: Path, brokers: list[BrokerProcess]
) -> None:
    """A control socket that is not 0600 is not used: the lock held refuses, as before."""
    require_root()
    first = BrokerProcess(directory)
    brokers.append(first)
    first.wait_listening()
    wait_for(lambda: (directory / "handover.sock").exists(), "the control socket")
    os.chmod(directory / "handover.sock", 0o666)
    second = BrokerProcess(directory)
    brokers.append(second)
    assert second.wait_exit() != 0
    line = [line for line in second.output().splitlines() if "cannot start:" in line][-1]
    assert "is locked by another broker" in line and "no handover:" in line
    assert "not a socket of UID 0 with mode 0600" in line
    assert first.process.poll() is None
    assert ask_pid(directory / "broker.sock") == os.getpid()


# --- Attacks on the control socket, each a real process. ---

#: A process posing as a new broker: ASK, then print what came back.
POSER = textwrap.dedent(
    """
    import socket, sys
    from hostpid.broker import handover
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(sys.argv[1])
    except OSError as e:
        print("connect", e.errno, flush=True)
        sys.exit(0)
    try:
        sock.sendall(handover.encode(handover.Message(handover.Kind.ASK)))
    except BrokenPipeError:
        pass  # refused at accept: the refusal is waiting to be read
    data, fds, _, _ = socket.recv_fds(sock, handover.MESSAGE_SIZE, 4)
    message = handover.decode(data) if len(data) == handover.MESSAGE_SIZE else None
    print(message.kind.name if message else "closed", len(fds), message.reason if message else "",
          flush=True)
    if sys.argv[2:] == ["die"]:
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def run_poser(
    argv_prefix: list[str], control: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*argv_prefix, sys.executable, "-c", POSER, str(control), *extra],
        capture_output=True, text=True, timeout=WAIT_SECONDS, env=subprocess_env(),
        cwd=str(REPO), check=False,
    )


@pytest.fixture
def serving(directory: Path, brokers: list[BrokerProcess]) -> BrokerProcess:
    require_root()
    broker = BrokerProcess(directory)
    brokers.append(broker)
    broker.wait_listening()
    wait_for(lambda: (directory / "handover.sock").exists(), "the control socket")
    return broker


def still_serving(broker: BrokerProcess, directory: Path) -> None:
    assert broker.process.poll() is None, broker.output()
    assert ask_pid(directory / "broker.sock") == os.getpid()
    assert "handed over" not in broker.output()


def test_uid_1000_cannot_reach_the_control_socket(
    directory: Path, serving: BrokerProcess
) -> None:
    done = run_poser(as_user_argv(1000, []), directory / "handover.sock")
    assert done.stdout.split() == ["connect", "13"], done  # EACCES: the socket is 0600
    still_serving(serving, directory)


def test_root_in_another_pid_namespace_gets_nothing(
    directory: Path, serving: BrokerProcess
) -> None:
    unshare = require_tool("unshare")
    done = run_poser([unshare, "--pid", "--fork", "--mount-proc"], directory / "handover.sock")
    kind, count, *reason = done.stdout.split()
    assert (kind, count) == ("REFUSED", "0"), done
    assert "not this broker's" in " ".join(reason)
    wait_for(lambda: "handover refused" in serving.output(), "the refusal in the log")
    still_serving(serving, directory)


def test_a_new_broker_dying_mid_handover_leaves_the_old_serving(
    directory: Path, serving: BrokerProcess, hamiload: Path
) -> None:
    report: dict[str, object] = {}
    with continuous_load(hamiload, directory / "broker.sock", report):
        done = run_poser([], directory / "handover.sock", "die")
        assert done.returncode == -signal.SIGKILL
        assert done.stdout.split()[:2] == ["OFFER", "2"], done
        wait_for(lambda: "went away before taking over" in serving.output(), "the abandon")
        still_serving(serving, directory)
    assert report["fallbacks"] == 0 and report["wrong"] == 0, no_fallbacks(report)
    # And the next real handover still works.
    new = BrokerProcess(directory)
    try:
        assert serving.wait_exit() == 0
        took_over(new)
    finally:
        new.terminate()


def test_one_handover_at_a_time(directory: Path, serving: BrokerProcess) -> None:
    """A second asker while one session is open is refused at once."""
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first.settimeout(WAIT_SECONDS)
    first.connect(str(directory / "handover.sock"))
    done = run_poser([], directory / "handover.sock")
    assert done.stdout.split()[:2] == ["REFUSED", "0"], done
    assert "already in progress" in done.stdout
    first.close()
    still_serving(serving, directory)


def test_after_handover_wait_idles_until_sigterm(
    directory: Path, brokers: list[BrokerProcess], tmp_path: Path
) -> None:
    """
    In Kubernetes an exited container is restarted and would take the
    listener back: with C{--after-handover wait} the old broker stops serving
    and idles, unready, until its pod is deleted.
    """
    require_root()
    ready_old, ready_new = tmp_path / "ready-old", tmp_path / "ready-new"
    old = BrokerProcess(directory, ["--after-handover", "wait", "--ready-file", str(ready_old)])
    brokers.append(old)
    old.wait_listening()
    new = BrokerProcess(directory, ["--after-handover", "wait", "--ready-file", str(ready_new)])
    brokers.append(new)
    took_over(new)
    wait_for(lambda: "stopped; lock released" in old.output(), "the old broker's stop")
    assert old.process.poll() is None, "still running, idle"
    assert not ready_old.exists() and ready_new.exists()
    assert ask_pid(directory / "broker.sock") == os.getpid()
    assert old.terminate() == -signal.SIGTERM
    assert ask_pid(directory / "broker.sock") == os.getpid(), "the new broker still serves"
    assert "handed over to PID" not in new.output(), "no handover back"
