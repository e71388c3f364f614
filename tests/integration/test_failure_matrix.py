"""
The design's failure table, row by row, with a real broker process and the
real client: what the broker does, what the client does, and that the
client's failure is always a clean, fast one (bounded by its deadline),
never a wrong PID.

Rows proven elsewhere are named in docs/failure-modes.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import (
    BrokerProcess,
    ask_pid,
    connect,
    cpu_seconds,
    listen_queue,
    open_fd_count,
    read_until_eof,
    running_broker,
    stale_socket,
    wait_for,
)

from hostpid import wire
from hostpid.client.blocking import HostPidUnavailable, TrustPolicy, query_host_pid

GATE_ON = {"LIBVGPU_HOSTPID_BROKER": "1"}
DEADLINE = 0.5
#: A client failure must come within its deadline; this is the slack allowed
#: for a loaded CI machine, not a performance figure.
SLACK = 1.0


def policy_for(directory: Path, deadline: float = DEADLINE) -> TrustPolicy:
    """
    Strict checks, except the read-only mount: these brokers serve a private
    tmp directory, not a read-only bind mount (the production layout has its
    own tests).
    """
    return TrustPolicy(
        socket_path=os.fspath(directory / "broker.sock"), deadline=deadline
    ).without("read-only-mount")


def outcome(policy: TrustPolicy, environ: dict[str, str] = GATE_ON) -> tuple[object, float]:
    """The client's answer (a PID or the failure) and how long it took."""
    started = time.monotonic()
    try:
        result: object = query_host_pid(policy, environ)
    except HostPidUnavailable as failure:
        result = failure
    return result, time.monotonic() - started


def assert_clean_fast_failure(
    result: object, elapsed: float, policy: TrustPolicy, checks: set[str]
) -> None:
    assert isinstance(result, HostPidUnavailable), f"expected a failure, got {result!r}"
    assert result.check in checks, f"{result.check}: {result.observed}"
    assert elapsed < policy.deadline + SLACK, f"took {elapsed:.3f}s"


@pytest.fixture
def directory(public_tmp: Path) -> Path:
    return public_tmp / "broker"


def test_feature_disabled(directory: Path) -> None:
    """Broker: no socket.  Client: existing path (gate or socket check)."""
    with BrokerProcess(directory, gate="0") as broker:
        wait_for(lambda: "disabled" in broker.output(), "the disabled message")
        assert not directory.exists()
        policy = policy_for(directory)
        assert_clean_fast_failure(*outcome(policy, {}), policy, {"gate"})
        assert_clean_fast_failure(*outcome(policy), policy, {"directory"})
        broker.terminate()


def test_server_cannot_start(directory: Path) -> None:
    """Broker: exits 1, collision untouched.  Client: no broker there."""
    directory.mkdir()
    (directory / "broker.sock").write_text("collision")
    with BrokerProcess(directory) as broker:
        assert broker.wait_exit() == 1
    assert (directory / "broker.sock").read_text() == "collision"
    policy = policy_for(directory)
    assert_clean_fast_failure(*outcome(policy), policy, {"socket"})


def test_socket_missing(directory: Path) -> None:
    """Broker stopped cleanly: the directory stays, the socket is gone."""
    with running_broker(directory):
        pass
    assert directory.is_dir() and not (directory / "broker.sock").exists()
    policy = policy_for(directory)
    assert_clean_fast_failure(*outcome(policy), policy, {"socket"})


def test_broker_killed_leaves_a_stale_socket_the_next_start_cleans(directory: Path) -> None:
    with BrokerProcess(directory) as broker:
        broker.wait_listening()
        broker.kill()
    assert (directory / "broker.sock").is_socket(), "SIGKILL leaves the socket behind"
    policy = policy_for(directory)
    assert_clean_fast_failure(*outcome(policy), policy, {"connect"})
    with running_broker(directory) as again:
        assert "stale socket removed" in again.output()
        assert outcome(policy)[0] == os.getpid()


def stopped(broker: BrokerProcess) -> Callable[[], None]:
    """SIGSTOP the broker: it accepts nothing and answers nothing until resumed."""
    broker.process.send_signal(signal.SIGSTOP)
    return lambda: broker.process.send_signal(signal.SIGCONT)


