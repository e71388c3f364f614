"""
Is this client running under a sandboxed runtime, where the broker cannot
see who is asking?

Under gVisor (C{runsc}) a workload has no host process of its own: a host
Unix socket (C{--host-uds=open} or C{all}) is connected by the sandbox's
gofer on the workload's behalf, so the broker's C{SO_PEERCRED} names the
gofer, one PID for every process of the sandbox.  The answer would be a
real, plausible and wrong PID.  A VM runtime (Kata) shares host directories
over 9p or virtio-fs, where a socket file's listener is in another kernel.

Two signals, each one system call and each a fact the runtime itself
reports, not a guess from timing or names:

  1. the kernel: gVisor's sentry answers C{uname()} with a version string it
     has never changed (C{#1 SMP Sun Jan 10 15:06:54 PST 2016}, in
     C{pkg/sentry/kernel/version} of every release), and from 2026 a
     release ending in C{-gvisor};
  2. the broker directory's filesystem: C{fstatfs} of the checked directory
     gives C{V9FS_MAGIC} for a gofer mount in every gVisor release, and for a
     9p share in a VM.  A host's broker directory is a bind mount of a
     tmpfs directory, never 9p.

Not detected (see C{docs/compatibility.md}): a VM runtime sharing over
virtio-fs (FUSE's magic is also a legitimate host filesystem); such a
connect fails instead, since the socket's listener is in the host kernel.

This module reads and judges; naming the check is L{hostpid.client.trust}'s.
"""

from __future__ import annotations

import os
import struct

from hostpid.values import Value

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

#: What gVisor's sentry reports as C{uname().version}, in every release.
GVISOR_KERNEL_VERSION = "#1 SMP Sun Jan 10 15:06:54 PST 2016"
#: The suffix of gVisor's C{uname().release} from 2026 (C{4.19.0-gvisor}).
GVISOR_RELEASE_SUFFIX = "-gvisor"
#: C{V9FS_MAGIC} (include/uapi/linux/magic.h): gVisor's gofer mounts, 9p shares.
V9FS_MAGIC = 0x01021997

#: C{struct statfs} is at most 120 bytes on Linux; C{f_type} comes first
#: (a C{long}, C{__fsword_t}) on every architecture.
_STATFS_SIZE = 256
_F_TYPE = struct.Struct("l")


class SandboxSignals(Value):
    """
    What the runtime told us about itself.

    @ivar kernel_release: C{uname().release}.
    @ivar kernel_version: C{uname().version}.
    @ivar mount_type: the broker directory's C{f_type} from C{fstatfs}, or
        C{None} when there was no directory to ask about or the call failed.
    """

    __slots__ = ("kernel_release", "kernel_version", "mount_type")
    kernel_release: str
    kernel_version: str
    mount_type: int | None

    def __init__(self, kernel_release: str, kernel_version: str, mount_type: int | None) -> None:
        self._set(kernel_release=kernel_release, kernel_version=kernel_version,
                  mount_type=mount_type)


#: The C library's C{fstatfs}, once L{ctypes_fstatfs_type} has looked it up.
_ctypes_fstatfs: Callable[..., int] | None = None


def ctypes_fstatfs_type(fd: int) -> int:
    """
    C{f_type} of the filesystem C{fd} is on, through C{ctypes}: where the C
    helper is not built.  C{ctypes} is imported here, on first use, and
    calls the C library already loaded into this process (no search, no
    subprocess).

    @raise OSError: C{fstatfs} failed.
    """
    import ctypes

    global _ctypes_fstatfs
    fstatfs = _ctypes_fstatfs
    if fstatfs is None:
        fstatfs = _ctypes_fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
        fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)
        fstatfs.restype = ctypes.c_int
    buffer = ctypes.create_string_buffer(_STATFS_SIZE)
    if fstatfs(fd, buffer) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    (f_type,) = _F_TYPE.unpack_from(buffer.raw)
    return int(f_type) & 0xFFFFFFFF


#: C{f_type} of the filesystem a descriptor is on (Python's C{statvfs} has
#: no such field): one C call where the helper is built
#: (native/_hostpid_native.c), else through C{ctypes}, whose import costs an
#: exec probe (a fresh interpreter every few seconds on every node) about 3 ms.
fstatfs_type: Callable[[int], int]
try:
    from _hostpid_native import fstatfs_type
except ImportError:
    fstatfs_type = ctypes_fstatfs_type


def _fstatfs_type(fd: int) -> int | None:
    """L{fstatfs_type}, or C{None} when the call failed."""
    try:
        return fstatfs_type(fd)
    except OSError:
        return None


def read_signals(directory_fd: int | None) -> SandboxSignals:
    """The signals for the broker directory open at C{directory_fd} (if any)."""
    kernel = os.uname()
    mount_type = _fstatfs_type(directory_fd) if directory_fd is not None else None
    return SandboxSignals(kernel.release, kernel.version, mount_type)


def sandbox_problem(signals: SandboxSignals) -> str | None:
    """
    Why this looks like a sandboxed runtime, naming it, or C{None} when
    nothing says so.
    """
    if (
        signals.kernel_version == GVISOR_KERNEL_VERSION
        or signals.kernel_release.endswith(GVISOR_RELEASE_SUFFIX)
    ):
        return (
            f"gVisor (runsc) detected: the kernel is gVisor's sentry (uname "
            f"{signals.kernel_release!r} {signals.kernel_version!r}); sandboxed runtime: the "
            "broker would see the sandbox's gofer, not this process"
        )
    if signals.mount_type == V9FS_MAGIC:
        return (
            "the broker directory is on a 9p filesystem (f_type 0x01021997: gVisor's gofer "
            "or a VM runtime's share); sandboxed runtime: the broker would not see this process"
        )
    return None


def describe(signals: SandboxSignals) -> str:
    """What was looked at, for an C{ok} line."""
    mount = "not read" if signals.mount_type is None else f"f_type 0x{signals.mount_type:08x}"
    return f"not sandboxed: kernel {signals.kernel_release}, broker directory {mount}"
