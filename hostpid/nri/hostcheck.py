"""
The host side of the NRI decision: whether the mounts a qualifying
container would get can be made safely now.  I/O, kept out of the pure
L{hostpid.nri.decision}, which is given the result.

Two things are looked at before every adjustment:

  - the broker directory and the lock parent exist (a bind mount of a
    missing source fails the container's creation);
  - the broker mountpoint C{<lock parent>/hostpid}, the entry in the shared,
    writable lock parent onto which the runtime mounts the broker directory,
    is a directory owned by the trusted UID, mode 0755 exactly, and
    immutable, looked at without following a link (C{O_NOFOLLOW} open of
    the lock parent, then of the entry with C{O_DIRECTORY | O_NOFOLLOW}).
    A workload that can write the lock parent (HAMi's device plugin makes it
    0777 on every allocation, without the sticky bit) can rename that entry
    and put a file there (runc then fails every later GPU container: C{not a
    directory}) or a symlink (runc resolves the destination inside the
    container's root, so a link to C{/etc} mounts the broker directory over
    the container's own C{/etc}); and it can rename or remove the entry
    under a running container, which detaches the broker mount there.

When the mountpoint is wrong, not immutable, or the lock parent lost its
sticky bit, it is repaired as C{hostpid allocate} repairs it: by
L{hostpid.node.lockparent.prepare_lock_parent} (the same code, imported), which
puts a finished root-owned 0755 directory in place atomically, makes it
immutable (L{hostpid.fileattr}) and makes the lock parent root's 01777
again.  The sticky bit alone is not enough: the device plugin takes it away
again at its next allocation, at any moment between this look and the
runtime's mount.  The immutable attribute holds whatever the lock parent's
mode: the kernel refuses to rename, remove or replace an immutable inode for
anyone without C{CAP_LINUX_IMMUTABLE} (no container has it by default), so
the look and the runtime's mount see the same directory, and the running
containers keep their broker mount.  When the repair is impossible (the plugin
sees the lock parent read-only, an ancestor is unsafe) or the flag cannot be
set (a filesystem without it, such as tmpfs before Linux 6.0; a plugin without
C{CAP_LINUX_IMMUTABLE}), the problem is passed to the decision, which then
gives the lock parent alone: never a mount that fails the container, lands on
one of its directories, or can be taken away from it.

Why not look again at a later NRI event instead (C{StartContainer},
C{PostCreateContainer}): by then the runtime has mounted (or mounted through a
planted link), the plugin (without the host PID namespace) cannot see the
container's mounts, and its only lever would be an error, which fails the
container; nor would a later look stop a rename after the container started.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

import attrs

from hostpid import defaults, fileattr
from hostpid.node.lockparent import (
    MOUNTPOINT_MODE,
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
    @ivar immutable: the mountpoint is sound and carries the immutable
        attribute (as found or once set).
    @ivar not_immutable: why the attribute could not be set (the filesystem
        has none, the plugin lacks C{CAP_LINUX_IMMUTABLE}): then
        C{mountpoint_problem} says so too, and containers get the lock parent
        alone.
    """

    missing: tuple[str, ...] = ()
    mountpoint_problem: str = ""
    repairs: tuple[MountpointRepair, ...] = ()
    repair_failure: str = ""
    made: bool = False
    immutable: bool = False
    not_immutable: str = ""

    @property
    def broker_present(self) -> bool:
        return not self.missing


def _look_at_entry(fd: int, shown: str, trusted_uid: int) -> str:
    """
    What is wrong with the entry C{MOUNTPOINT_NAME} of the lock parent open
    as C{fd} ("" when it is sound): a directory owned by C{trusted_uid},
    mode 0755 exactly (group or other write would let another user put
    entries in it), and immutable, so that nobody can rename, remove or
    replace it between this look and the runtime's mount, nor after it.
    Opened with C{O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK}: a link is never
    followed, a FIFO never waited on.
    """
    try:
        entry = os.open(MOUNTPOINT_NAME, _DIRECTORY_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return f"{shown} does not exist"
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                st = os.stat(MOUNTPOINT_NAME, dir_fd=fd, follow_symlinks=False)
            except OSError:
                return f"{shown} is not a directory"
            return f"{shown} is a {describe_type(st.st_mode)} owned by UID {st.st_uid}"
        return f"{shown} cannot be looked at: {e.strerror}"
    try:
        st = os.fstat(entry)
        if st.st_uid != trusted_uid:
            return (f"{shown} is a directory owned by UID {st.st_uid}, not the trusted UID "
                    f"{trusted_uid}")
        if stat.S_IMODE(st.st_mode) != MOUNTPOINT_MODE:
            return (f"{shown} has mode {stat.S_IMODE(st.st_mode):04o}, not "
                    f"{MOUNTPOINT_MODE:04o}")
        if not fileattr.is_immutable(entry):
            return f"{shown} is not immutable"
        return ""
    except OSError as e:
        return f"{shown} cannot be looked at: {e.strerror}"
    finally:
        os.close(entry)


def _look(lock_parent: str, trusted_uid: int) -> tuple[str, bool]:
    """
    The mountpoint's problem ("" when it is sound, L{_look_at_entry}), and
    whether the lock parent is as preparation leaves it (owned by
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
        return _look_at_entry(fd, f"{lock_parent}/{MOUNTPOINT_NAME}", trusted_uid), prepared
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
            return HostState(immutable=True)
        try:
            done = self.prepare(self.lock_parent, broker_enabled=True,
                                trusted_uid=self.trusted_uid)
        except LockParentError as e:
            return HostState(mountpoint_problem=problem, repair_failure=str(e))
        except OSError as e:  # pragma: no cover - prepare_lock_parent wraps these
            return HostState(mountpoint_problem=problem, repair_failure=str(e))
        repairs = tuple(getattr(done, "repairs", ()))
        made = problem.endswith(" does not exist") and not repairs
        if not getattr(done, "mountpoint_immutable", False):
            # Sound for a sticky lock parent no one resets, but not against
            # a device plugin that makes it 0777: no broker mount (fail closed).
            why = getattr(done, "immutable_problem", "") or "not immutable"
            return HostState(
                mountpoint_problem=(f"{self.lock_parent}/{MOUNTPOINT_NAME} cannot be made "
                                    f"immutable: {why}"),
                repairs=repairs, made=made, not_immutable=why)
        return HostState(repairs=repairs, made=made, immutable=True)
