"""
A flood of lingering sockets nested in passed Unix sockets must never stop
the broker accepting, nor get it restarted by its liveness probe.

The attack: one real UID 1000 process passes, each on a fresh connection
with a request, a Unix socket whose receive queue holds a loopback TCP
socket with C{SO_LINGER {1, 3600}} and a full send queue to a peer that
never reads: first a burst of 500, then 60 a second.  Whoever closes the
outer socket last waits out the linger unless the close is interrupted.

Before the disposer process, the broker closed them in two closer threads,
each close interrupted by the close watchdog at its second look (about 40
ms): about 50 a second drained, the rest queued, and at 512 queued the port
paused accepting; each recheck accepted a batch whose attacker connections
refilled the queue.  Real clients, HAMi-core's way (a fresh connection, the
8-byte request, a 0.5 s deadline), were then mostly not answered, and the
DaemonSet's exec liveness probe failed.  Now passed descriptors go to a
disposer process that disarms the nested socket before closing it, and
accepting never waits for it.

Asserted while the attack runs: at least 99 % of paced real clients
answered with their own PID within the 0.5 s deadline; the shipped liveness
probe (the chart's own command line and timeout) 20 of 20; C{/readyz} on the
broker's metrics port never "not ready".  Mode C{received} is forced (what
every kernel before 6.16 runs; on a kernel with C{SO_PASSRIGHTS} nothing can
be passed at all).
"""

from __future__ import annotations

import http.client
import json
import re
import select
import shlex
import subprocess
import threading
import time
from pathlib import Path

import pytest
from attackers import NESTED_LINGERING_MANY
from support import (
    WAIT_SECONDS,
    PacedClients,
    attacker_process,
    hostpid_argv,
    require_root,
    running_broker,
    scaled,
    subprocess_env,
)
from test_deploy import broker_container, daemonset, set_gate
from test_health_flood import free_port

from hostpid import defaults
from hostpid.broker.service import RECEIVE_DESCRIPTORS_ENV

pytestmark = pytest.mark.privileged

#: The issue's figures: a burst, then a steady rate, for a bounded time.
BURST = 500
RATE = 60.0
#: The attack goes on until the test has measured what it needs (its stdin
#: closed), and never longer than this.
ATTACK_SECONDS = 60.0
LINGER = 3600

#: HAMi-core's deadline: a client not answered within it falls back.
DEADLINE = scaled(defaults.DEADLINE)
#: Real clients paced over the attack, and the share that must be answered.
CLIENTS = 200
CLIENT_PAUSE = 0.04
ANSWERED_SHARE = 0.99
#: Liveness probe runs, one after another (the kubelet runs one at a time).
PROBES = 20
PROBE_PAUSE = 0.2
#: How often C{/readyz} is asked.
READYZ_EVERY = 0.25

#: argv: socket path, burst, rate a second, seconds.  Prints
#: {"prepared": N} once the burst's sockets are made, passes them, then RATE a
#: second until its stdin is closed or SECONDS after the burst began (no
#: connection is tried after that), and prints what its sends did.
ATTACKER = r"""
import array, collections, errno, json, select, socket, struct, sys, time
path, burst, rate, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
LINGER = int(sys.argv[5])
REQUEST = b"HPID\x00\x01\x00\x01"
""" + NESTED_LINGERING_MANY + r"""
outcomes = collections.Counter()
def pass_all(outers, end):
    for outer in outers:
        if time.monotonic() < end:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(1.0)
            try:
                conn.connect(path)
                conn.sendmsg([REQUEST], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          array.array("i", [outer.fileno()]))])
                outcomes["sent"] += 1
            except OSError as e:
                outcomes[errno.errorcode.get(e.errno, "timeout") if e.errno else "timeout"] += 1
            conn.close()
        else:
            outcomes["not tried"] += 1
        outer.close()
first = nested_many(LINGER, burst)
print(json.dumps({"prepared": len(first)}), flush=True)
started = time.monotonic()
end = started + seconds
pass_all(first, end)
burst_done = dict(outcomes, seconds=round(time.monotonic() - started, 2))
tick, due, next_tick = 0.1, 0.0, time.monotonic()
while time.monotonic() < end and not select.select([sys.stdin], [], [], 0)[0]:
    due += rate * tick
    count, due = int(due), due - int(due)
    if count:
        pass_all(nested_many(LINGER, count), end)
    next_tick += tick
    time.sleep(max(0.0, next_tick - time.monotonic()))
print(json.dumps({"burst": burst_done, "all": dict(outcomes),
                  "seconds": round(time.monotonic() - started, 2)}), flush=True)
"""


def shipped_liveness_probe() -> tuple[str, float]:
    """
    The DaemonSet's liveness probe: its C{hostpid probe --timeout} and the
    kubelet's C{timeoutSeconds}, from the shipped manifest.
    """
    probe = broker_container(set_gate(daemonset(), "1"))["livenessProbe"]
    script = probe["exec"]["command"][-1]
    words = shlex.split(script.split("exec", 1)[1])
    assert words[:2] == ["hostpid", "probe"], script
    return words[words.index("--timeout") + 1], float(probe["timeoutSeconds"])


