"""
Test tools for the client: a scripted fake broker on a real Unix socket, the
C contract client built with the system compiler, and the layout helpers.

The fake broker is honest because the client is what is under test: it is a
real listening socket in a real directory, served by a thread, that sends
exactly the bytes a test chooses (optionally one at a time) and records what
the client sent.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support import REPO, WAIT_SECONDS, as_user_argv, require_tool

from hostpid import wire

C_SOURCE = REPO / "tests" / "c" / "hostpid_client.c"

#: A UID that is not root, for foreign owners and setuid children.
OTHER_UID = 1000


def as_other_uid_argv() -> list[str]:
    """A command prefix that runs a program as UID/GID 1000 with no groups."""
    return as_user_argv(OTHER_UID, [])


def response(status: int = 0, pid: int = 4242, version: int = 1, magic: bytes = b"HPID") -> bytes:
    """Twelve reply bytes with any field chosen, valid or not."""
    return magic + version.to_bytes(2, "big") + status.to_bytes(2, "big") + pid.to_bytes(4, "big")


class FakeBroker:
    """
    A listening Unix socket that answers every connection with C{reply}.

    @ivar requests: what each connection sent before the reply, in order.
    @ivar connections: how many connections were accepted.
    """

    def __init__(
        self,
        path: Path,
        reply: bytes = response(),
        trickle: float | None = None,
        hold: bool = False,
        backlog: int = 64,
        accept: bool = True,
    ) -> None:
        self.path = path
        self.reply = reply
        self.trickle = trickle
        self.hold = hold
        self.accept = accept
        self.requests: list[bytes] = []
        self.connections = 0
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(os.fspath(path))
        self.listener.listen(backlog)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeBroker:
        if self.accept:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        os.write(self._wake_write, b"x")
        if self._thread.is_alive():
            self._thread.join(WAIT_SECONDS)
            assert not self._thread.is_alive(), "fake broker thread did not stop"
        self.listener.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select():
                    if key.fileobj is self.listener and not self._stop.is_set():
                        connection, _ = self.listener.accept()
                        self.connections += 1
                        with connection:
                            self._answer(connection)

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(WAIT_SECONDS)
        request = b""
        try:
            while len(request) < wire.REQUEST_SIZE:
                chunk = connection.recv(wire.REQUEST_SIZE - len(request))
                if not chunk:
                    break
                request += chunk
        except OSError:
            pass
        self.requests.append(request)
        if self.hold:
            self._stop.wait(WAIT_SECONDS)
            return
        try:
            if self.trickle is None:
                connection.sendall(self.reply)
                return
            for index in range(len(self.reply)):
                connection.sendall(self.reply[index : index + 1])
                if self._stop.wait(self.trickle):
                    return
        except OSError:
            return


@contextmanager
def fake_broker(
    directory: Path, reply: bytes = response(), **kwargs: object
) -> Iterator[FakeBroker]:
    with FakeBroker(directory / "broker.sock", reply, **kwargs) as broker:  # type: ignore[arg-type]
        yield broker


def make_directory(path: Path, mode: int = 0o711) -> Path:
    """A root-style broker directory: created and then chmod-ed (umask-proof)."""
    path.mkdir()
    os.chmod(path, mode)
    return path


def fill_accept_queue(path: Path) -> list[socket.socket]:
    """Connect to C{path} until the kernel says the accept queue is full."""
    held: list[socket.socket] = []
    for _ in range(10000):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            sock.connect(os.fspath(path))
        except BlockingIOError:
            sock.close()
            return held
        held.append(sock)
    raise AssertionError("the accept queue never filled")


def build_c_client(out_dir: Path, static: bool = False) -> Path:
    """
    Compile the C contract client with the system C compiler; C{static} links
    it statically, for a container image that has no C library.
    """
    cc = require_tool("cc")
    binary = out_dir / "hostpid_client"
    linking = ["-static"] if static else []
    subprocess.run(
        [cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", *linking, "-o", str(binary),
         str(C_SOURCE)],
        check=True,
        timeout=120,
    )
    os.chmod(out_dir, 0o755)
    return binary
