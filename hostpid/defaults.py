"""
The names and numbers of the external contract, in one place.

Server side, client side and allocation side each see the broker directory
from a different place (the host path, the container path); keeping every
default here means a change to one is a change to all.
"""

from __future__ import annotations

#: The broker directory on the host (server side).
BROKER_DIRECTORY = "/var/run/hami/hostpid"
SOCKET_NAME = "broker.sock"
LOCK_NAME = "broker.lock"
#: The handover control socket, beside the broker socket: root only (0600).
#: A new broker that finds the lock held asks the running one here for its
#: listener and lock (L{hostpid.broker.handover}).
HANDOVER_NAME = "handover.sock"
#: The broker's socket as the host (and the broker's own container) sees it:
#: what C{hostpid probe} checks by default.
BROKER_SOCKET = BROKER_DIRECTORY + "/" + SOCKET_NAME

#: Where a workload sees the broker directory: a read-only nested mount.
LOCK_PARENT = "/tmp/vgpulock"
CONTAINER_BROKER_DIRECTORY = LOCK_PARENT + "/hostpid"
CLIENT_SOCKET = CONTAINER_BROKER_DIRECTORY + "/" + SOCKET_NAME

#: One transaction deadline, server and client alike, in seconds.
DEADLINE = 0.5
#: Active transactions a broker serves at once.
MAX_CONNECTIONS = 512

#: The listening socket's accept queue.  It is a queue in front of every real
#: client: under a flood of connections a real client waits behind up to this
#: many, each costing the broker several microseconds to accept and shed.  It
#: is large enough that a burst of 1000 processes starting together is queued
#: whole (no client sees EAGAIN, which a naive client would not retry), and
#: small enough to bound that wait to about 10 ms.  Measured with bench/run's
#: reconnecting flood on 2 cores: the kernel's 4096 let the flood keep every
#: real client waiting ~40 ms (85 answered in 3 s); 1024 answered 3,029
#: (p50 44 us, p99 10.8 ms); 256 answered more (p99 1.3 ms) but made 300
#: simultaneous naive clients see EAGAIN.
LISTEN_BACKLOG = 1024

#: The metrics and health server (C{--metrics}) shares the broker's process,
#: reactor and descriptors.  It holds at most this many connections at once;
#: at the cap a newcomer evicts the oldest (closed on the next reactor turn).
#: A scraper and the kubelet's two probes need three; 16 leaves room for a
#: few scrapers and for probes that overlap, and is counted in the broker's
#: descriptor headroom (L{hostpid.broker.service.DESCRIPTOR_HEADROOM}, which
#: also says what evicted connections still closing may take for a moment).
METRICS_MAX_CONNECTIONS = 16
#: Each metrics request must arrive whole within this many seconds of the
#: connection opening or of the previous response; data trickling in does not
#: extend it (a slow sender cannot hold a slot), and an idle keep-alive
#: connection is closed when it runs out.
METRICS_REQUEST_TIMEOUT = 10.0

#: Modes the design fixes.
DIRECTORY_MODE = 0o711
SOCKET_MODE = 0o666
LOCK_MODE = 0o600
HANDOVER_MODE = 0o600
LOCK_PARENT_MODE = 0o1777

#: C{hostpid nri-probe}'s deadline, seconds over connect, write and read: below
#: the chart's C{timeoutSeconds} (3 s), with room for the interpreter's start.
NRI_PROBE_TIMEOUT = 2.0
#: Where C{hostpid nri-probe} asks by default: the chart's C{--health}
#: listener of the plugin (C{nri.probePort}) on its pod's loopback.
NRI_PROBE_ADDRESS = "127.0.0.1:9398"
