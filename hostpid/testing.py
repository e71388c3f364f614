"""
A broker double for the tests of code that asks the broker, the way
C{treq.testing} serves the tests of code that uses treq.

L{FakeBroker} is a real listening Unix socket in a private temporary
directory, served by its own thread: the project's own clients (blocking or
Twisted) talk to it exactly as they talk to the real broker, under the
policy it hands out (L{FakeBroker.policy}), with no root, no read-only mount
and no C{twistd}.

It serves from a thread, not from the reactor, on purpose: a test that calls
the blocking client blocks the thread it runs on, and under trial that is
the reactor's thread.  A double served by the reactor would never answer
that call; one served by its own thread answers the blocking client with or
without a running reactor and the Twisted client alike.

Typical use (see C{docs/client.md} for a complete trial and pytest test)::

    with FakeBroker() as broker:
        assert hostpid.query_host_pid(broker.policy, broker.environ) == os.getpid()
"""

from __future__ import annotations

import os
import selectors
import socket
import stat
import tempfile
import threading
from collections.abc import Mapping
from types import TracebackType

import attrs
from twisted.logger import Logger

from hostpid import defaults, wire
from hostpid.client.trust import PEER_PID, READ_ONLY_MOUNT, TrustPolicy
from hostpid.gate import ENABLED_VALUE, GATE_ENV
from hostpid.peercred import peer_credentials

__all__ = ["FakeBroker"]

#: The longest C{sun_path} Linux accepts, terminating NUL excluded.
_SUN_PATH_MAX = 107

#: How long L{FakeBroker.stop} waits for its thread; it only ever waits in
#: C{select}, which the wake-up pipe ends at once.
_STOP_SECONDS = 10.0

_log = Logger()


@attrs.define
class _Connection:
    """One accepted connection: what it sent, and what is left to send it."""

    sock: socket.socket
    request: bytes = b""
    outgoing: bytes = b""
    answered: bool = False