def test_unresponsive_broker(directory: Path) -> None:
    """
    A broker that accepts (the kernel queues the connection) but never
    answers: the client gives up at its deadline; once the broker runs again
    it serves.
    """
    with running_broker(directory) as broker:
        resume = stopped(broker)
        try:
            policy = policy_for(directory)
            result, elapsed = outcome(policy)
            assert_clean_fast_failure(result, elapsed, policy, {"deadline"})
            assert elapsed >= policy.deadline * 0.9
        finally:
            resume()
        assert wait_for(lambda: outcome(policy)[0] == os.getpid(), "service again")


def test_killed_mid_transaction(directory: Path) -> None:
    """
    SIGKILL while a client waits for its reply: the client fails at once
    (the kernel closes the connection), not at its deadline.
    """
    with BrokerProcess(directory) as broker:
        broker.wait_listening()
        policy = policy_for(directory, deadline=10.0)
        results: list[tuple[object, float]] = []
        resume = stopped(broker)
        client = threading.Thread(target=lambda: results.append(outcome(policy)))
        client.start()
        try:
            wait_for(lambda: listen_queue(broker.socket_path) == 1, "the queued client")
        finally:
            broker.kill()
            resume()
        client.join(30)
    [(result, elapsed)] = results
    assert isinstance(result, HostPidUnavailable)
    assert result.check in {"reply", "connect"}, result
    assert elapsed < 5.0, "failed when the broker died, long before its 10s deadline"


def test_saturated_broker_still_answers_requests_already_waiting(directory: Path) -> None:
    """
    Every slot is held by a silent connection.  Real clients connect and send
    their request while the broker is busy (here: stopped); when it gets to
    them, their request is waiting and is answered without a slot.  A silent
    newcomer takes the oldest silent connection's slot, and that one is
    closed with no reply (before eviction the newcomer was closed instead).
    The silent ones are this process's, with no bound per peer
    (C{--max-waiting-per-peer}).
    """
    with running_broker(directory, "--max-connections", "4", "--max-waiting-per-peer", "1000",
                        "--deadline", "30") as broker:
        silent = [connect(broker.socket_path) for _ in range(4)]
        try:
            silent.append(connect(broker.socket_path))  # proves all 4 slots are held:
            assert read_until_eof(silent[0]) == b"", "the oldest is evicted"
            policy = policy_for(directory, deadline=20.0)
            results: list[tuple[object, float]] = []
            resume = stopped(broker)
            clients = [
                threading.Thread(target=lambda: results.append(outcome(policy)))
                for _ in range(8)
            ]
            try:
                for client in clients:
                    client.start()
                wait_for(lambda: listen_queue(broker.socket_path) == 8, "8 queued clients")
            finally:
                resume()
            for client in clients:
                client.join(30)
            assert [result for result, _ in results] == [os.getpid()] * 8
        finally:
            for sock in silent:
                sock.close()


def test_silent_flood_is_bounded_and_recovers(directory: Path) -> None:
    """
    Far more silent connections than slots: each newcomer evicts the oldest,
    so the broker holds at most its limit (the newest 16), keeps its
    descriptors bounded, logs a handful of lines, answers a client that
    connects and only then sends, and serves normally once the flood ends.
    The flood is this process's, with no bound per peer (C{--max-waiting-per-peer}).
    """
    with running_broker(directory, "--max-connections", "16", "--max-waiting-per-peer", "1000",
                        "--deadline", "30") as broker:
        baseline = open_fd_count(broker.pid)
        flood = [connect(broker.socket_path) for _ in range(400)]
        for sock in flood:
            sock.setblocking(False)
        shed: set[int] = set()

        def count_shed() -> int:
            for index, sock in enumerate(flood):
                if index not in shed:
                    try:
                        if sock.recv(1) == b"":
                            shed.add(index)
                    except BlockingIOError:
                        pass
            return len(shed)

        try:
            wait_for(lambda: count_shed() >= 400 - 16, "all but 16 closed by the broker")
            held = open_fd_count(broker.pid) - baseline
            assert held <= 16, f"{held} descriptors held for a limit of 16"
            assert count_shed() == 400 - 16, "the 16 in the slots stay open"
            assert shed == set(range(400 - 16)), "the oldest are the ones evicted"
            # Connect, wait until the broker has accepted (it evicts the
            # oldest for this newcomer), then send: a slow sender needs a slot.
            with connect(broker.socket_path) as slow:
                wait_for(lambda: count_shed() == 400 - 16 + 1, "the oldest held one evicted")
                slow.sendall(wire.GET_HOST_PID_REQUEST)
                assert read_until_eof(slow) == wire.encode_ok(os.getpid()), "answered"
        finally:
            for sock in flood:
                sock.close()
        wait_for(lambda: open_fd_count(broker.pid) <= baseline, "descriptors released")
        output = broker.output()
        evicted_lines = [line for line in output.splitlines() if "evicted transactions" in line]
        assert 1 <= len(evicted_lines) <= 10  # 1, 2, 4, ... 256: log2 of the flood
        assert "over_limit transactions" not in output


