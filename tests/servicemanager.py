"""
The service manager's side of socket activation and the descriptor store,
played by a test (no systemd needed): it passes listeners with
C{LISTEN_FDS}/C{LISTEN_PID}/C{LISTEN_FDNAMES} from descriptor 3 on, listens
on a C{NOTIFY_SOCKET} datagram socket for C{READY=1} and for C{FDSTORE=1}
(with the descriptor in C{SCM_RIGHTS}), and passes what it stored back on
the next start, as systemd does for C{systemctl restart} and C{Restart=}.
As systemd does for C{NotifyAccess=main}, it takes notifications from the
service's main process only (the sender's PID from C{SO_PASSCRED}) and
follows C{MAINPID=}.  Written from sd_listen_fds(3), sd_notify(3) and
systemd.exec(5).
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from support import BrokerProcess, subprocess_env

#: Runs C{"$@"} with C{LISTEN_PID} set to its own PID (exec keeps it).
LISTEN_PID_SHELL = ["sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"', "sh"]


def bind_listener(directory: Path, mode: int = 0o666) -> socket.socket:
    """What C{hostpid-broker.socket} makes: the socket at the broker's path."""
    directory.mkdir(mode=0o711, exist_ok=True)
    os.chmod(directory, 0o711)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(directory / "broker.sock"))
    finally:
        os.umask(old)
    sock.listen(1024)
    return sock


class ServiceManager:
    """One service's manager: its notify socket, its descriptor store."""

    def __init__(self, directory: Path, runtime: Path) -> None:
        self.directory = directory
        self.notify_path = runtime / "notify"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.notify.setblocking(False)
        #: (descriptor, name) the service stored, in order.
        self.store: list[tuple[int, str]] = []
        self.messages: list[str] = []
        #: The service's main process, as the last start or C{MAINPID=} set it.
        self.main_pid: int | None = None
        #: (sender PID, message) taken, in order.
        self.taken: list[tuple[int, str]] = []
        #: (sender PID, message) ignored: not from the main process.
        self.rejected: list[tuple[int, str]] = []

    def start(
        self, passed: list[tuple[int, str]], env: dict[str, str] | None = None,
        args: Sequence[str] = (),
    ) -> BrokerProcess:
        """Start the broker with C{passed} as descriptors 3, 4, ..."""
        extra = {
            "NOTIFY_SOCKET": str(self.notify_path),
            "FDSTORE": "4",
            **(env or {}),
        }
        if passed:
            extra["LISTEN_FDS"] = str(len(passed))
            extra["LISTEN_FDNAMES"] = ":".join(name for _, name in passed)
        sources = [fd for fd, _ in passed]
        broker = BrokerProcess(
            self.directory, args, env=subprocess_env(extra), argv_prefix=LISTEN_PID_SHELL,
            preexec_fn=_place(sources), pass_fds=range(3, 3 + len(sources)),
        )
        self.main_pid = broker.pid
        return broker

    def collect(self) -> None:
        """
        Read every notification waiting: from the main process, keep what is
        stored (once per socket) and follow C{MAINPID=}; ignore the rest.
        """
        while True:
            try:
                data, fds, sender = _receive(self.notify)
            except BlockingIOError:
                return
            text = data.decode()
            self.messages.append(text)
            if self.main_pid is not None and sender != self.main_pid:
                self.rejected.append((sender, text))
                for fd in fds:
                    os.close(fd)
                continue
            self.taken.append((sender, text))
            fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
            if "MAINPID" in fields:
                self.main_pid = int(fields["MAINPID"])
            if fields.get("FDSTORE") == "1":
                for fd in fds:
                    self._keep(fd, fields.get("FDNAME", "stored"))
            elif fields.get("FDSTOREREMOVE") == "1":
                for fd, name in list(self.store):
                    if name == fields.get("FDNAME"):
                        os.close(fd)
                        self.store.remove((fd, name))
            else:
                for fd in fds:
                    os.close(fd)

    def _keep(self, fd: int, name: str) -> None:
        identity = _socket_inode(fd)
        if any(_socket_inode(kept) == identity for kept, _ in self.store):
            os.close(fd)  # the same socket again: systemd keeps one
            return
        self.store.append((fd, name))

    def close(self) -> None:
        self.notify.close()
        for fd, _ in self.store:
            os.close(fd)
        self.store.clear()


@contextmanager
def managed(tmp_path: Path) -> Iterator[ServiceManager]:
    """A service manager for a broker directory under C{tmp_path}, closed afterwards."""
    runtime = tmp_path / "systemd"
    runtime.mkdir()
    made = ServiceManager(tmp_path / "broker", runtime)
    try:
        yield made
    finally:
        made.close()


def _receive(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One notification: its text, the descriptors it carries, its sender's PID."""
    ucred = struct.Struct("iII")
    data, ancillary, _, _ = sock.recvmsg(
        4096, socket.CMSG_SPACE(8 * 4) + socket.CMSG_SPACE(ucred.size)
    )
    fds: list[int] = []
    sender = 0
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(array.array("i", payload[:usable]))
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            sender = ucred.unpack(payload[: ucred.size])[0]
    return data, fds, sender


def _socket_inode(fd: int) -> int:
    info = os.fstat(fd)
    assert stat.S_ISSOCK(info.st_mode)
    return info.st_ino


def _place(sources: list[int]) -> Callable[[], None]:
    """In the child: C{sources} become descriptors 3, 4, ... (inheritable)."""

    def place() -> None:
        # Out of the way of 3, 4, ... first, so no placement overwrites a source.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in sources]
        for index, fd in enumerate(high):
            os.dup2(fd, 3 + index, inheritable=True)
        for fd in high:
            os.close(fd)

    return place


__all__ = ["ServiceManager", "bind_listener", "managed"]
