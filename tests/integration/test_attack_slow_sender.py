"""
Silent connections hold every slot, and a real client
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
from attackers import IDLE_FLOOD
from support import (
    WAIT_SECONDS,
    as_user_argv,
    connect,
    descriptor_links,
    descriptors_since,
    read_until_eof,
    require_root,
    running_broker,
    wait_for,
)

from hostpid import wire
from hostpid.broker.server import max_waiting_per_peer

pytestmark = [pytest.mark.privileged, pytest.mark.kernel]

#: Real clients, and the share of them that must be answered.
CLIENTS = 200
REQUIRED = 0.99
GAP = 0.001

def slow_sender(path: Path) -> bool:
    """One real client: connect, wait 1 ms, send; answered with its own PID?"""
    try:
        with connect(path, timeout=WAIT_SECONDS) as sock:
            time.sleep(GAP)
            sock.sendall(wire.GET_HOST_PID_REQUEST)
            return read_until_eof(sock) == wire.encode_ok(os.getpid())
    except OSError:
        return False


@pytest.mark.parametrize("share", ["unbounded", "default"])
@pytest.mark.parametrize("mode", ["static", "reconnect"])
def test_slow_senders_are_answered_while_silent_connections_hold_every_slot(
    public_tmp: Path, mode: str, share: str
) -> None:
    """
    C{unbounded}: the attacker may hold every slot (C{--max-waiting-per-peer}
    above the limit), and the slow senders get theirs by eviction.
    C{default}: the attacker holds at most its share (the fairness rule
    between peers), and the rest
    of the slots stay free.
    """
    require_root()
    limit, silent = 512, 600
    bound = ["--max-waiting-per-peer", "1000"] if share == "unbounded" else []
    held = limit if share == "unbounded" else max_waiting_per_peer(limit)
    public_tmp.chmod(0o755)
    with running_broker(
        public_tmp / "broker", "--max-connections", str(limit), *bound, "--deadline", "30"
    ) as broker:
        before = descriptor_links(broker.pid)
        attacker = subprocess.Popen(
            as_user_argv(1000, [sys.executable, "-c", IDLE_FLOOD, str(broker.socket_path),
                                str(silent), mode]),
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert attacker.stdout is not None
            assert attacker.stdout.readline() == "ready\n", "the attacker's connections"
            wait_for(lambda: descriptors_since(broker.pid, before) >= held,
                     f"{held} slots held by the attacker")
            answered = sum(slow_sender(broker.socket_path) for _ in range(CLIENTS))
            assert attacker.poll() is None, "the attack lasted the whole test"
        finally:
            attacker.kill()
            attacker.wait()
        assert answered >= REQUIRED * CLIENTS, f"{answered} of {CLIENTS} answered"
