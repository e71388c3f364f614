"""
Preparing the shared lock parent (C{/tmp/vgpulock}) and the broker's
mountpoint inside it, by descriptors only.

The lock parent is mounted writable into every GPU workload, so anything a
workload can reach there it can also try to replace.  Every step below works
on a directory descriptor that has already been checked, never on a path that
is looked up again, so a swap between two steps either changes nothing we act
on or is caught by the final identity check.

Ancestors: the lock parent's own parent (C{/tmp} for the default) is opened by
walking from C{/} one component at a time with C{O_NOFOLLOW}, each component
relative to the descriptor of the one before.  No component may be a symlink,
and each must be owned by root or the trusted UID and not writable by group or
other unless sticky: otherwise someone other than root could rename a
component of the path away and put their own tree in its place.  C{/} and
C{/tmp} pass; a lock parent below a user-writable directory does not.

The broker mountpoint (issue 9): when the broker is enabled, the container
runtime needs C{<lock parent>/hostpid} as the mountpoint of the read-only
broker mount.  If the runtime creates it lazily, any workload can create that
name first: a regular file makes every later broker-enabled container fail to
start, a symlink makes the runtime mount the broker over a directory of the
victim's own choosing inside the container, and a workload-owned directory can
later be swapped for either.  So preparation owns the entry: it must be a
directory owned by the trusted UID with mode 0755.  A planted non-directory is
unlinked (its target is never touched), a foreign directory is renamed aside
to a quarantine name, and a fresh directory is made and verified.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from collections.abc import Callable

import attrs
from twisted.logger import Logger

from hostpid import defaults
from hostpid.errors import PathRuleError

log = Logger(namespace="hostpid.lockparent")

#: The broker mountpoint's name inside the lock parent.
MOUNTPOINT_NAME = os.path.basename(defaults.CONTAINER_BROKER_DIRECTORY)
#: The broker mountpoint's mode: root writes, everyone traverses.
MOUNTPOINT_MODE = 0o755
#: Prefix of the name a foreign directory is renamed to.
QUARANTINE_PREFIX = ".hostpid.quarantined."
#: How often a mountpoint that keeps being replaced is inspected again.
MOUNTPOINT_ATTEMPTS = 4

_DIRECTORY_FLAGS = (
    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
)

#: Called with a step name between the steps of the preparation.  Only tests
#: pass one, to change the tree between two steps and see the change caught.
StepHook = Callable[[str], None]


class LockParentError(PathRuleError):
    """
    The lock parent (or the broker mountpoint in it) cannot be prepared
    safely.  No allocation may use it.
    """

    prefix = "unsafe lock parent: "


@attrs.frozen
class MountpointRepair:
    """
    One planted entry found at the broker mountpoint and what was done to it.

    @ivar found: the kind of object found (C{"regular file"}, C{"symlink"},
        C{"directory"}, ...).
    @ivar owner_uid: its owner.
    @ivar mode: its permission bits.
    @ivar action: C{"removed"}, C{"quarantined"} or C{"mode restored"}.
    @ivar quarantine_name: the entry's new name inside the lock parent when
        it was quarantined.
    """

    found: str
    owner_uid: int
    mode: int
    action: str
    quarantine_name: str | None = None


@attrs.frozen
class PreparedLockParent:
    """
    The outcome of a successful preparation.

    @ivar path: the lock parent.
    @ivar device: its C{st_dev}.
    @ivar inode: its C{st_ino}.
    @ivar broker_mountpoint: whether the broker mountpoint was ensured (only
        when the broker is enabled).
    @ivar repairs: what had to be repaired at the broker mountpoint.
    """

    path: str
    device: int
    inode: int
    broker_mountpoint: bool
    repairs: tuple[MountpointRepair, ...] = ()

    @property
    def repair_count(self) -> int:
        """How many planted or damaged entries were repaired."""
        return len(self.repairs)

    def describe_repairs(self) -> list[str]:
        """One line per repair, for a command line to show an operator."""
        lines = []
        for repair in self.repairs:
            moved = f" to {repair.quarantine_name}" if repair.quarantine_name else ""
            lines.append(
                f"repaired {self.path}/{MOUNTPOINT_NAME}: found a {repair.found} owned by "
                f"UID {repair.owner_uid} (mode {repair.mode:04o}); {repair.action}{moved}"
            )
        return lines


def describe_type(mode: int) -> str:
    """The kind of file C{mode} says, in the words an operator uses."""
    kinds = (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISREG, "regular file"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    )
    for test, name in kinds:
        if test(mode):
            return name
    return "unknown file type"


def _components(path: str) -> list[str]:
    """
    The components of an absolute lock parent path.

    C{.} and C{..} are refused rather than resolved: a lock parent named
    through them is a configuration error, and resolving them lexically would
    name a different directory than the kernel does whenever a symlink is
    involved.
    """
    if not path.startswith("/"):
        raise LockParentError(path, "the lock parent must be an absolute path")
    parts = [part for part in path.split("/") if part]
    if not parts:
        raise LockParentError(path, "the lock parent cannot be the root directory")
    if any(part in (".", "..") for part in parts):
        raise LockParentError(path, "the lock parent path must not contain '.' or '..'")
    return parts


def _open_directory(name: str, dir_fd: int | None, shown: str) -> int:
    """Open C{name} as a directory without following a final symlink."""
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            # Linux reports a symlink under O_DIRECTORY|O_NOFOLLOW as ENOTDIR:
            # look (without following) to name what is there.
            try:
                found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            except OSError:
                found = 0
            if stat.S_ISLNK(found) or e.errno == errno.ELOOP:
                raise LockParentError(
                    shown, "is a symlink; a real directory is required (left untouched)"
                ) from e
            kind = describe_type(found) if found else "not a directory"
            raise LockParentError(
                shown, f"is a {kind}, not a directory (left untouched)"
            ) from e
        if e.errno == errno.ENOENT:
            raise LockParentError(shown, "does not exist") from e
        raise LockParentError(shown, f"cannot be opened: {e.strerror}") from e


def _mode_text(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def _check_ancestor(st: os.stat_result, trusted_uid: int, shown: str) -> None:
    """
    An ancestor (or the lock parent's own parent) must be replaceable by
    nobody but root and the trusted UID.
    """
    if st.st_uid not in (0, trusted_uid):
        raise LockParentError(
            shown,
            f"is owned by UID {st.st_uid}; it must be owned by root or the trusted UID "
            f"{trusted_uid}",
        )
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not st.st_mode & stat.S_ISVTX:
        raise LockParentError(
            shown,
            f"has mode {_mode_text(st.st_mode)}: it is writable by group or other without "
            "the sticky bit, so another user could replace its entries",
        )


def _open_parent(parts: list[str], trusted_uid: int) -> int:
    """
    Open the lock parent's parent by walking from C{/} with C{O_NOFOLLOW}
    at each step, checking every directory on the way.
    """
    fd = _open_directory("/", None, "/")
    shown = ""
    try:
        st = os.fstat(fd)
        _check_ancestor(st, trusted_uid, "/")
        for part in parts[:-1]:
            shown += "/" + part
            next_fd = _open_directory(part, fd, shown)
            os.close(fd)
            fd = next_fd
            st = os.fstat(fd)
            _check_ancestor(st, trusted_uid, shown)
        # The lock parent's own parent must be owned by the trusted UID itself.
        if st.st_uid != trusted_uid:
            raise LockParentError(
                shown or "/",
                f"is owned by UID {st.st_uid}, not the trusted UID {trusted_uid}",
            )
        return fd
    except BaseException:
        os.close(fd)
        raise


def _final_check(
    fd: int, name: str, dir_fd: int, trusted_uid: int, mode: int, shown: str
) -> os.stat_result:
    """
    Check that the entry C{name} in C{dir_fd} is still the directory open as
    C{fd}, owned by C{trusted_uid}, with exactly C{mode}.
    """
    held = os.fstat(fd)
    try:
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise LockParentError(shown, "changed while prepared: the entry disappeared") from None
    if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
        raise LockParentError(
            shown,
            "changed while prepared: the entry was replaced by another "
            f"{describe_type(named.st_mode)} owned by UID {named.st_uid}",
        )
    if not stat.S_ISDIR(named.st_mode):
        raise LockParentError(shown, "changed while prepared: no longer a directory")
    if named.st_uid != trusted_uid:
        raise LockParentError(
            shown,
            f"changed while prepared: now owned by UID {named.st_uid}, not the trusted "
            f"UID {trusted_uid}",
        )
    if stat.S_IMODE(named.st_mode) != mode:
        raise LockParentError(
            shown,
            f"changed while prepared: mode is {_mode_text(named.st_mode)}, "
            f"not {mode:04o}",
        )
    return named


def _step(hook: StepHook | None, name: str) -> None:
    if hook is not None:
        hook(name)


def prepare_lock_parent(
    path: str = defaults.LOCK_PARENT,
    *,
    broker_enabled: bool,
    trusted_uid: int = 0,
    between_steps: StepHook | None = None,
) -> PreparedLockParent:
    """
    Make C{path} a directory owned by C{trusted_uid} with mode 01777, and,
    when C{broker_enabled}, make C{path/hostpid} a directory owned by
    C{trusted_uid} with mode 0755.

    The lock parent is prepared the same way whether or not the broker is
    enabled (the legacy lock files live there too); the broker mountpoint is
    touched only when the broker is enabled, so that turning the broker off
    changes nothing a workload left behind.

    @param broker_enabled: whether allocations will carry the broker mount
        (the CLI passes L{hostpid.gate.gate_enabled} of its own environment).
    @param trusted_uid: the owner every checked object must have (root in
        production; tests may use another UID in a private tree).
    @param between_steps: called with a step name between steps, for tests.

    @raise LockParentError: when any rule is broken; nothing unsafe is
        returned, and nothing beyond what the rules allow has changed.
    """
    parts = _components(path)
    shown = "/" + "/".join(parts)
    try:
        return _prepare(parts, shown, broker_enabled, trusted_uid, between_steps)
    except OSError as e:
        # Anything the kernel refused that no rule above names (EACCES,
        # EROFS, EPERM from fchmod, ENOSPC...): still an unsafe lock parent,
        # still one clear line.
        raise LockParentError(shown, f"cannot be prepared: {e.strerror}") from e


def _prepare(
    parts: list[str],
    shown: str,
    broker_enabled: bool,
    trusted_uid: int,
    between_steps: StepHook | None,
) -> PreparedLockParent:
    name = parts[-1]
    parent_fd = _open_parent(parts, trusted_uid)
    try:
        _step(between_steps, "parent-opened")
        try:
            os.mkdir(name, defaults.LOCK_PARENT_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass
        _step(between_steps, "lock-parent-made")
        child_fd = _open_directory(name, parent_fd, shown)
        try:
            _step(between_steps, "lock-parent-opened")
            st = os.fstat(child_fd)
            if st.st_uid != trusted_uid:
                raise LockParentError(
                    shown, f"is owned by UID {st.st_uid}, not the trusted UID {trusted_uid}"
                )
            # mkdir's mode was filtered by the umask, and an existing
            # directory may have any mode: set it by descriptor.
            os.fchmod(child_fd, defaults.LOCK_PARENT_MODE)
            _step(between_steps, "lock-parent-mode-set")
            final = _final_check(
                child_fd, name, parent_fd, trusted_uid, defaults.LOCK_PARENT_MODE, shown
            )
            repairs: tuple[MountpointRepair, ...] = ()
            if broker_enabled:
                repairs = _ensure_mountpoint(child_fd, shown, trusted_uid, between_steps)
            return PreparedLockParent(
                path=shown,
                device=final.st_dev,
                inode=final.st_ino,
                broker_mountpoint=broker_enabled,
                repairs=repairs,
            )
        finally:
            os.close(child_fd)
    finally:
        os.close(parent_fd)


def _quarantine_name() -> str:
    """A fresh, clearly named, unguessable name for a foreign directory."""
    return f"{QUARANTINE_PREFIX}{int(time.time())}.{secrets.token_hex(16)}"


def _repair(
    lock_parent_fd: int, st: os.stat_result, shown: str, trusted_uid: int
) -> MountpointRepair | None:
    """
    Clear what is at the mountpoint if it is not a trusted directory.

    Returns the repair made, or C{None} when the entry is a directory owned
    by the trusted UID (its mode is set afterwards by descriptor).
    """
    found = describe_type(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        if st.st_uid == trusted_uid:
            return None
        quarantine = _quarantine_name()
        # renameat within the lock parent: never follows anything, and the
        # content stays where its owner (and an operator) can find it.
        os.rename(
            MOUNTPOINT_NAME, quarantine, src_dir_fd=lock_parent_fd, dst_dir_fd=lock_parent_fd
        )
        repair = MountpointRepair(
            found=found,
            owner_uid=st.st_uid,
            mode=stat.S_IMODE(st.st_mode),
            action="quarantined",
            quarantine_name=quarantine,
        )
    else:
        # unlinkat removes the entry itself; a symlink's target is untouched.
        os.unlink(MOUNTPOINT_NAME, dir_fd=lock_parent_fd)
        repair = MountpointRepair(
            found=found, owner_uid=st.st_uid, mode=stat.S_IMODE(st.st_mode), action="removed"
        )
    log.warn(
        "Repaired the broker mountpoint {mountpoint}: found a {found} owned by UID "
        "{owner_uid} (mode {mode:04o}); {action}{quarantine_note}",
        mountpoint=shown,
        found=repair.found,
        owner_uid=repair.owner_uid,
        mode=repair.mode,
        action=repair.action,
        quarantine_name=repair.quarantine_name,
        quarantine_note=(
            f" as {repair.quarantine_name}" if repair.quarantine_name is not None else ""
        ),
    )
    return repair


def _ensure_mountpoint(
    lock_parent_fd: int, lock_parent: str, trusted_uid: int, between_steps: StepHook | None
) -> tuple[MountpointRepair, ...]:
    """
    Make C{hostpid} inside the verified lock parent a directory owned by
    C{trusted_uid} with mode 0755, repairing whatever was planted there.

    A workload can keep replacing its own entry while this runs (the sticky
    bit lets it remove what it owns), so inspection and repair repeat a few
    times; each failed race is a fresh inspection, never an action on a stale
    observation.  The result is accepted only after a descriptor-based check
    that the entry is the directory just opened.
    """
    shown = f"{lock_parent}/{MOUNTPOINT_NAME}"
    repairs: list[MountpointRepair] = []
    for _ in range(MOUNTPOINT_ATTEMPTS):
        try:
            st = os.stat(MOUNTPOINT_NAME, dir_fd=lock_parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            _step(between_steps, "mountpoint-inspected")
            try:
                repair = _repair(lock_parent_fd, st, shown, trusted_uid)
            except FileNotFoundError:
                continue  # its owner removed it meanwhile: look again
            except OSError as e:
                if e.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                    continue  # replaced by another type meanwhile: look again
                raise LockParentError(shown, f"cannot be repaired: {e.strerror}") from e
            if repair is not None:
                repairs.append(repair)
        made = True
        try:
            os.mkdir(MOUNTPOINT_NAME, MOUNTPOINT_MODE, dir_fd=lock_parent_fd)
        except FileExistsError:
            # A trusted directory (already there, or made by a concurrent
            # allocation) is kept; anything else was planted between the
            # repair and mkdir: look again.
            if not _is_trusted_directory(lock_parent_fd, trusted_uid):
                continue
            made = False
        _step(between_steps, "mountpoint-made")
        try:
            fd = os.open(MOUNTPOINT_NAME, _DIRECTORY_FLAGS, dir_fd=lock_parent_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                continue  # replaced between mkdir and open: look again
            raise LockParentError(shown, f"cannot be opened: {e.strerror}") from e
        try:
            _step(between_steps, "mountpoint-opened")
            held = os.fstat(fd)
            if held.st_uid != trusted_uid:
                raise LockParentError(
                    shown,
                    f"changed while prepared: the directory opened is owned by UID "
                    f"{held.st_uid}, not the trusted UID {trusted_uid}",
                )
            if not made and stat.S_IMODE(held.st_mode) != MOUNTPOINT_MODE:
                # Only root can have made it, so this is drift, not an
                # attack; still worth a line and a count.
                repairs.append(
                    MountpointRepair(
                        found="directory",
                        owner_uid=held.st_uid,
                        mode=stat.S_IMODE(held.st_mode),
                        action="mode restored",
                    )
                )
                log.warn(
                    "Restored the mode of the broker mountpoint {mountpoint} from "
                    "{mode:04o} to {wanted:04o}",
                    mountpoint=shown,
                    found="directory",
                    owner_uid=held.st_uid,
                    mode=stat.S_IMODE(held.st_mode),
                    wanted=MOUNTPOINT_MODE,
                )
            # mkdir's mode was filtered by the umask: set it by descriptor.
            os.fchmod(fd, MOUNTPOINT_MODE)
            _step(between_steps, "mountpoint-mode-set")
            _final_check(fd, MOUNTPOINT_NAME, lock_parent_fd, trusted_uid, MOUNTPOINT_MODE, shown)
            return tuple(repairs)
        finally:
            os.close(fd)
    raise LockParentError(
        shown,
        f"kept being replaced during {MOUNTPOINT_ATTEMPTS} attempts to make it a directory "
        f"owned by UID {trusted_uid}; refusing this allocation",
    )


def _is_trusted_directory(lock_parent_fd: int, trusted_uid: int) -> bool:
    """
    Whether the mountpoint is now a directory owned by C{trusted_uid}.
    """
    try:
        st = os.stat(MOUNTPOINT_NAME, dir_fd=lock_parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == trusted_uid
