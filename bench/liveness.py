#!/usr/bin/env python3
"""
Micro-benchmark of the liveness checks: what vouching for one caller costs
the broker per transaction, by check.

    python3 bench/liveness.py [--rounds 7] [--calls 20000]

A child process opens connections to a listener here and keeps them (so the
peer is another live process, as in production, and its /proc/PID/stat is
another process's); each round times C{PeerIdentifier.host_pid} on those
connections for every check in turn (interleaved, so machine noise hits
every check alike), including the accept-time clock read that the
C{pidfd_open} check needs and the others do not.  Prints one line per check:
the median over rounds of the time per call, and its ratio to
C{peerpidfd} (the check of Linux 6.5+).

Unlike C{bench/run} this imports C{hostpid}: it measures one function of it,
not a server.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostpid.peercred import LivenessCheck, PeerIdentifier  # noqa: E402
from hostpid.starttime import TICK_NS  # noqa: E402

CONNECTIONS = 64


def connections_from_a_live_child(path: str) -> tuple[list[socket.socket], int, int]:
    """C{CONNECTIONS} accepted sockets whose peer is a live child; its PID and stop pipe."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(CONNECTIONS)
    stop_read, stop_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(stop_write)
        kept = []
        for _ in range(CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            kept.append(sock)
        os.read(stop_read, 1)
        os._exit(0)
    os.close(stop_read)
    accepted = [listener.accept()[0] for _ in range(CONNECTIONS)]
    listener.close()
    return accepted, child, stop_write


def time_check(
    identifier: PeerIdentifier, connections: list[socket.socket], calls: int, earlier: int
) -> float:
    """
    Seconds per call of what the broker does per transaction for this check:
    the accept-time clock read where the check wants one (moved C{earlier}
    nanoseconds into the past, as for a request that arrives after the
    accept), then C{host_pid}.
    """
    handles = list(connections)
    host_pid = identifier.host_pid
    clock = identifier.acceptClock
    per = max(1, calls // len(handles))
    started = time.perf_counter()
    if clock is None:
        for _ in range(per):
            for sock in handles:
                host_pid(sock, 0)
    else:
        for _ in range(per):
            for sock in handles:
                host_pid(sock, clock() - earlier)
    return (time.perf_counter() - started) / (per * len(handles))


#: What is timed: a label, the check, and how long before the check the
#: connection was accepted.
CASES = [
    ("peerpidfd", LivenessCheck.PEERPIDFD, 0),
    ("pidfd_open, request at accept (fast path: same clock tick, no /proc read)",
     LivenessCheck.PIDFD_OPEN, 0),
    ("pidfd_open, request a tick after accept (start time read from /proc)",
     LivenessCheck.PIDFD_OPEN, TICK_NS),
    ("none (SO_PEERCRED alone)", LivenessCheck.NONE, 0),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hostpid-bench-liveness-") as directory:
        connections, child, stop = connections_from_a_live_child(os.path.join(directory, "s"))
        try:
            identifiers = [PeerIdentifier(check=check) for _, check, _ in CASES]
            for (label, check, _), identifier in zip(CASES, identifiers, strict=True):
                assert identifier.host_pid(connections[0]) == child, label
                assert identifier.check is check, f"{check} not available on this kernel"
            samples: list[list[float]] = [[] for _ in CASES]
            for _ in range(args.rounds):
                for (_, _, earlier), identifier, values in zip(
                    CASES, identifiers, samples, strict=True
                ):
                    values.append(time_check(identifier, connections, args.calls, earlier))
        finally:
            os.close(stop)
            os.waitpid(child, 0)
            for sock in connections:
                sock.close()
    base = statistics.median(samples[0])
    print(f"kernel {os.uname().release}, {args.rounds} rounds x {args.calls} calls, median")
    for (label, _, _), values in zip(CASES, samples, strict=True):
        median = statistics.median(values)
        print(
            f"{median * 1e6:6.2f} us/transaction ({median / base:4.2f}x peerpidfd; range "
            f"{min(values) * 1e6:.2f}-{max(values) * 1e6:.2f}): {label}"
        )


if __name__ == "__main__":
    main()
