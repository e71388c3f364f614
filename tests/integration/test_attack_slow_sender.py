"""
Issue 12, item 1: silent connections hold every slot, and a real client
leaves a 1 ms gap between C{connect()} and C{send()}.

Before the eviction rule the broker accepted such a client while every slot
was busy and closed it at once (3 of 200 answered, measured); now the
newcomer takes the slot of the oldest waiting connection.  The attacker is a
real UID 1000 process, silent, either holding its connections (static) or
re-opening each one the broker closes (reconnecting).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import (
    WAIT_SECONDS,
    as_user_argv,
    connect,
    open_fd_count,
    read_until_eof,
    require_root,
    running_broker,
    wait_for,
)

from hostpid import wire

pytestmark = [pytest.mark.privileged, pytest.mark.kernel]

#: Real clients, and the share of them that must be answered.
CLIENTS = 200
REQUIRED = 0.99
GAP = 0.001

#: The attacker: N silent connections to argv[1]; with argv[3] == "reconnect"
#: each one the broker closes is opened again at once.  It prints "ready"
#: once N are open and runs until killed.
ATTACKER = r"""
import selectors, socket, sys
path, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
selector = selectors.DefaultSelector()
def open_one():
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            continue
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        return
for _ in range(n):
    open_one()
print("ready", flush=True)
while True:
    for key, _ in selector.select():
        try:
            data = key.fileobj.recv(64)
        except ConnectionError:
            data = b""
        if not data:
            selector.unregister(key.fileobj)
            key.fileobj.close()
            if mode == "reconnect":
                open_one()
"""


def slow_sender(path: Path) -> bool:
    """One real client: connect, wait 1 ms, send; answered with its own PID?"""
    try:
        with connect(path, timeout=WAIT_SECONDS) as sock:
            time.sleep(GAP)
            sock.sendall(wire.GET_HOST_PID_REQUEST)
            return read_until_eof(sock) == wire.encode_ok(os.getpid())
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["static", "reconnect"])
def test_slow_senders_are_answered_while_silent_connections_hold_every_slot(
    public_tmp: Path, mode: str
) -> None:
    require_root()
    limit, silent = 512, 600
    public_tmp.chmod(0o755)
    with running_broker(
        public_tmp / "broker", "--max-connections", str(limit), "--deadline", "30"
    ) as broker:
        baseline = open_fd_count(broker.pid)
        attacker = subprocess.Popen(
            as_user_argv(1000, [sys.executable, "-c", ATTACKER, str(broker.socket_path),
                                str(silent), mode]),
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert attacker.stdout is not None
            assert attacker.stdout.readline() == "ready\n", "the attacker's connections"
            wait_for(lambda: open_fd_count(broker.pid) >= baseline + limit,
                     "every slot held by the attacker")
            answered = sum(slow_sender(broker.socket_path) for _ in range(CLIENTS))
            assert attacker.poll() is None, "the attack lasted the whole test"
        finally:
            attacker.kill()
            attacker.wait()
        assert answered >= REQUIRED * CLIENTS, f"{answered} of {CLIENTS} answered"
