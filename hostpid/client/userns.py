"""
Does an owner that is not the trusted UID mean "user namespace"?

In a user namespace (Kubernetes C{hostUsers: false}, rootless runtimes) the
host's root is not mapped: the broker's directory, its socket and the
listener's C{SO_PEERCRED} all show the overflow UID (65534).  The trust
checks refuse that, rightly (nobody inside can tell the host's root from
any other unmapped owner), and this module only says so in words an
operator can act on: the cell, not a fault of the node.
"""

from __future__ import annotations

#: Where the kernel keeps the overflow UID (default 65534).
OVERFLOW_UID_PATH = "/proc/sys/kernel/overflowuid"
DEFAULT_OVERFLOW_UID = 65534
UID_MAP_PATH = "/proc/self/uid_map"
#: C{/proc/self/uid_map} in the initial user namespace.
IDENTITY_MAP = ("0", "0", "4294967295")

USER_NAMESPACE = "user namespace: the broker cannot be trusted here, workloads fall back"


def overflow_uid() -> int:
    try:
        with open(OVERFLOW_UID_PATH, encoding="ascii") as text:
            return int(text.read().strip())
    except (OSError, ValueError):
        return DEFAULT_OVERFLOW_UID


def in_user_namespace() -> bool | None:
    """Whether this process's user namespace is not the initial one; C{None}: unknown."""
    try:
        with open(UID_MAP_PATH, encoding="ascii") as text:
            lines = [tuple(line.split()) for line in text if line.strip()]
    except OSError:
        return None
    return lines != [IDENTITY_MAP]


def owner_hint(uid: int) -> str:
    """
    C{" (user namespace: ...)"} when C{uid} is the overflow UID and this
    process is (or may be) in a user namespace; else C{""}.
    """
    if uid != overflow_uid() or in_user_namespace() is False:
        return ""
    return f" ({USER_NAMESPACE}; uid {uid} is the overflow UID: the host's root is not mapped)"
