"""
A full descriptor table in the I{received} mode (kernels without
C{SO_PASSRIGHTS}; forced here with the broker's test switch).

The attack (security review, HIGH): a UID 1000 workload opens many silent
connections, then sends on each one message carrying C{SCM_MAX_FD} (253)
descriptors: 252 copies of a pipe end and one loopback TCP socket with
C{SO_LINGER {1, 30}} and a full send queue toward a listener that never
reads.  Before the fix the broker read every message with room in its
buffer but not in its descriptor table: once the table was full the kernel
installed what fit, set C{MSG_CTRUNC} and released the rest in the broker's
only thread, the lingering socket included, so C{tcp_close} waited 30 s
there and no client was answered.  Now no read with an ancillary buffer is
made without room for a full message; a reader without room waits for the
background closer.  The broker runs with a modest C{RLIMIT_NOFILE} (1024)
so the attack needs few connections.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from attackers import LINGERING_SOCKET
from support import (
    as_user_argv,
    ask_pid,
    descriptor_links,
    descriptors_since,
    open_fd_count,
    require_root,
    running_broker,
    scaled,
    thread_states,
    wait_for,
)

from hostpid.broker.service import RECEIVE_DESCRIPTORS_ENV

pytestmark = [pytest.mark.privileged, pytest.mark.kernel]

#: The broker's soft and hard RLIMIT_NOFILE: 40 messages of 253 are ten times it.
BROKER_NOFILE = 1024
CONNECTIONS = 40
#: Scaled, as the client's bound is (support.TIME_SCALE): the bound stays a sixth of it.
LINGER = round(scaled(30))
#: A real client's bound: far below the linger time, generous for a shared machine.
CLIENT_BOUND = scaled(5.0)
ASKS = 30

#: argv: socket path, connections, linger seconds.  Prints one JSON list of
#: what each sendmsg gave, then waits for stdin to close (its listeners keep
#: the passed sockets lingering).
ATTACKER = r"""
import errno, json, os, resource, socket, struct, sys, time
path, count, linger = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # descriptors in flight count
""" + LINGERING_SOCKET + r"""
read_end, write_end = os.pipe()
socks = [lingering(linger) for _ in range(count)]
conns = []
for _ in range(count):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conns.append(conn)
print("connected", flush=True)
sys.stdin.readline()  # the test says "go" once the broker holds them all
results = []
for conn, sock in zip(conns, socks):
    fds = [read_end] * 252 + [sock.fileno()]
    try:
        conn.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                struct.pack(f"{len(fds)}i", *fds))])
        results.append("sent")
    except OSError as e:
        results.append(errno.errorcode[e.errno])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
print(json.dumps(results), flush=True)
sys.stdin.read()
"""


def _modest_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (BROKER_NOFILE, BROKER_NOFILE))


def test_a_full_descriptor_table_does_not_freeze_the_broker(public_tmp: Path) -> None:
    require_root()
    # The attacker's connections are all one process's: no bound per peer
    # (the fairness rule between peers), or all but its share would be closed at accept, and the
    # table is what this test is about.
    with running_broker(
        public_tmp / "broker", "--max-waiting-per-peer", "1000",
        env={RECEIVE_DESCRIPTORS_ENV: "1"},
        preexec_fn=_modest_descriptor_limit,
    ) as broker:
        before = descriptor_links(broker.pid)
        attacker = subprocess.Popen(
            as_user_argv(1000, [sys.executable, "-c", ATTACKER, str(broker.socket_path),
                                str(CONNECTIONS), str(LINGER)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert attacker.stdout is not None and attacker.stdin is not None
            assert attacker.stdout.readline() == "connected\n"
            # Silent and accepted: the messages arrive on the general path.
            wait_for(lambda: descriptors_since(broker.pid, before) >= CONNECTIONS,
                     "the broker to hold every attacker connection")
            attacker.stdin.write("go\n")
            attacker.stdin.flush()
            results = json.loads(attacker.stdout.readline())
            assert results == ["sent"] * CONNECTIONS, results
            waits = []
            for _ in range(ASKS):
                started = time.monotonic()
                pid = ask_pid(broker.socket_path, timeout=CLIENT_BOUND)
                waits.append(round(time.monotonic() - started, 3))
                assert pid == os.getpid(), (
                    f"a real client was not answered: {waits}; broker threads: "
                    f"{thread_states(broker.pid)}; {open_fd_count(broker.pid)} descriptors; "
                    f"log:\n{broker.output()[-3000:]}"
                )
            # Every message was received (so the attack did run against a
            # table ten times too small for it) and the broker still answers.
            wait_for(lambda: "descriptors transactions so far: 32" in broker.output(),
                     "the attack's connections counted as outcome descriptors")
            assert ask_pid(broker.socket_path, timeout=CLIENT_BOUND) == os.getpid()
        finally:
            attacker.kill()
            attacker.wait()
        assert max(waits) < CLIENT_BOUND, waits
