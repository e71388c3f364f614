"""
Filesystem safety for the broker's directory, lock file and socket path.

Every rule of the design's security boundary that touches the filesystem
lives here, as plain functions over descriptors:

  - the directory is a real directory (never a symlink), owned by the
    expected UID, mode 0711; it is opened once and every later step works
    relative to that descriptor (the socket is bound and probed through
    C{/proc/self/fd/N}), so a path swapped above it cannot redirect the
    broker;
  - no ancestor of the directory is owned by, or writable to, another user
    (a root-owned sticky directory such as C{/tmp} is allowed: only an entry's
    owner can move it, and every entry below it must be trusted too), so
    nobody else can swap a path component in the first place;
  - C{broker.lock} is a regular 0600 file with one link, owned by the
    expected UID, opened with C{O_NOFOLLOW} and held with C{flock} for the broker's life: a second
    broker cannot replace the first;
  - whatever is at the socket path is judged before anything is removed: only
    a stale socket (nobody listening) owned by the expected UID is ever
    deleted; anything else is left exactly as it is and startup fails;
  - the socket the broker creates is remembered by identity (device, inode),
    and removed at shutdown only if that identity is still what the path
    names.

Errors carry the path and the rule broken, so an operator reading one line
knows what to fix.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
import socket
import stat

import attrs

from hostpid import defaults
from hostpid.errors import PathRuleError


class BrokerStartupError(PathRuleError):
    """
    The broker must not start: C{path} breaks C{rule}.

    The message is one line meant for an operator: the path first, then the
    rule, then what (if anything) was done about it.
    """


class LockHeld(BrokerStartupError):
    """Another broker holds the lock: this one must not start."""


def _describe(mode: int) -> str:
    """A file type as an operator would name it."""
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "a device or other special file"


#: The longest socket path a client can connect to: C{sun_path} is 108
#: bytes including the terminating NUL that C clients write.
SUN_PATH_MAX = 107

_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def check_socket_path_length(socket_path: str) -> None:
    """
    Refuse a socket path clients could not connect to, before anything is
    created.  (The broker itself binds through C{/proc/self/fd}, which is
    always short: without this check it would serve a path nobody reaches.)
    """
    length = len(os.fsencode(socket_path))
    if length > SUN_PATH_MAX:
        raise BrokerStartupError(
            socket_path,
            f"is {length} bytes long; a Unix socket path must be at most {SUN_PATH_MAX} bytes "
            "(sun_path), or clients cannot connect: choose a shorter --directory",
        )


def _trusted_uids(expected_uid: int) -> frozenset[int]:
    return frozenset({0, expected_uid})


def _fd_name(fd: int, fallback: str) -> str:
    """The kernel's name for an open directory (for messages only)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return fallback


def _check_ancestor(name: str, info: os.stat_result, expected_uid: int) -> None:
    """
    One directory on the way to the broker directory: owned by root or the
    expected UID, and writable by nobody else, except that a root-owned
    sticky directory (C{/tmp}) may be: there only an entry's owner can rename
    or remove it, and the entry below is itself checked to be trusted.
    """
    trusted = _trusted_uids(expected_uid)
    owners = " or ".join(f"UID {uid}" for uid in sorted(trusted))
    if info.st_uid not in trusted:
        raise BrokerStartupError(
            name,
            f"is owned by UID {info.st_uid}; every ancestor of the broker directory must be "
            f"owned by {owners}, or that user could swap the path under the broker",
        )
    if info.st_mode & 0o022 and not (info.st_mode & stat.S_ISVTX and info.st_uid == 0):
        raise BrokerStartupError(
            name,
            f"has mode {stat.S_IMODE(info.st_mode):04o}: writable by group or others; every "
            "ancestor of the broker directory must be writable only by its owner (or be "
            "root-owned and sticky, like /tmp)",
        )


