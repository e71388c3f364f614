"""
A real broker (C{twistd hostpid-broker} in its own process) answering real
clients over its real Unix socket: own PID, forked children, other PID
namespaces, other UIDs, a crowd, slow and silent clients, the limit.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import (
    WAIT_SECONDS,
    BrokerProcess,
    ask_pid,
    connect,
    exchange,
    in_child,
    nspid,
    read_until_eof,
    require_root,
    require_tool,
    running_broker,
    scaled,
    subprocess_env,
    wait_for,
)

from hostpid import wire

pytestmark = pytest.mark.kernel


@pytest.fixture
def broker(public_tmp: Path) -> Iterator[BrokerProcess]:
    with running_broker(public_tmp / "broker") as process:
        yield process


def test_client_gets_its_own_pid(broker: BrokerProcess) -> None:
    assert ask_pid(broker.socket_path) == os.getpid()


def test_forked_child_gets_its_own_pid(broker: BrokerProcess) -> None:
    child, reported = in_child(lambda: ask_pid(broker.socket_path))
    assert reported == child
    assert child != os.getpid()


def test_client_as_another_uid_is_served_its_pid(broker: BrokerProcess) -> None:
    require_root()
    child, reported = in_child(lambda: ask_pid(broker.socket_path), uid=1000)
    assert reported == child


def test_client_in_new_pid_namespace_gets_host_pid(broker: BrokerProcess) -> None:
    """
    Inside its own PID namespace the client is PID 1, yet the broker (in the
    host namespace) reports its host PID: the number NVML would show.
    """
    require_root()
    unshare = require_tool("unshare")
    script = (
        "import os, sys\n"
        "from support import ask_pid\n"
        f"print(os.getpid(), ask_pid({str(broker.socket_path)!r}), flush=True)\n"
        "sys.stdin.read()\n"
    )
    process = subprocess.Popen(
        [unshare, "--pid", "--fork", sys.executable, "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=subprocess_env(PYTHONPATH=os.pathsep.join(sys.path)),
    )
    try:
        assert process.stdout is not None
        inner_pid, reported = map(int, process.stdout.readline().split())
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        assert len(children) == 1
        host_pid = int(children[0])
        assert inner_pid == 1
        assert nspid(host_pid) == [host_pid, 1], "the client runs in a nested PID namespace"
        assert reported == host_pid
    finally:
        process.communicate("", timeout=WAIT_SECONDS)


def test_300_concurrent_clients_each_get_their_own_pid(broker: BrokerProcess) -> None:
    """300 processes released at once, like CUDA processes starting together."""
    clients = 300
    start_read, start_write = os.pipe()
    result_read, result_write = os.pipe()
    children = []
    for _ in range(clients):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            try:
                os.close(start_write)
                os.close(result_read)
                os.read(start_read, 1)
                reported = ask_pid(broker.socket_path, timeout=scaled(10)) or -1
                os.write(result_write, struct.pack("qq", os.getpid(), reported))
            finally:
                os._exit(0)
        children.append(pid)
    os.close(start_read)
    os.close(result_write)
    os.write(start_write, b"x" * clients)
    os.close(start_write)
    with os.fdopen(result_read, "rb") as reader:
        data = reader.read()
    for pid in children:
        os.waitpid(pid, 0)
    results = dict(struct.iter_unpack("qq", data))
    assert sorted(results) == sorted(children)
    wrong = {pid: got for pid, got in results.items() if got != pid}
    assert wrong == {}, f"{len(wrong)} of {clients} clients got another answer"


def test_half_closed_client_gets_its_reply(broker: BrokerProcess) -> None:
    with connect(broker.socket_path) as sock:
        sock.sendall(wire.GET_HOST_PID_REQUEST)
        sock.shutdown(socket.SHUT_WR)
        assert read_until_eof(sock) == wire.encode_ok(os.getpid())


def test_fragmented_request_over_the_real_socket(broker: BrokerProcess) -> None:
    with connect(broker.socket_path) as sock:
        for byte in wire.GET_HOST_PID_REQUEST:
            sock.sendall(bytes([byte]))
            time.sleep(0.01)  # let each byte arrive as its own read
        assert read_until_eof(sock) == wire.encode_ok(os.getpid())


def test_invalid_request_gets_status_1(broker: BrokerProcess) -> None:
    assert exchange(broker.socket_path, b"HPID\x00\x01\x00\x02") == wire.INVALID_REQUEST_RESPONSE


def test_bytes_after_the_request_are_ignored(broker: BrokerProcess) -> None:
    reply = exchange(broker.socket_path, wire.GET_HOST_PID_REQUEST + b"trailing junk")
    assert reply == wire.encode_ok(os.getpid())


def test_partial_request_is_closed_at_the_deadline(broker: BrokerProcess) -> None:
    """A client that sends 4 bytes and waits is closed, with no reply, near 0.5 s."""
    with connect(broker.socket_path, timeout=WAIT_SECONDS) as sock:
        sock.sendall(wire.GET_HOST_PID_REQUEST[:4])
        started = time.monotonic()
        assert read_until_eof(sock) == b""
        waited = time.monotonic() - started
    assert scaled(0.2) < waited < scaled(5.0), (
        f"closed after {waited:.3f}s; the deadline is {scaled(0.5)}s"
    )
    assert ask_pid(broker.socket_path) == os.getpid(), "the broker still serves"


def test_full_slots_evict_the_oldest_and_broker_recovers(public_tmp: Path) -> None:
    """
    With the limit at 4 and 4 silent clients holding every slot, a fifth that
    has not sent its request when accepted takes the slot of the oldest, which
    is closed at once with no reply; the fifth then sends and is answered.
    (The rule before eviction closed the fifth instead, so silent
    connections could keep every real client out.)  Once the silent
    ones go, the broker serves as before.  All five are this process's,
    with no bound of their own (C{--max-waiting-per-peer} above the limit): the rule between peers
    is tested in C{test_waiting.py} and C{test_attack_many_tenants.py}.
    """
    deadline = 30.0
    with running_broker(
        public_tmp / "broker", "--max-connections", "4", "--max-waiting-per-peer", "1000",
        "--deadline", str(deadline),
    ) as broker:
        silent = [connect(broker.socket_path, timeout=WAIT_SECONDS) for _ in range(4)]
        try:
            with connect(broker.socket_path, timeout=WAIT_SECONDS) as fifth:
                started = time.monotonic()
                assert read_until_eof(silent[0]) == b"", "the oldest: no reply"
                assert time.monotonic() - started < deadline / 2, "closed at once"
                for sock in silent[1:]:
                    sock.setblocking(False)
                    with pytest.raises(BlockingIOError):
                        sock.recv(1)  # still open, nothing sent to them
                fifth.sendall(wire.GET_HOST_PID_REQUEST)
                assert read_until_eof(fifth) == wire.encode_ok(os.getpid())
        finally:
            for sock in silent:
                sock.close()
        assert wait_for(lambda: ask_pid(broker.socket_path) == os.getpid(), "recovery")
        wait_for(lambda: "evicted transactions so far: 1" in broker.output(), "the log line")
