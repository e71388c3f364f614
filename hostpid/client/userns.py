"""
Which ownership rule holds where the client runs: the host's, or the one
for a user namespace that does not map the host's root.

In the initial user namespace the broker's directory, its socket and the
listener's C{SO_PEERCRED} name the trusted UID (root) as it is.  In a user
namespace that does not map the host's root (Kubernetes C{hostUsers:
false}) the kernel shows them otherwise, and the client applies the rule
argued in C{docs/userns.md}:

  - the directory and the socket must show the host's root as a mount can
    show it: UID 0 through an idmapped mount with the pod's own mapping, the
    overflow UID through a mount without an idmapping.  Neither number
    proves the owner (the pod maps both: its root and its nobody); what
    keeps the pod's own files off this path is that only the runtime, or a
    process with C{CAP_SYS_ADMIN} over the client's mount namespace, can
    mount there;
  - the listener must show as the overflow UID I{and} PID 0: the kernel's
    C{from_kuid_munged} gives the overflow UID for an unmapped owner and,
    since 65534 is a UID a 65,536-ID pod mapping does map, the PID 0 (the
    listener is outside this PID namespace) is what keeps every process of
    this container out.

Everything here is decided from C{/proc/self/uid_map} read once per
transaction, so that the rule can never apply in the initial user namespace:
there the identity map is the proof, and the host's rule holds unchanged.
"""

from __future__ import annotations

from hostpid.values import Value

#: Where the kernel keeps the overflow UID (default 65534).
OVERFLOW_UID_PATH = "/proc/sys/kernel/overflowuid"
DEFAULT_OVERFLOW_UID = 65534
UID_MAP_PATH = "/proc/self/uid_map"
#: C{/proc/self/uid_map} in the initial user namespace.
IDENTITY_MAP = ((0, 0, 4294967295),)

USER_NAMESPACE = "user namespace: the broker cannot be trusted here, workloads fall back"
NOT_HOST_ROOT = (
    "user namespace: the host's root shows here as uid 0 through an idmapped mount or as "
    "the overflow UID through a plain one, never as another UID (docs/userns.md)"
)


def overflow_uid() -> int:
    try:
        with open(OVERFLOW_UID_PATH, encoding="ascii") as text:
            return int(text.read().strip())
    except (OSError, ValueError):
        return DEFAULT_OVERFLOW_UID


class UserNamespace(Value):
    """
    This process's user namespace, as far as the trust rule cares.

    @ivar uid_map: the extents of C{/proc/self/uid_map} (inside, outside,
        count), or C{None}: it could not be read.
    @ivar overflow_uid: what the kernel shows for an unmapped UID.
    """

    __slots__ = ("uid_map", "overflow_uid")
    uid_map: tuple[tuple[int, int, int], ...] | None
    overflow_uid: int

    def __init__(
        self, uid_map: tuple[tuple[int, int, int], ...] | None, overflow_uid: int
    ) -> None:
        self._set(uid_map=uid_map, overflow_uid=overflow_uid)

    @property
    def initial(self) -> bool | None:
        """Whether this is the initial user namespace; C{None}: unknown."""
        if self.uid_map is None:
            return None
        return self.uid_map == IDENTITY_MAP

    def maps_outside(self, uid: int) -> bool:
        """Whether an extent maps the parent's C{uid} into this namespace."""
        assert self.uid_map is not None
        return any(outside <= uid < outside + count for _, outside, count in self.uid_map)

    def unmaps(self, trusted_uid: int) -> bool:
        """
        Whether the user-namespace rule applies: this is not the initial
        user namespace and its map does not cover the trusted UID.

        The map names the parent's IDs, so in a nested namespace this can
        only err towards "mapped" (the parent's C{trusted_uid} is not the
        host's), where the host's rule stays in force and refuses: the
        rule never applies where it has not been shown to hold.
        """
        if self.initial is not False:
            return False
        return not self.maps_outside(trusted_uid)

    def describe(self) -> str:
        if self.uid_map is None:
            return f"user namespace unknown ({UID_MAP_PATH} unreadable)"
        if self.initial:
            return "initial user namespace"
        extents = ", ".join(
            f"{inside}->{outside}x{count}" for inside, outside, count in self.uid_map
        )
        return f"user namespace (uid_map {extents})"


def _parse(text: str) -> tuple[tuple[int, int, int], ...]:
    extents = []
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 3:
            raise ValueError(line)
        inside, outside, count = (int(field) for field in fields)
        extents.append((inside, outside, count))
    return tuple(extents)


def read_user_namespace() -> UserNamespace:
    """This process's user namespace, from procfs (one read of each file)."""
    try:
        with open(UID_MAP_PATH, encoding="ascii") as text:
            uid_map: tuple[tuple[int, int, int], ...] | None = _parse(text.read())
    except (OSError, ValueError):
        uid_map = None
    return UserNamespace(uid_map, overflow_uid())


def in_user_namespace() -> bool | None:
    """Whether this process's user namespace is not the initial one; C{None}: unknown."""
    initial = read_user_namespace().initial
    return None if initial is None else not initial


def owner_hint(uid: int, namespace: UserNamespace | None = None, trusted_uid: int = 0) -> str:
    """
    Words for a refused owner C{uid} when this process is (or may be) in a
    user namespace; C{""} in the initial one.
    """
    if namespace is None:
        namespace = read_user_namespace()
    if namespace.initial is True:
        return ""
    if namespace.unmaps(trusted_uid):
        return f" ({NOT_HOST_ROOT})"
    if uid != namespace.overflow_uid:
        return ""
    if namespace.initial is None:
        return f" ({USER_NAMESPACE}; uid {uid} is the overflow UID: the host's root is not mapped)"
    return (
        f" (this user namespace maps the host's uid {trusted_uid}, so the host's rule applies; "
        f"uid {uid} is the overflow UID)"
    )
