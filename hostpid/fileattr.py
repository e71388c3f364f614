"""
The immutable attribute of an inode (C{chattr +i}), by descriptor.

Why the broker mountpoint carries it: C{<lock parent>/hostpid} is an entry of
a directory every GPU workload can write, and HAMi's device plugin makes that
directory 0777 on every allocation (C{os.Chmod("/tmp/vgpulock", 0777)}: the
sticky bit is gone).  In a 0777 directory any user can rename or remove any
entry, so between the moment a component looks at the entry and the moment
the runtime mounts the broker directory on it, a tenant can put a symlink
there (the runtime then resolves it inside the new container and mounts the
broker over, say, its C{/etc}); and after a container started, renaming or
removing the entry detaches the broker mount in every other mount namespace.

The kernel refuses to rename, remove or replace an immutable inode whoever
asks and whatever its directory's mode (C{may_delete()} in C{fs/namei.c}
returns C{EPERM} for C{IS_IMMUTABLE}, before any ownership rule); only a
process with C{CAP_LINUX_IMMUTABLE} in the initial user namespace can set or
clear the flag (C{fileattr_set_prepare()}), which no container is given by
default, a user-namespaced one never.  Mounting on an immutable directory is
allowed (a mount changes no inode), and nothing needs to create anything
inside the mountpoint: the broker directory is mounted over it.

Filesystems: ext4, xfs and btrfs have the flag; tmpfs since Linux 6.0
(C{shmem_fileattr_set}); overlayfs passes it to the upper layer since 5.13.
Where the filesystem lacks it the ioctl fails with C{ENOTTY} or
C{EOPNOTSUPP}, and without the capability with C{EPERM}; L{set_immutable}
says which, in an operator's words.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os

import attrs

#: C{_IOR('f', 1, long)} and C{_IOW('f', 2, long)} on 64-bit Linux; the
#: kernel reads and writes an C{int} whatever the encoded size says.
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
#: C{include/uapi/linux/fs.h}: the inode may not be changed, renamed,
#: removed or linked to.
FS_IMMUTABLE_FL = 0x00000010

#: Errors meaning "this filesystem has no such attribute".
_UNSUPPORTED = frozenset({errno.ENOTTY, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


@attrs.frozen
class Immutability:
    """
    Whether an inode carries the immutable attribute, and why not.

    @ivar immutable: the flag is set (as read back from the inode).
    @ivar problem: why it is not set: empty when it is.
    """

    immutable: bool
    problem: str = ""


def _filesystem(fd: int) -> str:
    """The filesystem type of C{fd}'s mount, from C{/proc/self/mountinfo}, or C{""}."""
    try:
        st = os.fstat(fd)
        wanted = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mountinfo:
            for line in mountinfo:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return ""


def get_flags(fd: int) -> int:
    """The inode flags of C{fd} (C{FS_IOC_GETFLAGS}); raises C{OSError}."""
    buffer = array.array("i", [0])
    fcntl.ioctl(fd, FS_IOC_GETFLAGS, buffer, True)
    return buffer[0] & 0xFFFFFFFF


def _set_flags(fd: int, flags: int) -> None:
    buffer = array.array("I", [flags & 0xFFFFFFFF])
    fcntl.ioctl(fd, FS_IOC_SETFLAGS, buffer, False)


def is_immutable(fd: int) -> bool:
    """Whether C{fd}'s inode is immutable (C{False} where the filesystem has no flags)."""
    try:
        return bool(get_flags(fd) & FS_IMMUTABLE_FL)
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise


def describe_error(fd: int, error: OSError) -> str:
    """Why the flag could not be set on C{fd}, for an operator."""
    kind = _filesystem(fd) or "this filesystem"
    if error.errno in _UNSUPPORTED:
        hint = " (tmpfs has it from Linux 6.0)" if kind == "tmpfs" else ""
        return (f"{kind} has no immutable attribute on Linux {os.uname().release}{hint}: "
                f"put the lock parent on ext4, xfs or btrfs")
    if error.errno == errno.EPERM:
        return ("setting the immutable attribute needs CAP_LINUX_IMMUTABLE, which this "
                "process does not have")
    return f"cannot set the immutable attribute: {error.strerror}"


def set_immutable(fd: int) -> Immutability:
    """
    Set the immutable attribute on C{fd}'s inode, keeping its other flags,
    and read it back.  Never raises for a filesystem without the flag or a
    process without the capability: the answer says so.
    """
    try:
        flags = get_flags(fd)
        if not flags & FS_IMMUTABLE_FL:
            _set_flags(fd, flags | FS_IMMUTABLE_FL)
        if get_flags(fd) & FS_IMMUTABLE_FL:
            return Immutability(True)
        return Immutability(False, "the immutable attribute did not stick")
    except OSError as e:
        return Immutability(False, describe_error(fd, e))


def clear_immutable(fd: int) -> None:
    """
    Clear the immutable attribute on C{fd}'s inode, if set (root with
    C{CAP_LINUX_IMMUTABLE}); raises C{OSError} when it cannot.
    """
    try:
        flags = get_flags(fd)
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return
        raise
    if flags & FS_IMMUTABLE_FL:
        _set_flags(fd, flags & ~FS_IMMUTABLE_FL)
