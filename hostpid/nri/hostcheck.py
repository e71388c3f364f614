"""
The host side of the NRI decision: whether the mounts a qualifying
container would get can be made safely now.  I/O, kept out of the pure
L{hostpid.nri.decision}, which is given the result.

Two things are looked at before every adjustment:

  - the broker directory and the lock parent exist (a bind mount of a
    missing source fails the container's creation);
  - the broker mountpoint C{<lock parent>/hostpid}, the entry in the shared,
    writable lock parent onto which the runtime mounts the broker directory,
    is a directory owned by the trusted UID, looked at without following a
    link (C{O_NOFOLLOW} open of the lock parent, then C{fstatat} with
    C{AT_SYMLINK_NOFOLLOW}).  A workload that can write the lock parent
    (HAMi-family device plugins leave it 0777, without the sticky bit) can
    rename that entry and put a file there (runc then fails every later GPU
    container: C{not a directory}) or a symlink (runc resolves the
    destination inside the container's root, so a link to C{/etc} mounts the
    broker directory over the container's own C{/etc}).

When the mountpoint is wrong, or the lock parent lost its sticky bit, it is
repaired as C{hostpid allocate} repairs it: by
L{hostpid.node.lockparent.prepare_lock_parent} (the same code, imported), which
puts a finished root-owned 0755 directory in place atomically and makes the
lock parent root's 01777 again.  Once the lock parent is sticky and the entry
root's, no other user can rename or replace it, so the check and the runtime's
mount see the same directory.  When the repair is impossible (the plugin sees
the lock parent read-only, an ancestor is unsafe), the problem is passed to the
decision, which then gives the lock parent alone: never a mount that fails the
container or lands on one of its directories.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

import attrs

from hostpid import defaults
from hostpid.node.lockparent import (
    MOUNTPOINT_NAME,
    LockParentError,
    MountpointRepair,
    describe_type,
    prepare_lock_parent,
)

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@attrs.frozen
class HostState:
    """
    What L{HostCheck.check} saw.

    @ivar missing: the host paths the mounts name that are not directories
        (empty when both are).
    @ivar mountpoint_problem: empty when C{<lock parent>/hostpid} is a
        directory owned by the trusted UID (as found or once repaired); what
        is wrong with it otherwise.
    @ivar repairs: what the repair found and did, when one was made.
    @ivar repair_failure: why a repair was not possible, when one was tried
        and failed (also when only the lock parent's mode was off and the
        mountpoint itself is fine).
    @ivar made: the mountpoint did not exist and was made (a first use, not
        a repair: C{prepare_lock_parent} reports one that an earlier
        preparation had made as a repair).
    """

    missing: tuple[str, ...] = ()
    mountpoint_problem: str = ""
    repairs: tuple[MountpointRepair, ...] = ()
    repair_failure: str = ""
    made: bool = False

    @property
    def broker_present(self) -> bool:
        return not self.missing


def _look(lock_parent: str, trusted_uid: int) -> tuple[str, bool]:
    """
    The mountpoint's problem ("" when it is a directory of C{trusted_uid}),
    and whether the lock parent is as preparation leaves it (owned by
    C{trusted_uid}, mode 01777).  Nothing followed, nothing changed.
    """
    try:
        fd = os.open(lock_parent, _DIRECTORY_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return f"the lock parent {lock_parent} is not a directory (a symlink?)", False
        return f"the lock parent {lock_parent} cannot be opened: {e.strerror}", False
    try:
        held = os.fstat(fd)
        prepared = (held.st_uid == trusted_uid
                    and stat.S_IMODE(held.st_mode) == defaults.LOCK_PARENT_MODE)
        shown = f"{lock_parent}/{MOUNTPOINT_NAME}"
        try:
            st = os.stat(MOUNTPOINT_NAME, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return f"{shown} does not exist", prepared
        except OSError as e:
            return f"{shown} cannot be looked at: {e.strerror}", prepared
        if not stat.S_ISDIR(st.st_mode):
            return f"{shown} is a {describe_type(st.st_mode)} owned by UID {st.st_uid}", prepared
        if st.st_uid != trusted_uid:
            return (f"{shown} is a directory owned by UID {st.st_uid}, not the trusted UID "
                    f"{trusted_uid}"), prepared
        return "", prepared
    finally:
        os.close(fd)


@attrs.define
class HostCheck:
    """
    Looks at the host before an adjustment, and repairs the mountpoint when
    it can (L{check}).

    @ivar prepare: L{prepare_lock_parent}, injected for tests.
    """

    lock_parent: str
    broker_dir: str
    trusted_uid: int = 0
    prepare: Callable[..., object] = prepare_lock_parent

    def presence(self) -> tuple[str, ...]:
        """The host paths the mounts name that are not directories now."""
        return tuple(p for p in (self.broker_dir, self.lock_parent) if not os.path.isdir(p))

    def check(self) -> HostState:
        """
        Look, and repair what needs it.  Never raises for the host's state:
        every problem is in the answer.
        """
        missing = self.presence()
        if missing:
            return HostState(missing=missing)
        problem, prepared = _look(self.lock_parent, self.trusted_uid)
        if not problem and prepared:
            return HostState()
        try:
            done = self.prepare(self.lock_parent, broker_enabled=True,
                                trusted_uid=self.trusted_uid)
        except LockParentError as e:
            return HostState(mountpoint_problem=problem, repair_failure=str(e))
        except OSError as e:  # pragma: no cover - prepare_lock_parent wraps these
            return HostState(mountpoint_problem=problem, repair_failure=str(e))
        repairs = tuple(getattr(done, "repairs", ()))
        return HostState(repairs=repairs, made=bool(problem) and not repairs)
