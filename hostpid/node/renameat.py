"""
C{renameat2(2)}: the two atomic renames Python's C{os} module lacks.

The broker mountpoint lives in a directory every workload can write
(C{/tmp/vgpulock}, 01777).  Replacing an entry there with "remove it, then
create ours" leaves the name free for a moment, and a workload looping on
C{mkdir} wins that moment every time.  C{renameat2} closes it:

  - C{RENAME_NOREPLACE}: put our entry at a free name, failing with
    C{EEXIST} instead of replacing whatever appeared there;
  - C{RENAME_EXCHANGE}: swap our entry with whatever is at the name, in one
    step; the name is never free, and what was there is now under our
    temporary name, untouched (never followed: rename works on names).

glibc has had a C{renameat2} wrapper since 2.28; where it is missing the raw
system call is used, on the architectures whose number is known here.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable

#: Fail with EEXIST if the new name exists.
RENAME_NOREPLACE = 1
#: Atomically exchange the two names.
RENAME_EXCHANGE = 2

#: The system call number, by C{uname -m}, for a libc without the wrapper.
SYSCALL_NUMBERS = {"x86_64": 316, "aarch64": 276}

_Renameat2 = Callable[[int, bytes, int, bytes, int], int]


def _load() -> _Renameat2 | None:
    libc = ctypes.CDLL(None, use_errno=True)
    wrapper = getattr(libc, "renameat2", None)
    if wrapper is not None:
        wrapper.argtypes = (
            ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
        )
        wrapper.restype = ctypes.c_int
        return wrapper
    number = SYSCALL_NUMBERS.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def raw(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        return int(syscall(
            ctypes.c_long(number), ctypes.c_int(olddirfd), ctypes.c_char_p(old),
            ctypes.c_int(newdirfd), ctypes.c_char_p(new), ctypes.c_uint(flags),
        ))

    return raw


_renameat2 = _load()


def available() -> bool:
    """Whether this process can call C{renameat2} at all."""
    return _renameat2 is not None


def renameat2(old: str, new: str, *, dir_fd: int, flags: int) -> None:
    """
    Rename C{old} to C{new}, both relative to C{dir_fd}, with C{flags}.

    @raise OSError: with the kernel's errno (C{EEXIST} for
        C{RENAME_NOREPLACE} when C{new} exists, C{ENOENT} for
        C{RENAME_EXCHANGE} when either is missing, C{EINVAL} when the
        filesystem does not support the flag, C{ENOSYS} when nothing here can
        make the call).
    """
    if _renameat2 is None:
        raise OSError(
            38, f"renameat2 is not available (no libc wrapper, unknown machine "
            f"{platform.machine()!r})", old,
        )
    result = _renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), flags)
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), old, None, new)
