"""
A FUSE filesystem whose server never answers C{FLUSH}: a stand-in for a
tenant with C{/dev/fuse} (or a local user with a setuid C{fusermount3}).

Every C{close(2)} of a file on it (each descriptor's, not only the last
reference's: the kernel's C{filp_close} calls the file's C{flush}) sends
C{FUSE_FLUSH} and waits for the answer.  A flush is a I{forced} request
(C{fs/fuse/file.c}, C{fuse_flush}: C{args.force = true}), so after a signal
interrupts its first, interruptible wait the kernel sends C{FUSE_INTERRUPT}
and then waits uninterruptibly (C{fs/fuse/dev.c}, C{request_wait_answer}):
the closing thread stays in D state, deaf to every signal, C{SIGKILL}
included, until the server answers or the connection is aborted.

Run as a program (as root): C{fusestall.py MOUNTPOINT LOG PARENT} (it dies
with PARENT).  It opens
C{/dev/fuse}, mounts it on MOUNTPOINT with C{mount(2)} (C{allow_other}, so
that a UID 1000 attacker can open files there), prints one JSON line
C{{"mounted": true, "connection": N}} (N: the connection's number under
C{/sys/fs/fuse/connections}), and serves: the root directory, files
C{f0} to C{f63} (empty, mode 0444), C{OPEN} and C{RELEASE} answered, every
other request refused with C{ENOSYS} except C{FLUSH} and C{INTERRUPT}, which
are never answered.  Each C{FLUSH} is logged to LOG as a line
C{flush PID} (the closing process).  Its end (killed) closes C{/dev/fuse},
which aborts the connection (C{fuse_dev_release}): every waiting flush then
fails with C{ENOTCONN} and its thread leaves D state.

Two options change what it answers (argv after PARENT):

  - C{flock}: the C{INIT} reply advertises C{FUSE_FLOCK_LOCKS} (remote
    C{flock(2)} locks; C{FUSE_POSIX_LOCKS} stays off), C{FLUSH} is answered
    (so that a process can close its own copy of a locked file), a lock
    request (C{SETLK}/C{SETLKW} of a type other than C{F_UNLCK}) is
    answered with success, and an unlock (C{F_UNLCK}) is never answered.
    Each lock request is logged as C{setlk PID TYPE}, each C{RELEASE} as
    C{release PID RELEASE_FLAGS} (C{FUSE_RELEASE_FLOCK_UNLOCK}, 2, is how
    the kernel asks the server to drop a file's flock lock at its release).
  - C{writeback}: the C{INIT} reply advertises C{FUSE_WRITEBACK_CACHE}
    (writes only dirty the page cache; the kernel writes them back later),
    files are mode 0666, C{FLUSH} is answered, and C{WRITE} never is (each
    logged as C{write PID}).  A release of a file's last reference then
    writes back the inode's dirty pages and waits for them
    (C{fs/fuse/file.c} C{fuse_release}: C{write_inode_now(inode, 1)} when
    C{fc->writeback_cache}), in D state, deaf to C{SIGKILL}
    (C{folio_wait_writeback}), until the connection is aborted.
  - C{answer-all}: every request that has an answer is answered, C{FLUSH}
    and unlocks included: the control run that shows a test can tell.

Each C{OPEN} is logged as C{open PID}.

The wire format is the kernel's C{include/uapi/linux/fuse.h} (protocol 7.38
as this machine's C{/usr/include/linux/fuse.h} has it): the request header
C{fuse_in_header}, the reply header C{fuse_out_header}, and the bodies
C{fuse_init_out}, C{fuse_entry_out}, C{fuse_attr_out}, C{fuse_open_out},
C{fuse_lk_in}, C{fuse_release_in}.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import struct
import subprocess
import sys
from pathlib import Path

IN_HEADER = struct.Struct("=IIQQIIIHH")
OUT_HEADER = struct.Struct("=IiQ")
INIT_IN = struct.Struct("=IIII")
#: fuse_init_out: major, minor, max_readahead, flags, max_background,
#: congestion_threshold, max_write, time_gran, max_pages, map_alignment,
#: flags2, unused[7].
INIT_OUT = struct.Struct("=IIIIHHIIHHI28x")
#: fuse_attr: ino, size, blocks, atime, mtime, ctime, their nsecs, mode,
#: nlink, uid, gid, rdev, blksize, flags.
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")
ENTRY_OUT = struct.Struct("=QQQQII")
ATTR_OUT = struct.Struct("=QII")
OPEN_OUT = struct.Struct("=QII")
#: fuse_lk_in: fh, owner, fuse_file_lock (start, end, type, pid), lk_flags.
LK_IN = struct.Struct("=QQQQIII")
#: fuse_release_in: fh, flags, release_flags, lock_owner.
RELEASE_IN = struct.Struct("=QIIQ")

LOOKUP, FORGET, GETATTR, OPEN, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 18, 25, 26
OPENDIR, RELEASEDIR, SETLK, SETLKW, INTERRUPT, BATCH_FORGET = 27, 29, 32, 33, 36, 42
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
FUSE_POSIX_LOCKS, FUSE_FLOCK_LOCKS = 1 << 1, 1 << 10
F_UNLCK = 2
FUSE_WRITEBACK_CACHE = 1 << 16
WRITE = 16

ROOT = 1
FILES = 64
MS_NOSUID, MS_NODEV = 2, 4
PR_SET_PDEATHSIG = 1


def attributes(node: int, mode: int = 0o444) -> bytes:
    if node == ROOT:
        return ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, 0o040755, 2, 0, 0, 0, 4096, 0)
    return ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, 0o100000 | mode, 1, 0, 0, 0, 4096, 0)


def reply(device: int, unique: int, body: bytes = b"", error: int = 0) -> None:
    try:
        os.write(device, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)
    except OSError as e:
        # ENOENT: the request was interrupted and is gone.
        if e.errno != errno.ENOENT:
            raise


def answer(device: int, opcode: int, unique: int, node: int, body: bytes,
           flock: bool = False, writeback: bool = False) -> None:
    mode = 0o666 if writeback else 0o444
    if opcode == INIT:
        major, minor, readahead, _ = INIT_IN.unpack_from(body)
        # Remote flock locks need protocol 7.17 or later (fs/fuse/inode.c,
        # process_init_reply: without FUSE_FLOCK_LOCKS, fc->no_flock).
        flags = (FUSE_FLOCK_LOCKS if flock else 0) | (FUSE_WRITEBACK_CACHE if writeback else 0)
        reply(device, unique, INIT_OUT.pack(7, min(minor, 38), readahead, flags, 16, 12,
                                            65536, 1, 0, 0, 0))
    elif opcode == LOOKUP:
        name = body.split(b"\0", 1)[0].decode("ascii", "replace")
        index = int(name[1:]) if name[:1] == "f" and name[1:].isdigit() else FILES
        if node != ROOT or index >= FILES:
            reply(device, unique, error=errno.ENOENT)
        else:
            child = 2 + index
            entry = ENTRY_OUT.pack(child, 0, 3600, 3600, 0, 0)
            reply(device, unique, entry + attributes(child, mode))
    elif opcode == GETATTR:
        reply(device, unique, ATTR_OUT.pack(3600, 0, 0) + attributes(node, mode))
    elif opcode in (OPEN, OPENDIR):
        reply(device, unique, OPEN_OUT.pack(unique, 0, 0))
    elif opcode == WRITE:
        # fuse_write_in's size; fuse_write_out: size, padding.
        reply(device, unique, struct.pack("=II", struct.unpack_from("=QQI", body)[2], 0))
    elif opcode in (RELEASE, RELEASEDIR, FLUSH, SETLK, SETLKW):
        reply(device, unique)
    else:
        reply(device, unique, error=errno.ENOSYS)


def serve(mountpoint: str, log_path: str, parent: int, options: frozenset[str] = frozenset()
          ) -> None:
    flock = "flock" in options
    writeback = "writeback" in options
    answer_all = "answer-all" in options
    libc = ctypes.CDLL(None, use_errno=True)
    # Dies with the test (even one killed by a timeout): the connection is
    # then aborted, and nothing stays in D state for want of an answer.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        return
    device = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={device},rootmode=40000,user_id=0,group_id=0,allow_other"
    if libc.mount(b"hostpid-stall", mountpoint.encode(), b"fuse.hostpid-stall",
                  MS_NOSUID | MS_NODEV, options.encode()) != 0:
        raise OSError(ctypes.get_errno(), "mount", mountpoint)
    log = open(log_path, "a", buffering=1)
    # The connection's number: the superblock's device, known without a
    # request (the mount's line in /proc/self/mountinfo).
    connection = None
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            if fields[4] == mountpoint:
                major, minor = fields[2].split(":")
                connection = os.makedev(int(major), int(minor))
    print(json.dumps({"mounted": True, "connection": connection}), flush=True)
    while True:
        try:
            request = os.read(device, 1 << 17)
        except OSError as e:
            if e.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                continue
            return  # ENODEV: unmounted
        _, opcode, unique, node, _, _, pid, _, _ = IN_HEADER.unpack_from(request)
        body = request[IN_HEADER.size:]
        silent = False
        if opcode == OPEN:
            log.write(f"open {pid}\n")
        elif opcode == FLUSH:
            log.write(f"flush {pid}\n")
            silent = not (flock or writeback or answer_all)
        elif opcode in (SETLK, SETLKW):
            kind = LK_IN.unpack_from(body)[4]
            log.write(f"setlk {pid} {kind}\n")
            silent = kind == F_UNLCK and not answer_all
        elif opcode == WRITE and writeback:
            log.write(f"write {pid}\n")
            silent = not answer_all
        elif opcode == RELEASE:
            log.write(f"release {pid} {RELEASE_IN.unpack_from(body)[2]}\n")
        if opcode not in NO_REPLY and not silent:
            answer(device, opcode, unique, node, body, flock, writeback)


def fuse_device_problem() -> str | None:
    """
    Why this machine cannot serve a FUSE filesystem (a real probe: open
    C{/dev/fuse}, after C{modprobe fuse} if it is missing), or C{None}.
    """
    for attempt in range(2):
        try:
            os.close(os.open("/dev/fuse", os.O_RDWR))
            return None
        except OSError as e:
            if attempt == 0 and e.errno == errno.ENOENT:
                subprocess.run(["modprobe", "fuse"], check=False, capture_output=True)
                continue
            return f"cannot open /dev/fuse: {e.strerror}"
    return "unreachable"


class StalledFuse:
    """
    The server above in a root child process, mounted on C{directory/fuse}
    (for the tests; the program above is what runs).  Leaving aborts the
    connection (every stuck flush fails and its process leaves D state) and
    unmounts it.
    """

    def __init__(self, directory: Path, timeout: float = 15.0, *options: str) -> None:
        self.options = options
        self.mountpoint = directory / "fuse"
        self.log = directory / "requests"
        self.timeout = timeout
        self.connection: int | None = None
        self.server: subprocess.Popen[str] | None = None

    def __enter__(self) -> StalledFuse:
        self.mountpoint.mkdir(mode=0o755)
        self.log.touch()
        self.server = subprocess.Popen(
            [sys.executable, __file__, str(self.mountpoint), str(self.log), str(os.getpid()),
             *self.options],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )
        assert self.server.stdout is not None
        ready, _, _ = select.select([self.server.stdout], [], [], self.timeout)
        line = self.server.stdout.readline() if ready else ""
        if not line:
            self.__exit__()
            raise AssertionError("the FUSE server did not mount")
        self.connection = json.loads(line)["connection"]
        return self

    def requests(self, kind: str) -> list[list[int]]:
        """
        The logged requests of one kind (C{open}, C{flush}, C{setlk},
        C{release}, C{write}), in order: each the sender's PID and what else is logged.
        """
        return [[int(field) for field in line.split()[1:]]
                for line in self.log.read_text().splitlines() if line.split()[0] == kind]

    def flushes(self) -> list[int]:
        """The PID of each process whose close sent a flush, in order."""
        return [fields[0] for fields in self.requests("flush")]

    def abort(self) -> None:
        """
        End the connection: through the FUSE control filesystem where it is
        mounted, and by ending the server (closing C{/dev/fuse} aborts it).
        """
        abort = Path(f"/sys/fs/fuse/connections/{self.connection}/abort")
        if self.connection is not None and abort.exists():
            abort.write_text("1")
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
        if self.server is not None:
            self.server.wait(self.timeout)
            if self.server.stdout is not None:
                self.server.stdout.close()

    def __exit__(self, *exc_info: object) -> None:
        self.abort()
        subprocess.run(["umount", "--lazy", str(self.mountpoint)], check=False,
                       capture_output=True, timeout=self.timeout)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), frozenset(sys.argv[4:]))