def test_broker_restarting(directory: Path) -> None:
    """
    A client calling in a loop across a restart: every answer is its own PID
    or a clean failure, never anything else.
    """
    policy = policy_for(directory)
    answers: list[object] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            answers.append(outcome(policy)[0])

    client = threading.Thread(target=loop)
    with running_broker(directory) as first:
        client.start()
        wait_for(lambda: os.getpid() in answers, "a first answer")
        first.terminate()
    with running_broker(directory):
        seen = len(answers)
        wait_for(lambda: os.getpid() in answers[seen:], "an answer after the restart")
        done.set()
        client.join(30)
    assert set(type(answer) for answer in answers) <= {int, HostPidUnavailable}
    assert {answer for answer in answers if isinstance(answer, int)} == {os.getpid()}


def test_broker_exits_after_startup_and_next_start_serves(directory: Path) -> None:
    """
    The socket path is replaced by a stale socket while serving: the broker
    exits 1 leaving it; the next start cleans the stale socket and serves.
    """
    with BrokerProcess(directory) as broker:
        broker.wait_listening()
        os.unlink(broker.socket_path)
        stale_socket(broker.socket_path)
        assert broker.wait_exit() == 1
        assert "replaced by another socket" in broker.output()
    assert (directory / "broker.sock").is_socket(), "the newcomer was left in place"
    with running_broker(directory) as again:
        assert "stale socket removed" in again.output()
        assert outcome(policy_for(directory))[0] == os.getpid()


def test_emfile_backs_off_without_spinning_and_recovers(directory: Path) -> None:
    """
    With a low RLIMIT_NOFILE, held connections exhaust the broker's
    descriptors: accept fails with EMFILE.  The broker backs off (no busy
    loop, a few log lines), leaves waiting clients queued rather than closing
    them, and recovers by itself when descriptors free up.
    """
    import resource

    def low_nofile() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    with BrokerProcess(
        directory, ["--max-connections", "1000", "--deadline", "3"], preexec_fn=low_nofile
    ) as broker:
        broker.wait_listening()
        held = [connect(broker.socket_path) for _ in range(80)]
        try:
            wait_for(lambda: "EMFILE" in broker.output(), "EMFILE")
            before = cpu_seconds(broker.pid)
            started = time.monotonic()
            time.sleep(1.0)  # a window to measure CPU use in, not a wait for a condition
            spent = cpu_seconds(broker.pid) - before
            assert spent < 0.5 * (time.monotonic() - started), f"spinning: {spent:.2f}s CPU"
            queued = listen_queue(broker.socket_path)
            assert queued > 0, "waiting clients stay queued, not accepted and closed"
        finally:
            for sock in held:
                sock.close()
        # The broker's held transactions end at their deadline; it accepts again.
        assert wait_for(lambda: ask_pid(broker.socket_path) == os.getpid(), "recovery")
        lines = [line for line in broker.output().splitlines() if "cannot accept" in line]
        assert 1 <= len(lines) <= 12, f"{len(lines)} EMFILE log lines"
        broker.terminate()

