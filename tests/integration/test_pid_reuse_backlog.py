"""
A PID reused while the connection waits in the broker's backlog, against a
real broker that checks callers by their start time (the liveness check of
kernels before 6.5, forced here).

The attack: while the broker is not accepting (here it is stopped with
SIGSTOP; a tenant could stall it for seconds before accepting could no longer
be paused), a child connects a socket its parent made, sends the request and
exits; the parent reaps it and has the child's PID given to a new process
that starts I{before} the broker accepts.  Compared with the accept, that
process started earlier and passed: the broker answered its PID, status 0,
to the parent.  Compared with the last moment the backlog was seen empty, it
started later: the connection is closed with no reply and the client falls
back.

A tenant cannot choose a host PID: it gets one back only by cycling the PID
space, which takes at least L{hostpid.peercred.pid_cycle_ns}.  This test
reuses the PID through C{ns_last_pid} (root only) and so first waits that
long, as a tenant's reuse would have to.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from support import require_root, running_broker

from hostpid import wire
from hostpid.broker.service import LIVENESS_ENV, RECEIVE_DESCRIPTORS_ENV
from hostpid.peercred import pid_cycle_ns
from hostpid.starttime import TICK_NS, boottime_ns

pytestmark = [pytest.mark.privileged, pytest.mark.kernel]


def next_tick() -> None:
    """Return once CLOCK_BOOTTIME has entered a new clock tick (bounded)."""
    now = boottime_ns() // TICK_NS
    deadline = time.monotonic() + 2
    while boottime_ns() // TICK_NS <= now:
        assert time.monotonic() < deadline, "CLOCK_BOOTTIME did not move"
        time.sleep(0.001)


def wait_until(moment: int) -> None:
    """Return once CLOCK_BOOTTIME has passed C{moment} (bounded)."""
    deadline = time.monotonic() + 10
    while boottime_ns() <= moment:
        assert time.monotonic() < deadline, "CLOCK_BOOTTIME did not reach the moment"
        time.sleep(0.001)


def process_with_pid(pid: int, tries: int = 50) -> tuple[int, int]:
    """
    A process that waits on a pipe, started with PID C{pid} through the
    initial namespace's C{ns_last_pid} (root only).  Another process on the
    host may take the PID first: then try again, boundedly.

    @return: its PID and the pipe's write end that ends it.
    """
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as last:
            last.write(str(pid - 1))
        stop_read, stop_write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            os.close(stop_write)
            os.read(stop_read, 1)
            os._exit(0)
        os.close(stop_read)
        if child == pid:
            return child, stop_write
        os.close(stop_write)
        os.waitpid(child, 0)
    raise AssertionError(f"PID {pid} could not be reused in {tries} tries")


@pytest.mark.parametrize("mode", ["refused", "received"])
def test_a_pid_reused_while_the_connection_waits_in_the_backlog_gets_no_reply(
    public_tmp: Path, mode: str
) -> None:
    require_root()
    env = {LIVENESS_ENV: "pidfd_open"}
    if mode == "received":
        env[RECEIVE_DESCRIPTORS_ENV] = "1"
    with running_broker(public_tmp / "broker", env=env) as broker:
        brokerPid = broker.process.pid
        os.kill(brokerPid, signal.SIGSTOP)
        stopped = boottime_ns()
        stop = None
        try:
            # The broker's last look at its backlog was before it stopped;
            # a new tick makes every process started from here on start
            # later than that look, to the tick.
            next_tick()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            child = os.fork()
            if child == 0:  # pragma: no cover - runs in the child
                try:
                    sock.connect(os.fspath(broker.socket_path))
                    sock.sendall(wire.GET_HOST_PID_REQUEST)
                finally:
                    os._exit(0)
            os.waitpid(child, 0)
            # As long as a tenant would need to get the PID back, and a tick.
            wait_until(stopped + pid_cycle_ns() + TICK_NS)
            reused, stop = process_with_pid(child)
            # The reuser started before the accept, by a whole tick: compared
            # with the accept, it passes.
            next_tick()
        finally:
            os.kill(brokerPid, signal.SIGCONT)
        try:
            sock.settimeout(5)
            reply = b""
            while len(reply) < wire.RESPONSE_SIZE:
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
        finally:
            sock.close()
            if stop is not None:
                os.close(stop)
                os.waitpid(reused, 0)
        answered = wire.parse_response(reply) if len(reply) == wire.RESPONSE_SIZE else reply
        assert reply == b"", f"answered {answered!r} for PID {reused}, which did not connect"
