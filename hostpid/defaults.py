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

#: Where a workload sees the broker directory: a read-only nested mount.
LOCK_PARENT = "/tmp/vgpulock"
CONTAINER_BROKER_DIRECTORY = LOCK_PARENT + "/hostpid"
CLIENT_SOCKET = CONTAINER_BROKER_DIRECTORY + "/" + SOCKET_NAME

#: One transaction deadline, server and client alike, in seconds.
DEADLINE = 0.5
#: Active transactions a broker serves at once.
MAX_CONNECTIONS = 512

#: Modes the design fixes.
DIRECTORY_MODE = 0o711
SOCKET_MODE = 0o666
LOCK_MODE = 0o600
LOCK_PARENT_MODE = 0o1777
