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

The broker mountpoint: when the broker is enabled, the container
runtime needs C{<lock parent>/hostpid} as the mountpoint of the read-only
broker mount.  If the runtime creates it lazily, any workload can create that
name first: a regular file makes every later broker-enabled container fail to
start, a symlink makes the runtime mount the broker over a directory of the
victim's own choosing inside the container, and a workload-owned directory can
later be swapped for either.  So preparation owns the entry: it must be a
directory owned by the trusted UID with mode 0755.

Why immutable: once in place, the mountpoint carries the immutable
attribute (L{fileattr}).  The sticky bit alone keeps a workload user from
renaming a root-owned entry only while the lock parent stays 01777, and
HAMi's device plugin makes it 0777 on every allocation: then any user can
rename the entry between a component's look and the runtime's mount (the
runtime resolves a planted symlink inside the next container and mounts the
broker over, say, its C{/etc}), or rename or remove it under a running
container (which detaches the broker mount in every other mount namespace).
The kernel refuses both for an immutable inode whatever the directory's mode;
only C{CAP_LINUX_IMMUTABLE} in the initial user namespace can clear the flag.
An immutable inode cannot be renamed into place either, so the flag is set
after the directory is placed, and the name is checked once more afterwards.
Where the flag cannot be set (a filesystem without it, a process without the
capability) the preparation still succeeds and says why
(L{PreparedLockParent.immutable_problem}): the NRI plugin then gives the lock
parent alone; an allocation keeps the design's sticky-bit rule.

