"""
Filesystem safety for the broker's directory, lock file and socket path.

Every rule of the design's security boundary that touches the filesystem
lives here, as plain functions over descriptors:

  - the directory is a real directory (never a symlink), owned by the
    expected UID, mode 0711; it is opened once and every later step works
    relative to that descriptor, so a path swapped above it cannot redirect
    the broker;
  - C{broker.lock} is a regular 0600 file owned by the expected UID, opened
    with C{O_NOFOLLOW} and held with C{flock} for the broker's life: a second
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


def open_broker_directory(path: str, expected_uid: int) -> int:
    """
    Create C{path} if missing and return a descriptor for it, after proving
    it is a real directory owned by C{expected_uid}, and setting it to 0711.

    Missing parents are created (mode 0755, as C{install -d} would): the
    default C{/var/run/hami} does not exist on a fresh node.  The final
    component is never followed if it is a symlink.

    @raise BrokerStartupError: the path is a symlink, not a directory, or
        owned by someone else.
    """
    parent = os.path.dirname(path.rstrip("/")) or "/"
    try:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    except OSError as e:
        raise BrokerStartupError(
            parent, f"cannot create the parent directory: {e.strerror}"
        ) from None
    try:
        os.mkdir(path, defaults.DIRECTORY_MODE)
    except FileExistsError:
        pass
    except OSError as e:
        raise BrokerStartupError(
            path, f"cannot create the broker directory: {e.strerror}"
        ) from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        # O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR, not ELOOP,
        # when its target is a directory: look at what is there to say which.
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                kind = _describe(os.lstat(path).st_mode)
            except OSError:
                kind = "a symlink" if e.errno == errno.ELOOP else "not a directory"
            if kind == "a symlink":
                raise BrokerStartupError(
                    path, "is a symlink; the broker directory must be a real directory"
                ) from None
            raise BrokerStartupError(
                path, f"is {kind}; the broker directory must be a directory"
            ) from None
        raise BrokerStartupError(path, f"cannot open the broker directory: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != expected_uid:
            raise BrokerStartupError(
                path,
                f"is owned by UID {info.st_uid}; the broker directory must be owned by "
                f"UID {expected_uid}",
            )
        os.fchmod(fd, defaults.DIRECTORY_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def clear_socket_path(directory_fd: int, directory: str, expected_uid: int) -> SocketPathState:
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
    path = os.path.join(directory, defaults.SOCKET_NAME)
    try:
        before = os.stat(defaults.SOCKET_NAME, dir_fd=directory_fd, follow_symlinks=False)
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
    result = _probe(path)
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
        now = os.stat(defaults.SOCKET_NAME, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return SocketPathState.ABSENT
    if not SocketIdentity.of(before).matches(now):
        raise BrokerStartupError(path, "changed while it was being checked; left untouched")
    os.unlink(defaults.SOCKET_NAME, dir_fd=directory_fd)
    return SocketPathState.STALE_REMOVED


def identify_socket(directory_fd: int) -> os.stat_result | None:
    """The C{lstat} of the socket path, or C{None} if nothing is there."""
    try:
        return os.stat(defaults.SOCKET_NAME, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_socket_if_ours(directory_fd: int, identity: SocketIdentity) -> bool:
    """
    Remove the socket path only if it still names the socket the broker
    created (same device, inode and type).  A file that replaced it survives.

    @return: whether the path was removed.
    """
    info = identify_socket(directory_fd)
    if info is None or not identity.matches(info):
        return False
    try:
        os.unlink(defaults.SOCKET_NAME, dir_fd=directory_fd)
    except FileNotFoundError:
        return False
    return True