class FakeBroker:
    """
    A broker double on a real Unix socket.  Give at most one of C{pid},
    C{reply} and C{silent}:

      - nothing: each caller is answered with its own PID, from
        C{SO_PEERCRED}, as the real broker answers it;
      - C{pid}: every valid request is answered with that PID;
      - C{reply}: every connection that sends its eight request bytes gets
        exactly these bytes instead of a reply, then the connection closes
        (a malformed, cut-short or refusing broker);
      - C{silent=True}: requests are read and never answered, until the
        caller gives up (its deadline) or L{stop} closes the connection.

    Without C{reply}, a request that is not the version 1 get-host-PID
    request gets status 1 and PID 0, and a connection that closes before
    sending eight bytes gets nothing, as from the real broker.

    @ivar requests: the bytes each connection sent (up to eight), in the
        order they were read; a test can check what its code sent.
    @ivar connections: how many connections were accepted.
    """

    def __init__(
        self, pid: int | None = None, reply: bytes | None = None, silent: bool = False
    ) -> None:
        given = [name for name, value in (("pid", pid), ("reply", reply)) if value is not None]
        if silent:
            given.append("silent")
        if len(given) > 1:
            raise ValueError(f"give at most one of pid, reply and silent, not {', '.join(given)}")
        self._fixed: bytes | None = None
        if pid is not None:
            self._fixed = wire.encode_ok(pid)  # ValueError outside 1..2**31-1
        if reply is not None and not isinstance(reply, bytes):
            raise TypeError(f"reply must be bytes, not {type(reply).__name__}")
        self._reply = reply
        self._silent = silent
        self.requests: list[bytes] = []
        self.connections = 0
        self._directory: str | None = None
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._policy: TrustPolicy | None = None
        self._state = "new"

    # --- What a test uses. ---

    @property
    def socket_path(self) -> str:
        """The socket's path (in a private temporary directory)."""
        return self.policy.socket_path

    @property
    def policy(self) -> TrustPolicy:
        """
        The policy under which the project's clients trust this broker as
        they trust the real one: every check on, except C{read-only-mount}
        (turned off by name: a temporary directory is not a read-only
        mount) and C{peer-pid} (turned off by name: this double listens in
        the calling process, which in a container, the usual place for CI,
        is exactly what C{peer-pid} refuses there), with this process's
        effective UID as the trusted UID (it owns the directory and the
        socket, and listens on it).  Never copy this policy to a workload.

        @raise RuntimeError: the broker is not running.
        """
        if self._policy is None or self._state != "running":
            raise RuntimeError(f"FakeBroker is {self._state}: start() it first")
        return self._policy

    @property
    def environ(self) -> Mapping[str, str]:
        """An environment with the gate on, for the clients' C{environ} argument."""
        return {GATE_ENV: ENABLED_VALUE}

    def start(self) -> FakeBroker:
        """
        Make the directory and the socket and start serving.

        @raise RuntimeError: already started, or stopped (a FakeBroker runs once).
        @raise OSError: the directory or the socket could not be made.
        """
        if self._state != "new":
            raise RuntimeError(f"FakeBroker is {self._state}: a FakeBroker starts once")
        try:
            self._open()
        except BaseException:
            self._close()
            self._state = "stopped"
            raise
        self._state = "running"
        return self

    def stop(self) -> None:
        """
        Stop serving, close every connection and remove the socket and the
        directory.  Returns once the thread has ended; stopping twice, or a
        broker never started, is harmless.
        """
        if self._state != "running":
            self._state = "stopped"
            return
        self._state = "stopped"
        self._close()

    def __enter__(self) -> FakeBroker:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        path = os.path.join(self._directory, defaults.SOCKET_NAME) if self._directory else None
        return f"<FakeBroker {self._state} {path!r}>"

    # --- Making and unmaking. ---

    def _open(self) -> None:
        self._directory = _private_directory()
        path = os.path.join(self._directory, defaults.SOCKET_NAME)
        listener = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        self._listener = listener
        listener.bind(path)
        info = os.lstat(path)
        self._identity = (info.st_dev, info.st_ino)
        listener.listen(socket.SOMAXCONN)
        self._wake = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._policy = TrustPolicy(socket_path=path, trusted_uid=os.geteuid()).without(
            READ_ONLY_MOUNT, PEER_PID
        )
        self._thread = threading.Thread(
            target=self._serve, name=f"hostpid FakeBroker {path}", daemon=True
        )
        self._thread.start()

    def _close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            assert self._wake is not None
            os.write(self._wake[1], b"x")
            thread.join(_STOP_SECONDS)
            if thread.is_alive():
                raise RuntimeError(f"FakeBroker thread did not stop within {_STOP_SECONDS} s")
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        wake, self._wake = self._wake, None
        for fd in wake or ():
            os.close(fd)
        directory, self._directory = self._directory, None
        if directory is not None:
            self._remove(directory)

    def _remove(self, directory: str) -> None:
        """Remove the socket if it is still ours, then the directory if it is empty."""
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            _log.warn("FakeBroker: {path}: cannot open to clean up: {error}",
                      path=directory, error=error)
            return
        try:
            try:
                info = os.stat(defaults.SOCKET_NAME, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                info = None
            if info is not None and (
                stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == self._identity
            ):
                os.unlink(defaults.SOCKET_NAME, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            os.rmdir(directory)
        except OSError as error:
            # Something else was put there: it is not ours to delete.
            _log.warn("FakeBroker: {path}: left in place: {error}", path=directory, error=error)

    # --- Serving, on the broker's own thread. ---

    def _serve(self) -> None:
        listener, wake = self._listener, self._wake
        assert listener is not None and wake is not None
        connections: dict[int, _Connection] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(wake[0], selectors.EVENT_READ)
            try:
                while not self._stopping.is_set():
                    for key, events in selector.select():
                        if key.fileobj is listener:
                            self._accept(listener, selector, connections)
                        elif isinstance(key.data, _Connection):
                            self._service(key.data, events, selector, connections)
            finally:
                for connection in connections.values():
                    connection.sock.close()

    def _accept(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        connections: dict[int, _Connection],
    ) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                _log.warn("FakeBroker: accept failed: {error}", error=error)
                return
            sock.setblocking(False)
            self.connections += 1
            connection = _Connection(sock)
            connections[sock.fileno()] = connection
            selector.register(sock, selectors.EVENT_READ, connection)

    def _service(
        self,
        connection: _Connection,
        events: int,
        selector: selectors.BaseSelector,
        connections: dict[int, _Connection],
    ) -> None:
        try:
            if events & selectors.EVENT_READ and not self._read(connection):
                self._drop(connection, selector, connections)
                return
            if connection.outgoing:
                sent = connection.sock.send(connection.outgoing, socket.MSG_NOSIGNAL)
                connection.outgoing = connection.outgoing[sent:]
                if connection.outgoing:
                    selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
                    return
            if connection.answered and not self._silent:
                self._drop(connection, selector, connections)
        except BlockingIOError:
            selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
        except OSError:
            self._drop(connection, selector, connections)

    def _read(self, connection: _Connection) -> bool:
        """Read what has come; C{False} when the connection should close now."""
        try:
            chunk = connection.sock.recv(wire.REQUEST_SIZE)
        except (BlockingIOError, InterruptedError):
            return True
        if connection.answered:
            return bool(chunk)  # a silent broker holds until the caller closes
        if not chunk:
            self.requests.append(connection.request)
            return False  # cut short: no reply, as from the real broker
        connection.request += chunk[: wire.REQUEST_SIZE - len(connection.request)]
        if len(connection.request) < wire.REQUEST_SIZE:
            return True
        self.requests.append(connection.request)
        connection.answered = True
        if self._silent:
            return True
        answer = self._answer(connection)
        if answer is None:
            return False
        connection.outgoing = answer
        return True

    def _answer(self, connection: _Connection) -> bytes | None:
        if self._reply is not None:
            return self._reply
        if not wire.is_valid_request(connection.request):
            return wire.INVALID_REQUEST_RESPONSE
        if self._fixed is not None:
            return self._fixed
        pid = peer_credentials(connection.sock).pid
        if pid <= 0:
            return None  # the caller is not visible here: no guessed PID
        return wire.encode_ok(pid)

    @staticmethod
    def _drop(
        connection: _Connection,
        selector: selectors.BaseSelector,
        connections: dict[int, _Connection],
    ) -> None:
        selector.unregister(connection.sock)
        del connections[connection.sock.fileno()]
        connection.sock.close()


def _private_directory() -> str:
    """
    A new 0700 directory owned by this process's UID, whose socket path
    fits C{sun_path}: the usual temporary directory, or C{/tmp} when
    C{TMPDIR} is too deep for a Unix socket path.
    """
    for parent in (None, "/tmp"):
        directory = tempfile.mkdtemp(prefix="hostpid-fake-broker-", dir=parent)
        path = os.path.join(directory, defaults.SOCKET_NAME)
        if len(os.fsencode(path)) <= _SUN_PATH_MAX:
            return directory
        os.rmdir(directory)
    raise OSError(f"{path}: longer than the {_SUN_PATH_MAX} bytes a Unix socket path may have")