class Probes(threading.Thread):
    """C{PROBES} runs of the liveness probe on C{path}, one after another."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.deadline, self.timeout = shipped_liveness_probe()
        self.outcomes: list[tuple[bool, float, str]] = []
        self.lock = threading.Lock()

    def once(self) -> None:
        started = time.monotonic()
        try:
            done = subprocess.run(
                hostpid_argv("probe", "--socket", str(self.path), "--timeout", self.deadline),
                capture_output=True, text=True, env=subprocess_env(), timeout=self.timeout,
            )
            outcome = (done.returncode == 0, done.stderr.strip())
        except subprocess.TimeoutExpired:
            outcome = (False, f"timed out after {self.timeout}s")
        with self.lock:
            self.outcomes.append((outcome[0], round(time.monotonic() - started, 2), outcome[1]))

    def run(self) -> None:
        for _ in range(PROBES):
            self.once()
            time.sleep(PROBE_PAUSE)


class Readiness(threading.Thread):
    """C{GET /readyz} on the metrics port every C{READYZ_EVERY} until stopped."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stopping = threading.Event()
        self.ready = 0
        self.problems: list[str] = []

    def run(self) -> None:
        while not self.stopping.wait(READYZ_EVERY):
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2.0)
            try:
                connection.request("GET", "/readyz")
                response = connection.getresponse()
                body = response.read().decode("utf-8", "replace").strip()
                if response.status == 200:
                    self.ready += 1
                else:
                    self.problems.append(f"{response.status} {body}")
            except (OSError, http.client.HTTPException) as e:
                self.problems.append(f"no answer: {e!r}")
            finally:
                connection.close()


def closed_by_disposer(output: str) -> int:
    """The most passed descriptors the broker said its disposer closed."""
    counts = re.findall(r"(\d+) passed descriptors closed by the disposer so far", output)
    return max((int(c) for c in counts), default=0)


def test_a_flood_of_lingering_sockets_never_stops_accepting(public_tmp: Path) -> None:
    require_root()
    port = free_port()
    with running_broker(
        public_tmp / "broker", "--metrics", f"tcp:{port}:interface=127.0.0.1",
        env={RECEIVE_DESCRIPTORS_ENV: "1"},
    ) as broker:
        with attacker_process(ATTACKER, str(broker.socket_path), str(BURST), str(RATE),
                              str(ATTACK_SECONDS), str(LINGER)) as (attacker, prepared):
            assert prepared == {"prepared": BURST}
            clients = PacedClients(broker.socket_path, CLIENTS, DEADLINE, CLIENT_PAUSE)
            probes = Probes(broker.socket_path)
            readiness = Readiness(port)
            try:
                probes.start()
                readiness.start()
                answered, waits = clients.answered_within(DEADLINE)
                probes.join(PROBES * (probes.timeout + PROBE_PAUSE) + WAIT_SECONDS)
            finally:
                clients.stop()
                readiness.stopping.set()
                readiness.join(WAIT_SECONDS)
            # The attack was still going when the last client and probe ended.
            assert attacker.stdout is not None and attacker.stdin is not None
            still_attacking = not select.select([attacker.stdout], [], [], 0)[0]
            attacker.stdin.close()
            ready, _, _ = select.select([attacker.stdout], [], [], WAIT_SECONDS)
            report = json.loads(attacker.stdout.readline()) if ready else None
        passed_probes = sum(ok for ok, _, _ in probes.outcomes)
        closed = closed_by_disposer(broker.output())
        print(f"attack: {report}; clients answered within {DEADLINE}s: {answered}/{CLIENTS} "
              f"(slowest {max(waits):.3f}s); liveness probe {passed_probes}/{PROBES} "
              f"(slowest {max((t for _, t, _ in probes.outcomes), default=0):.2f}s); "
              f"/readyz {readiness.ready} ready, {len(readiness.problems)} not: "
              f"{readiness.problems[:5]}; the broker said its disposer closed {closed}")
        assert answered >= ANSWERED_SHARE * CLIENTS, (
            f"{answered}/{CLIENTS} real clients answered within {DEADLINE}s; waits {waits}"
        )
        assert passed_probes == PROBES, f"liveness probe runs: {probes.outcomes}"
        assert not readiness.problems, f"/readyz: {readiness.problems}"
        # The attack was real: still going at the end, its burst and its
        # stream passed, and what it passed reached the disposer.
        assert still_attacking, "the attack ended before the clients and probes did"
        assert report is not None and report["burst"].get("sent", 0) >= BURST * 0.95, report
        assert report["all"]["sent"] >= BURST + RATE * report["seconds"] * 0.5, report
        assert closed >= 512, broker.output()[-3000:]

