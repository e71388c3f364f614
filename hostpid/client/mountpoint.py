"""
Is the broker directory a mount point in this container?

A workload sees the broker only through the read-only mount at
C{/tmp/vgpulock/hostpid}.  Once a broker-enabled allocation has made that
directory in the shared lock parent, every later container sees it, mounted
or not: in a container whose allocation has no broker mount it is just an
empty directory, and the trust checks then report a missing socket, which
reads like "the broker is not running".  L{broker_mount_problem} says what is
really the matter.

A mount point is recognised by its mount ID (C{mnt_id} in
C{/proc/self/fdinfo}, Linux 3.15+) differing from its parent's; comparing
C{st_dev} would miss a bind mount from the same filesystem, which is exactly
what the broker mount is on a node whose C{/var/run} and C{/tmp} share one.
"""

from __future__ import annotations

import os

from hostpid import defaults

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _mount_id(path: str) -> int | None:
    try:
        fd = os.open(path, _PATH_FLAGS)
    except OSError:
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def is_mount_point(path: str) -> bool | None:
    """
    Whether C{path} is the root of a mount in this mount namespace; C{None}
    when that cannot be told (no such path, no procfs).
    """
    here = _mount_id(path)
    parent = _mount_id(os.path.dirname(path.rstrip("/")) or "/")
    if here is None or parent is None:
        return None
    return here != parent


def broker_mount_problem(socket_path: str = defaults.CLIENT_SOCKET) -> str | None:
    """
    For the container path of the broker directory only, say plainly when
    it is not a mount point (or does not exist); otherwise C{None}.  Another
    C{--socket} (a test, the host) need not be a mount point.
    """
    directory = os.path.dirname(socket_path)
    if os.path.normpath(directory) != defaults.CONTAINER_BROKER_DIRECTORY:
        return None
    if not os.path.lexists(directory):
        return (
            f"{directory} does not exist: this container's allocation has no broker mount"
        )
    if is_mount_point(directory) is False:
        return (
            f"{directory} is not a mount point: this container's allocation has no broker "
            "mount (the directory there is the lock parent's own; recreate the workload "
            "after the allocation side enables the broker)"
        )
    return None
