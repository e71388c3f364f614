"""
Run a command under a seccomp filter that makes this kernel answer as an
older one (or a stricter container runtime) would, at the system call
boundary, for real:

  C{--no-peerpidfd}   C{getsockopt(..., SOL_SOCKET, SO_PEERPIDFD)} fails with
                      C{ENOPROTOOPT}, as on every kernel before Linux 6.5;
  C{--no-pidfd-open}  C{pidfd_open} fails with C{EPERM}, as under a seccomp
                      profile that predates the call.

x86_64 only (system call numbers and the audit architecture are checked).
The filter is installed with C{no_new_privs} and survives C{exec}.

Usage: seccompfilter.py [--no-peerpidfd] [--no-pidfd-open] -- ARGV...
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

AUDIT_ARCH_X86_64 = 0xC000003E
NR_GETSOCKOPT = 55
NR_PIDFD_OPEN = 434
SOL_SOCKET = 1
SO_PEERPIDFD = 77

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

LD_ABS_W = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K

#: Offsets in struct seccomp_data: nr, arch, then args[i] at 16 + 8 * i (the
#: low 32 bits first on this little-endian architecture).
NR, ARCH, ARG1, ARG2 = 0, 4, 24, 32


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def program(no_peerpidfd: bool, no_pidfd_open: bool) -> list[tuple[int, int, int, int]]:
    """The filter, as (code, jt, jf, k); jumps are relative, forward only."""
    allow = (RET_K, 0, 0, SECCOMP_RET_ALLOW)
    body: list[tuple[int, int, int, int]] = []
    if no_pidfd_open:
        body += [(LD_ABS_W, 0, 0, NR), (JEQ_K, 0, 1, NR_PIDFD_OPEN),
                 (RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM)]
    if no_peerpidfd:
        # getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, ...): level is args[1], name args[2].
        body += [(LD_ABS_W, 0, 0, NR), (JEQ_K, 0, 5, NR_GETSOCKOPT),
                 (LD_ABS_W, 0, 0, ARG1), (JEQ_K, 0, 3, SOL_SOCKET),
                 (LD_ABS_W, 0, 0, ARG2), (JEQ_K, 0, 1, SO_PEERPIDFD),
                 (RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOPROTOOPT)]
    # Anything but x86_64 (a 32-bit call, say) is let through untouched.
    return [(LD_ABS_W, 0, 0, ARCH), (JEQ_K, 0, len(body), AUDIT_ARCH_X86_64), *body, allow]


def install(no_peerpidfd: bool, no_pidfd_open: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    instructions = program(no_peerpidfd, no_pidfd_open)
    filters = (SockFilter * len(instructions))(*(SockFilter(*i) for i in instructions))
    fprog = SockFprog(len(instructions), filters)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main(argv: list[str]) -> None:
    separator = argv.index("--")
    options, command = argv[:separator], argv[separator + 1:]
    assert command and set(options) <= {"--no-peerpidfd", "--no-pidfd-open"}, argv
    assert os.uname().machine == "x86_64", "x86_64 system call numbers"
    install("--no-peerpidfd" in options, "--no-pidfd-open" in options)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