def check_ancestors(
    directory_fd: int, fallback: str, expected_uid: int, start: str = "."
) -> None:
    """
    Check C{directory_fd} (or, with C{start=".."}, its parent) and every
    directory above it, walking C{..} by
    descriptor up to the process's root: the physical ancestry of what was
    opened, whatever the path's spelling (C{/var/run} is a symlink to
    C{/run}) and without following anything an attacker could redirect.
    """
    current = os.open(start, _PATH_FLAGS, dir_fd=directory_fd)
    try:
        info = os.fstat(current)
        while True:
            _check_ancestor(_fd_name(current, f"an ancestor of {fallback}"), info, expected_uid)
            parent = os.open("..", _PATH_FLAGS, dir_fd=current)
            parentInfo = os.fstat(parent)
            if (parentInfo.st_dev, parentInfo.st_ino) == (info.st_dev, info.st_ino):
                os.close(parent)
                return
            os.close(current)
            current, info = parent, parentInfo
    finally:
        os.close(current)


def _open_parent(parent: str, expected_uid: int) -> int:
    """
    Open the broker directory's parent, creating missing components (0755,
    as C{install -d} would: the default C{/var/run/hami} does not exist on a
    fresh node) one at a time by descriptor, after checking the deepest one
    that exists and everything above it.  A component that appears in a
    race is opened without following a symlink and checked like the rest.
    """
    missing: list[str] = []
    existing = parent
    while True:
        try:
            fd = os.open(existing, _PATH_FLAGS)
            break
        except FileNotFoundError:
            head, name = os.path.split(existing)
            if not name or head == existing:
                raise BrokerStartupError(parent, "cannot open the root directory") from None
            missing.insert(0, name)
            existing = head
        except OSError as e:
            raise BrokerStartupError(
                existing, f"cannot open the parent directory: {e.strerror}"
            ) from None
    try:
        check_ancestors(fd, existing, expected_uid)
        for name in missing:
            path = os.path.join(existing, name)
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise BrokerStartupError(
                    path, f"cannot create the parent directory: {e.strerror}"
                ) from None
            try:
                child = os.open(name, _PATH_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise BrokerStartupError(
                    path, f"cannot open the parent directory: {e.strerror} (a symlink?)"
                ) from None
            os.close(fd)
            fd = child
            _check_ancestor(path, os.fstat(fd), expected_uid)
            existing = path
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_broker_directory(path: str, expected_uid: int) -> int:
    """
    Create C{path} if missing and return a descriptor for it, after proving
    it is a real directory owned by C{expected_uid} whose ancestors nobody
    else can change, and setting it to 0711.

    The directory is created and opened relative to a descriptor of its
    checked parent, and never followed if it is a symlink.

    @raise BrokerStartupError: the path is a symlink, not a directory, owned
        by someone else, below a directory someone else controls, or cannot
        be given its mode (a read-only filesystem).
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    parentFd = _open_parent(parent, expected_uid)
    try:
        try:
            os.mkdir(name, defaults.DIRECTORY_MODE, dir_fd=parentFd)
        except FileExistsError:
            pass
        except OSError as e:
            raise BrokerStartupError(
                path, f"cannot create the broker directory: {e.strerror}"
            ) from None
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=parentFd)
        except OSError as e:
            # O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR, not
            # ELOOP, when its target is a directory: look at what is there.
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    kind = _describe(
                        os.stat(name, dir_fd=parentFd, follow_symlinks=False).st_mode
                    )
                except OSError:
                    kind = "a symlink" if e.errno == errno.ELOOP else "not a directory"
                if kind == "a symlink":
                    raise BrokerStartupError(
                        path, "is a symlink; the broker directory must be a real directory"
                    ) from None
                raise BrokerStartupError(
                    path, f"is {kind}; the broker directory must be a directory"
                ) from None
            raise BrokerStartupError(
                path, f"cannot open the broker directory: {e.strerror}"
            ) from None
    finally:
        os.close(parentFd)
    try:
        info = os.fstat(fd)
        if info.st_uid != expected_uid:
            raise BrokerStartupError(
                path,
                f"is owned by UID {info.st_uid}; the broker directory must be owned by "
                f"UID {expected_uid}",
            )
        # Its parent may have moved since it was checked (only a trusted user
        # could have moved it): check the ancestry of what is open now.
        check_ancestors(fd, path, expected_uid, start="..")
        if stat.S_IMODE(info.st_mode) != defaults.DIRECTORY_MODE:
            try:
                os.fchmod(fd, defaults.DIRECTORY_MODE)
            except OSError as e:
                raise BrokerStartupError(
                    path,
                    f"cannot set mode {defaults.DIRECTORY_MODE:04o} ({e.strerror}); the broker "
                    "directory must be on a writable filesystem",
                ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def descriptor_path(directory_fd: int, directory: str, name: str) -> str:
    """
    A path that names C{name} inside the open directory whatever happens to
    the directory's own path: C{/proc/self/fd/N/NAME}.  Binding or
    connecting through it cannot be redirected by a rename or a symlink above
    the directory.  Refused unless C{/proc/self/fd/N} is this process's view
    of that very directory (same device and inode).
    """
    proc = f"/proc/self/fd/{directory_fd}"
    try:
        via = os.stat(proc)
    except OSError as e:
        raise BrokerStartupError(
            directory, f"cannot reach the open directory through {proc} ({e.strerror}); the "
            "broker needs /proc mounted"
        ) from None
    mine = os.fstat(directory_fd)
    if (via.st_dev, via.st_ino) != (mine.st_dev, mine.st_ino):
        raise BrokerStartupError(
            directory, f"{proc} does not name the open directory; the broker needs this "
            "process's own /proc"
        )
    path = f"{proc}/{name}"
    if len(os.fsencode(path)) > SUN_PATH_MAX:  # pragma: no cover - 14 + 10 digits + name
        raise BrokerStartupError(directory, f"{path} is too long for a Unix socket address")
    return path


def take_lock(directory_fd: int, directory: str, expected_uid: int) -> int:
    """
    Open C{broker.lock} inside the directory and hold an exclusive C{flock}.

    The file is created 0600 if missing.  A symlink there is refused without
    touching its target (C{O_NOFOLLOW}); a FIFO or device cannot block the
    open (C{O_NONBLOCK}) and is refused by type.

    @return: the descriptor holding the lock; closing it releases the lock.
    @raise LockHeld: another broker holds it.
    @raise BrokerStartupError: the lock file breaks a rule.
    """
    path = os.path.join(directory, defaults.LOCK_NAME)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(defaults.LOCK_NAME, flags, defaults.LOCK_MODE, dir_fd=directory_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BrokerStartupError(
                path, "is a symlink; the lock must be a regular file (left untouched)"
            ) from None
        if e.errno == errno.EISDIR:
            raise BrokerStartupError(
                path, "is a directory; the lock must be a regular file (left untouched)"
            ) from None
        raise BrokerStartupError(path, f"cannot open the lock file: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BrokerStartupError(
                path,
                f"is {_describe(info.st_mode)}; the lock must be a regular file (left untouched)",
            )
        if info.st_uid != expected_uid:
            raise BrokerStartupError(
                path,
                f"is owned by UID {info.st_uid}; the lock must be owned by UID {expected_uid}",
            )
        if info.st_mode & 0o077:
            raise BrokerStartupError(
                path,
                f"has mode {stat.S_IMODE(info.st_mode):04o}; the lock must have no group or "
                "other permission bits (0600)",
            )
        if info.st_nlink != 1:
            raise BrokerStartupError(
                path,
                f"has {info.st_nlink} hard links; the lock must be a file of its own (link "
                "count 1), not another file linked here (left untouched)",
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockHeld(path, "is locked by another broker; this one will not start") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


@attrs.frozen
class SocketIdentity:
    """What makes the socket the broker created that socket: device and inode."""

    device: int
    inode: int

    @classmethod
    def of(cls, info: os.stat_result) -> SocketIdentity:
        return cls(info.st_dev, info.st_ino)

    def matches(self, info: os.stat_result) -> bool:
        return (
            stat.S_ISSOCK(info.st_mode) and info.st_dev == self.device and info.st_ino == self.inode
        )


class SocketPathState(enum.Enum):
    """What the socket path held at startup, once it is safe to go on."""

    ABSENT = "absent"
    STALE_REMOVED = "stale socket removed"


#: How long the startup probe waits for a listener before calling it stale.
PROBE_TIMEOUT = 0.05


def _probe(path: str) -> int:
    """
    Try to connect to the socket at C{path}; return 0 on success or the errno.
    A full accept queue (EAGAIN) is reported as such: somebody is listening.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(PROBE_TIMEOUT)
        return probe.connect_ex(path)
    finally:
        probe.close()


def clear_socket_path(
    directory_fd: int, directory: str, expected_uid: int, name: str = defaults.SOCKET_NAME
) -> SocketPathState:
    """
    Make the socket path free for a new listener, or refuse to start.

    Nothing but a stale socket owned by C{expected_uid} is ever removed:

      - absent: nothing to do;
      - a regular file, symlink, directory or anything not a socket: refused,
        left untouched;
      - a socket owned by another UID: refused, left untouched;
      - a socket with a listener (the connect probe succeeds, or its queue is
        full): another broker is serving; refused, left untouched;
      - a socket nobody listens on (connection refused): removed.

    @raise BrokerStartupError: the path is occupied by something that must
        not be removed.
    """
    path = os.path.join(directory, name)
    try:
        before = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return SocketPathState.ABSENT
    if not stat.S_ISSOCK(before.st_mode):
        raise BrokerStartupError(
            path,
            f"is {_describe(before.st_mode)}, not a socket; refusing to replace it "
            "(left untouched)",
        )
    if before.st_uid != expected_uid:
        raise BrokerStartupError(
            path,
            f"is a socket owned by UID {before.st_uid}, not UID {expected_uid}; "
            "refusing to replace it (left untouched)",
        )
    result = _probe(descriptor_path(directory_fd, directory, name))
    if result in (0, errno.EAGAIN, errno.EWOULDBLOCK, errno.EINPROGRESS):
        raise BrokerStartupError(
            path,
            "is an active socket (a listener answered); another broker is serving (left untouched)",
        )
    if result == errno.ENOENT:
        return SocketPathState.ABSENT
    if result != errno.ECONNREFUSED:
        raise BrokerStartupError(
            path, f"cannot tell whether the socket is stale ({os.strerror(result)}); left untouched"
        )
    # Stale.  Remove it only if the path still names the socket that was
    # judged: the directory belongs to the expected UID and the lock is held,
    # so only that UID could have swapped it, but checking costs nothing.
    try:
        now = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return SocketPathState.ABSENT
    if not SocketIdentity.of(before).matches(now):
        raise BrokerStartupError(path, "changed while it was being checked; left untouched")
    os.unlink(name, dir_fd=directory_fd)
    return SocketPathState.STALE_REMOVED


def identify_socket(
    directory_fd: int, name: str = defaults.SOCKET_NAME
) -> os.stat_result | None:
    """The C{lstat} of the socket path (or C{name}), or C{None} if nothing is there."""
    try:
        return os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_socket_if_ours(
    directory_fd: int, identity: SocketIdentity, name: str = defaults.SOCKET_NAME
) -> bool:
    """
    Remove the socket path only if it still names the socket the broker
    created (same device, inode and type).  A file that replaced it survives.

    @return: whether the path was removed.
    """
    info = identify_socket(directory_fd, name)
    if info is None or not identity.matches(info):
        return False
    try:
        os.unlink(name, dir_fd=directory_fd)
    except FileNotFoundError:
        return False
    return True