Why not remove and re-create: removing a planted entry and then creating ours leaves the name free
for a moment, and a workload that re-creates its entry in a loop wins that
moment every time.  So the broker's directory is finished under a random name
first and put in place atomically with C{renameat2} (L{renameat}): the name is
always either the planted entry or the finished directory.  What was swapped
out is then unlinked (a non-directory; a symlink's target is never touched) or
quarantined under a random name (a directory, with its content).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Callable

import attrs
from twisted.logger import Logger

from hostpid import defaults, fileattr
from hostpid.errors import PathRuleError
from hostpid.node import renameat

log = Logger(namespace="hostpid.lockparent")

#: The broker mountpoint's name inside the lock parent.
MOUNTPOINT_NAME = os.path.basename(defaults.CONTAINER_BROKER_DIRECTORY)
#: The broker mountpoint's mode: root writes, everyone traverses.
MOUNTPOINT_MODE = 0o755
#: Prefix of the name a foreign directory is renamed to.
QUARANTINE_PREFIX = ".hostpid.quarantined."
#: Prefix of the random name the broker's directory is built under.
BUILD_PREFIX = ".hostpid.new."
#: A root-owned empty file saying "a broker mountpoint was made here".
MARKER_NAME = ".hostpid.mountpoint-made"
#: How often a random build name is drawn, or a swapped-out entry handled.
MOUNTPOINT_ATTEMPTS = 64
#: How often putting the directory in place is tried against a planter that
#: removes and re-creates its own entry between two system calls.  Each try
#: is one C{renameat2}, a few microseconds; a planter flapping its entry in a
#: tight loop on another core made 64 tries fail in 2 of 32 allocations
#: (about 96 % of tries lost), and 4,096 tries make that about e^-170, in at
#: most tens of milliseconds.
PLACE_ATTEMPTS = 4096

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
    @ivar mountpoint_device: the broker mountpoint's C{st_dev}, when ensured.
    @ivar mountpoint_inode: the broker mountpoint's C{st_ino}, when ensured.
    @ivar mountpoint_immutable: the broker mountpoint carries the immutable
        attribute (read back from it), so that no one without
        C{CAP_LINUX_IMMUTABLE} can rename, remove or replace it.
    @ivar immutable_problem: why it does not, when ensured without it.
    """

    path: str
    device: int
    inode: int
    broker_mountpoint: bool
    repairs: tuple[MountpointRepair, ...] = ()
    mountpoint_device: int | None = None
    mountpoint_inode: int | None = None
    mountpoint_immutable: bool = False
    immutable_problem: str = ""

    @property
    def repair_count(self) -> int:
        """How many planted or damaged entries were repaired."""
        return len(self.repairs)

    def describe_repairs(self) -> list[str]:
        """
        One line per repair, and one when the broker mountpoint could not be
        made immutable, for a command line to show an operator.
        """
        lines = []
        for repair in self.repairs:
            if repair.found == "missing mountpoint":
                lines.append(f"repaired {self.path}/{MOUNTPOINT_NAME}: it was missing although "
                             f"an earlier allocation made it; {repair.action}")
                continue
            moved = f" to {repair.quarantine_name}" if repair.quarantine_name else ""
            lines.append(
                f"repaired {self.path}/{MOUNTPOINT_NAME}: found a {repair.found} owned by "
                f"UID {repair.owner_uid} (mode {repair.mode:04o}); {repair.action}{moved}"
            )
        if self.broker_mountpoint and self.immutable_problem:
            lines.append(
                f"{self.path}/{MOUNTPOINT_NAME} is not immutable ({self.immutable_problem}): "
                "wherever something resets the lock parent to 0777 a workload user can rename "
                "it; the NRI plugin gives such a node the lock parent alone (docs/security.md)")
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
        euid = os.geteuid()
        if euid not in (0, trusted_uid):
            # What this process creates is its own, it cannot give it away,
            # and an entry owned by anyone but the trusted UID is refused by
            # every later preparation (root's included): look, never create.
            if _lstat(name, parent_fd) is None:
                raise LockParentError(
                    shown,
                    f"does not exist, and this process runs as UID {euid}: it would "
                    f"create it owned by UID {euid}, which every preparation then refuses "
                    f"(nothing was created); run `hostpid prepare-lock-parent` as UID "
                    f"{trusted_uid}{' (root)' if trusted_uid == 0 else ''}",
                )
        else:
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
                    shown,
                    f"is owned by UID {st.st_uid}, not the trusted UID {trusted_uid}; nothing "
                    f"in it is trusted (left untouched).  If a `hostpid prepare-lock-parent` "
                    f"run as UID {st.st_uid} made it, move it aside as root (mv {shown} "
                    f"{shown}.uid{st.st_uid}) and prepare again",
                )
            # mkdir's mode was filtered by the umask, and an existing
            # directory may have any mode: set it by descriptor (unless it is
            # right already, so that a process other than its owner can check
            # a prepared lock parent).
            if stat.S_IMODE(st.st_mode) != defaults.LOCK_PARENT_MODE:
                os.fchmod(child_fd, defaults.LOCK_PARENT_MODE)
            _step(between_steps, "lock-parent-mode-set")
            final = _final_check(
                child_fd, name, parent_fd, trusted_uid, defaults.LOCK_PARENT_MODE, shown
            )
            repairs: tuple[MountpointRepair, ...] = ()
            mountpoint: os.stat_result | None = None
            immutability = fileattr.Immutability(False)
            if broker_enabled:
                repairs, mountpoint, immutability = _ensure_mountpoint(
                    child_fd, shown, trusted_uid, between_steps
                )
            return PreparedLockParent(
                path=shown,
                device=final.st_dev,
                inode=final.st_ino,
                broker_mountpoint=broker_enabled,
                repairs=repairs,
                mountpoint_device=mountpoint.st_dev if mountpoint is not None else None,
                mountpoint_inode=mountpoint.st_ino if mountpoint is not None else None,
                mountpoint_immutable=immutability.immutable,
                immutable_problem=immutability.problem,
            )
        finally:
            os.close(child_fd)
    finally:
        os.close(parent_fd)


def _random_name(prefix: str) -> str:
    """A fresh, clearly named, unguessable name inside the lock parent."""
    return f"{prefix}{int(time.time())}.{secrets.token_hex(16)}"


def _quarantine_name() -> str:
    """Where a directory swapped out of the mountpoint is kept for its owner."""
    return _random_name(QUARANTINE_PREFIX)


#: Stands for "something is there" when a failed rename said so but the entry
#: was gone again before it could be looked at.
_PRESENT = os.stat_result((stat.S_IFREG, 0, 0, 0, -1, -1, 0, 0, 0, 0))


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _is_trusted_directory(st: os.stat_result | None, trusted_uid: int) -> bool:
    return st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == trusted_uid


def _log_repair(shown: str, repair: MountpointRepair) -> None:
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


def _build_directory(lock_parent_fd: int, shown: str, trusted_uid: int) -> tuple[str, int]:
    """
    Make the broker's directory under a fresh random name, finished before
    anyone can see it at C{hostpid}: owned by C{trusted_uid}, mode 0755.

    The random name is a root-owned entry in a sticky root-owned directory:
    no workload user can rename, remove or replace it, so the descriptor
    opened here and the name stay one directory until it is put in place.

    @return: the name and an open descriptor of the directory.
    """
    for _ in range(MOUNTPOINT_ATTEMPTS):
        name = _random_name(BUILD_PREFIX)
        try:
            os.mkdir(name, 0o700, dir_fd=lock_parent_fd)
        except FileExistsError:
            continue  # a planted name (it cannot be guessed): draw again
        try:
            fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=lock_parent_fd)
        except BaseException:
            os.rmdir(name, dir_fd=lock_parent_fd)
            raise
        try:
            held = os.fstat(fd)
            if held.st_uid != trusted_uid:
                os.fchown(fd, trusted_uid, -1)
            os.fchmod(fd, MOUNTPOINT_MODE)
        except BaseException:
            os.close(fd)
            os.rmdir(name, dir_fd=lock_parent_fd)
            raise
        return name, fd
    raise LockParentError(shown, "cannot draw a free temporary name in the lock parent")


def _adopt(
    lock_parent_fd: int, shown: str, trusted_uid: int, between_steps: StepHook | None
) -> tuple[int, tuple[MountpointRepair, ...]] | None:
    """
    Keep the trusted directory already at the mountpoint (restoring a
    drifted mode), and return a descriptor of it; or C{None} if it is no
    longer there to keep.

    A directory owned by the trusted UID is never exchanged away: running
    containers may have the broker mounted on it, and renaming a mountpoint
    that is in use in another mount namespace detaches those mounts.
    """
    try:
        fd = os.open(MOUNTPOINT_NAME, _DIRECTORY_FLAGS, dir_fd=lock_parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return None
        raise LockParentError(shown, f"cannot be opened: {e.strerror}") from e
    try:
        _step(between_steps, "mountpoint-opened")
        held = os.fstat(fd)
        if not _is_trusted_directory(held, trusted_uid):
            os.close(fd)
            return None
        repairs: tuple[MountpointRepair, ...] = ()
        if stat.S_IMODE(held.st_mode) != MOUNTPOINT_MODE:
            # Only the trusted UID can have changed it: drift, not an attack,
            # but still worth a line and a count.
            repairs = (
                MountpointRepair(
                    found="directory",
                    owner_uid=held.st_uid,
                    mode=stat.S_IMODE(held.st_mode),
                    action="mode restored",
                ),
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
            # An immutable inode refuses even root's chmod: clear the flag
            # first (only root with CAP_LINUX_IMMUTABLE can), the mode is
            # restored, and the caller sets the flag again.
            try:
                fileattr.clear_immutable(fd)
            except OSError as e:
                raise LockParentError(
                    shown, f"is immutable with mode {stat.S_IMODE(held.st_mode):04o}, not "
                    f"{MOUNTPOINT_MODE:04o}, and its immutable attribute cannot be cleared "
                    f"to restore the mode: {e.strerror} (left untouched; as root: "
                    f"chattr -i {shown} && chmod {MOUNTPOINT_MODE:o} {shown})") from e
            os.fchmod(fd, MOUNTPOINT_MODE)
        _step(between_steps, "mountpoint-mode-set")
        return fd, repairs
    except BaseException:
        os.close(fd)
        raise


def _dispose(lock_parent_fd: int, name: str, shown: str) -> MountpointRepair | None:
    """
    Deal with the entry swapped out of the mountpoint, now at C{name}.

    A non-directory is unlinked (the name only: a symlink's target is never
    touched).  A directory is renamed to a quarantine name, with its
    content, for its owner or an operator.  Nothing is ever followed.  The
    entry belongs to the workload that planted it, which may still rename or
    remove it: whatever is at C{name} when we look is what is handled, and
    if it is gone there is nothing to do.
    """
    for _ in range(MOUNTPOINT_ATTEMPTS):
        st = _lstat(name, lock_parent_fd)
        if st is None:
            return None
        found = describe_type(st.st_mode)
        try:
            if stat.S_ISDIR(st.st_mode):
                quarantine = _quarantine_name()
                renameat.renameat2(
                    name, quarantine, dir_fd=lock_parent_fd, flags=renameat.RENAME_NOREPLACE
                )
                repair = MountpointRepair(
                    found=found, owner_uid=st.st_uid, mode=stat.S_IMODE(st.st_mode),
                    action="quarantined", quarantine_name=quarantine,
                )
            else:
                os.unlink(name, dir_fd=lock_parent_fd)
                repair = MountpointRepair(
                    found=found, owner_uid=st.st_uid, mode=stat.S_IMODE(st.st_mode),
                    action="removed",
                )
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.EEXIST,
                           errno.EPERM):
                continue  # its owner changed it meanwhile: look again
            raise
        _log_repair(shown, repair)
        return repair
    # The owner keeps changing its own entry under our random name.  It is
    # harmless there (the mountpoint is already ours); leave it and say so.
    log.warn(
        "Left the entry swapped out of {mountpoint} at {name}: its owner kept changing it",
        mountpoint=shown, name=name,
    )
    return None


#: How often the mountpoint is made again when it was displaced between being
#: placed and being made immutable (a rename by a workload user in a 0777 lock
#: parent, in the few microseconds between the two system calls).
SEAL_ATTEMPTS = 8


class _Displaced(Exception):
    """The mountpoint was moved away before its immutable attribute held it."""

    def __init__(self, error: LockParentError) -> None:
        super().__init__(str(error))
        self.error = error


def _ensure_mountpoint(
    lock_parent_fd: int, lock_parent: str, trusted_uid: int, between_steps: StepHook | None
) -> tuple[tuple[MountpointRepair, ...], os.stat_result, fileattr.Immutability]:
    """
    Make C{hostpid} inside the verified lock parent an immutable directory
    owned by C{trusted_uid} with mode 0755 (L{_ensure_once}), trying again
    when a workload user moved it away before the flag was set.

    @return: the repairs made, the C{lstat} of the mountpoint accepted, and
        whether it is immutable.
    """
    repairs: list[MountpointRepair] = []
    for _ in range(SEAL_ATTEMPTS - 1):
        try:
            return _ensure_once(lock_parent_fd, lock_parent, trusted_uid, between_steps,
                                repairs)
        except _Displaced:
            continue
    try:
        return _ensure_once(lock_parent_fd, lock_parent, trusted_uid, between_steps, repairs)
    except _Displaced as displaced:
        raise displaced.error from None


def _seal(
    fd: int, lock_parent_fd: int, trusted_uid: int, shown: str, between_steps: StepHook | None
) -> tuple[os.stat_result, fileattr.Immutability]:
    """
    Set the immutable attribute on the directory placed at C{hostpid} (open
    as C{fd}), then check that the name still is that directory.

    An immutable inode cannot be renamed into place, so the flag comes after
    the placement; a rename in between is caught by the check, and the
    directory that was moved away loses its flag again (it is no longer
    ours to keep, nor anything anyone should be unable to remove).

    @raise _Displaced: the name no longer is the directory.
    """
    immutability = fileattr.set_immutable(fd)
    _step(between_steps, "mountpoint-sealed")
    try:
        final = _final_check(
            fd, MOUNTPOINT_NAME, lock_parent_fd, trusted_uid, MOUNTPOINT_MODE, shown
        )
    except LockParentError as e:
        if immutability.immutable:
            with contextlib.suppress(OSError):
                fileattr.clear_immutable(fd)
        raise _Displaced(e) from e
    return final, immutability


def _ensure_once(
    lock_parent_fd: int, lock_parent: str, trusted_uid: int, between_steps: StepHook | None,
    repairs: list[MountpointRepair],
) -> tuple[tuple[MountpointRepair, ...], os.stat_result, fileattr.Immutability]:
    """
    Make C{hostpid} inside the verified lock parent a directory owned by
    C{trusted_uid} with mode 0755, so that the name is at every moment either
    what was there before or the broker's finished directory, never free;
    then make it immutable (L{_seal}).

    A trusted directory already there is kept (see L{_adopt}).  Otherwise a
    finished directory is built under a random name (L{_build_directory}) and
    put in place with C{renameat2}: C{RENAME_NOREPLACE} when the name is
    free, C{RENAME_EXCHANGE} when something is there.  Once in place and
    immutable, nobody without C{CAP_LINUX_IMMUTABLE} can rename or remove
    it, sticky lock parent or not, so a planter racing the repair loses after
    one exchange; only a planter that removes and re-creates its own entry
    between two system calls can make one attempt fail, and the attempts
    repeat.  Whatever was swapped out is then removed or quarantined
    (L{_dispose}).  C{repairs} collects the repairs over the attempts.
    """
    shown = f"{lock_parent}/{MOUNTPOINT_NAME}"
    if _is_trusted_directory(_lstat(MOUNTPOINT_NAME, lock_parent_fd), trusted_uid):
        adopted = _adopt(lock_parent_fd, shown, trusted_uid, between_steps)
        if adopted is not None:
            fd, drift = adopted
            try:
                final, immutability = _seal(fd, lock_parent_fd, trusted_uid, shown,
                                            between_steps)
            finally:
                os.close(fd)
            repairs.extend(drift)
            return tuple(repairs), final, immutability
    elif _lstat(MARKER_NAME, lock_parent_fd) is not None and \
            _lstat(MOUNTPOINT_NAME, lock_parent_fd) is None and \
            _marker_is_ours(lock_parent_fd, trusted_uid):
        repairs.append(_report_missing(shown, trusted_uid))

    build_name, fd = _build_directory(lock_parent_fd, shown, trusted_uid)
    placed = swapped = False
    try:
        _step(between_steps, "mountpoint-built")
        st = _lstat(MOUNTPOINT_NAME, lock_parent_fd)
        for _ in range(PLACE_ATTEMPTS):
            if _is_trusted_directory(st, trusted_uid):
                # A concurrent allocation put its directory there first.
                adopted = _adopt(lock_parent_fd, shown, trusted_uid, between_steps)
                if adopted is None:
                    st = _lstat(MOUNTPOINT_NAME, lock_parent_fd)
                    continue
                os.close(fd)
                fd, drift = adopted
                repairs.extend(drift)
                break
            # No second look between the attempts: each failure says which
            # way the name just flipped, and the other flag is tried at once.
            flags = renameat.RENAME_NOREPLACE if st is None else renameat.RENAME_EXCHANGE
            try:
                renameat.renameat2(build_name, MOUNTPOINT_NAME, dir_fd=lock_parent_fd,
                                   flags=flags)
            except OSError as e:
                if e.errno == errno.EEXIST:
                    # No look: the exchange is tried at once.  Should the
                    # entry be a concurrent allocation's directory, the
                    # exchange below sees it and swaps it back.
                    st = _PRESENT
                    continue
                if e.errno == errno.ENOENT:
                    st = None
                    continue
                if e.errno == errno.EPERM:
                    # The entry is immutable: a concurrent preparation's
                    # finished directory (adopted above), or something only
                    # root with CAP_LINUX_IMMUTABLE can have made.
                    st = _lstat(MOUNTPOINT_NAME, lock_parent_fd)
                    if _is_trusted_directory(st, trusted_uid):
                        continue
                    found = describe_type(st.st_mode) if st is not None else "entry"
                    raise LockParentError(
                        shown, f"is an immutable {found} owned by UID "
                        f"{st.st_uid if st is not None else '?'}, which only root with "
                        f"CAP_LINUX_IMMUTABLE can have made (left untouched; as root: "
                        f"chattr -i {shown})") from e
                raise LockParentError(shown, f"cannot be put in place: {e.strerror}") from e
            if flags == renameat.RENAME_EXCHANGE and _is_trusted_directory(
                _lstat(build_name, lock_parent_fd), trusted_uid
            ):
                # We swapped out a concurrent allocation's finished directory
                # (only the trusted UID makes those, so nobody else can have
                # touched either name): swap it back, and keep it.
                renameat.renameat2(build_name, MOUNTPOINT_NAME, dir_fd=lock_parent_fd,
                                   flags=renameat.RENAME_EXCHANGE)
                st = _lstat(MOUNTPOINT_NAME, lock_parent_fd)
                continue
            placed = True
            swapped = flags == renameat.RENAME_EXCHANGE
            break
        else:
            raise LockParentError(
                shown,
                f"kept being replaced during {PLACE_ATTEMPTS} attempts to put a directory "
                f"owned by UID {trusted_uid} in place; refusing this allocation",
            )
        _step(between_steps, "mountpoint-placed")
        final, immutability = _seal(fd, lock_parent_fd, trusted_uid, shown, between_steps)
    finally:
        os.close(fd)
        if not placed:
            # Still ours under the random name (nobody else can touch it).
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(build_name, dir_fd=lock_parent_fd)
        if swapped:
            # Also when the seal found the directory moved away: what was
            # swapped out is dealt with either way.
            repair = _dispose(lock_parent_fd, build_name, shown)
            if repair is not None:
                repairs.append(repair)
    if placed:
        _leave_marker(lock_parent_fd)
    return tuple(repairs), final, immutability


def _marker_is_ours(lock_parent_fd: int, trusted_uid: int) -> bool:
    st = _lstat(MARKER_NAME, lock_parent_fd)
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == trusted_uid


def _leave_marker(lock_parent_fd: int) -> None:
    """
    Record, next to it, that a broker mountpoint was made in this lock
    parent: if a later preparation finds the mountpoint gone while this
    marker is there, someone removed it (only the trusted UID can), and that
    is reported instead of silently made again.  Best effort: a marker a
    workload planted first is left alone and simply not trusted.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.close(os.open(MARKER_NAME, flags, 0o644, dir_fd=lock_parent_fd))
    except OSError:
        pass


def _report_missing(shown: str, trusted_uid: int) -> MountpointRepair:
    repair = MountpointRepair(
        found="missing mountpoint", owner_uid=trusted_uid, mode=0,
        action="made again (it had been removed since an earlier allocation made it)",
    )
    log.warn(
        "The broker mountpoint {mountpoint} was missing although an earlier allocation made "
        "it: something running as UID {owner_uid} removed it (containers started before "
        "lost their broker mount); {action}",
        mountpoint=shown, found=repair.found, owner_uid=trusted_uid, mode=0,
        action="made it again", quarantine_name=None,
    )
    return repair
