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

A test of code that retries, or that must survive a broker restart, gives a
script instead: one step per connection, in order, in the manner of treq's
C{RequestSequence} (treq, C{src/treq/testing.py}: a list of expected
requests and canned responses, consumed in order; here the steps are what a
broker does with a connection, since every request is the same)::

    with FakeBroker(script=[Delay(0.3), Close(), Reply(pid=4242)]) as broker:
        ...
        broker.restart()    # a new socket at the same path, the old one gone
"""

from __future__ import annotations

import math
import os
import selectors
import socket
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, TypeAlias

import attrs
from twisted.logger import Logger

from hostpid import defaults, wire
from hostpid.client.trust import PEER_PID, READ_ONLY_MOUNT, TrustPolicy
from hostpid.gate import ENABLED_VALUE, GATE_ENV
from hostpid.peercred import peer_credentials

__all__ = ["Close", "Delay", "FakeBroker", "Raw", "Reply", "Silent"]

#: The longest C{sun_path} Linux accepts, terminating NUL excluded.
_SUN_PATH_MAX = 107

#: How long L{FakeBroker.stop} waits for its thread; it only ever waits in
#: C{select}, which the wake-up pipe ends at once.
_STOP_SECONDS = 10.0

_log = Logger()


# --- The steps of a script: what the double does with one connection. ---


def _valid_pid(instance: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None:
        wire.encode_ok(value)  # ValueError outside 1..2**31-1


@attrs.frozen
class Reply:
    """
    Read the request and answer as the real broker does: the caller's own
    PID (from C{SO_PEERCRED}) when C{pid} is C{None}, else C{pid}; an invalid
    request gets status 1 and PID 0, a request cut short gets nothing.

    @raise ValueError: a C{pid} outside 1..2^31-1.
    """

    pid: int | None = attrs.field(default=None, validator=_valid_pid)


@attrs.frozen
class Raw:
    """
    Read the eight request bytes, send exactly C{data} instead of a reply,
    then close: a malformed, cut-short or refusing broker.

    @raise TypeError: C{data} is not bytes.
    """

    data: bytes = attrs.field(validator=attrs.validators.instance_of(bytes))


@attrs.frozen
class Silent:
    """Read the request and never answer, until the caller gives up or the double stops."""


@attrs.frozen
class Close:
    """
    Close the connection as soon as it is accepted, before reading anything
    and with no reply, as the real broker closes a connection over its
    limits (C{evicted}, C{over_limit}).
    """


def _seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"seconds must be a number, not {type(value).__name__}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"seconds must be a finite number of seconds, at least 0: {value!r}")


def _step(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, _STEPS):
        raise TypeError(f"then must be a step (Reply, Raw, Silent, Close, Delay), not {value!r}")


@attrs.frozen
class Delay:
    """
    Read the request, wait C{seconds}, then do C{then} (default: L{Reply}):
    a slow broker.  The caller's deadline runs meanwhile; a caller that
    gives up first is closed on.

    @raise ValueError: C{seconds} is negative, infinite or NaN.
    @raise TypeError: C{then} is not a step.
    """

    seconds: float = attrs.field(validator=_seconds)
    then: Step = attrs.field(default=Reply(), validator=_step)


#: Any step of a script.
Step: TypeAlias = "Reply | Raw | Silent | Close | Delay"
_STEPS = (Reply, Raw, Silent, Close, Delay)


@attrs.define
class _Connection:
    """One accepted connection: its step, what it sent, and what is left to send it."""

    sock: socket.socket
    step: Reply | Raw | Silent | Close | Delay
    request: bytes = b""
    outgoing: bytes = b""
    #: The request has been read whole (or the connection has been read to its end).
    read: bool = False
    #: Something has been queued to send; once sent, the connection closes.
    answering: bool = False
    #: When a L{Delay} ends (C{time.monotonic}), and what comes then.
    due: float | None = None
    then: Reply | Raw | Silent | Close | Delay | None = None
    #: Whether the selector still watches it (not after the caller's end of
    #: file during a L{Delay}: the delay still runs, as for a half-closed caller).
    watched: bool = True


class FakeBroker:
    """
    A broker double on a real Unix socket.  Give at most one of C{pid},
    C{reply}, C{silent} and C{script}:

      - nothing: each caller is answered with its own PID, from
        C{SO_PEERCRED}, as the real broker answers it (every connection
        gets L{Reply}C{()});
      - C{pid}: every valid request is answered with that PID
        (L{Reply}C{(pid)});
      - C{reply}: every connection that sends its eight request bytes gets
        exactly these bytes instead of a reply, then the connection closes
        (L{Raw}C{(reply)});
      - C{silent=True}: requests are read and never answered, until the
        caller gives up (its deadline) or L{stop} closes the connection
        (L{Silent}C{()});
      - C{script}: one step per accepted connection, in order (L{Reply},
        L{Raw}, L{Silent}, L{Close}, L{Delay}); a connection accepted once
        the script is used up is closed at once with no reply and counted
        in L{unscripted}, so that a test sees a connection it did not
        expect.  L{restart} does not rewind the script.

    C{deadline} is the client deadline, in seconds, of L{policy} (default
    the production one, 0.5 s): a test of a silent or slow broker sets it
    short, or long enough for a L{Delay}.

    @ivar requests: the bytes each connection sent (up to eight), in the
        order they were read; a test can check what its code sent.
    @ivar connections: how many connections were accepted.
    @ivar unscripted: how many connections came after the script was used up.
    @ivar restarts: how many times L{restart} made a new socket.
    """

    def __init__(
        self,
        pid: int | None = None,
        reply: bytes | None = None,
        silent: bool = False,
        script: Iterable[Reply | Raw | Silent | Close | Delay] | None = None,
        deadline: float = defaults.DEADLINE,
    ) -> None:
        given = [
            name
            for name, value in (("pid", pid), ("reply", reply), ("script", script))
            if value is not None
        ]
        if silent:
            given.append("silent")
        if len(given) > 1:
            raise ValueError(
                f"give at most one of pid, reply, silent and script, not {', '.join(given)}"
            )
        if reply is not None and not isinstance(reply, bytes):
            raise TypeError(f"reply must be bytes, not {type(reply).__name__}")
        self._script: deque[Reply | Raw | Silent | Close | Delay] | None = None
        self._script_lock = threading.Lock()
        self._always: Reply | Raw | Silent | Close | Delay = Reply()
        if script is not None:
            steps = list(script)
            for step in steps:
                if not isinstance(step, _STEPS):
                    raise TypeError(
                        f"a script step must be Reply, Raw, Silent, Close or Delay, not {step!r}"
                    )
            self._script = deque(steps)
        elif pid is not None:
            self._always = Reply(pid)
        elif reply is not None:
            self._always = Raw(reply)
        elif silent:
            self._always = Silent()
        # The policy's own validation: a positive finite number of seconds.
        TrustPolicy(deadline=deadline)
        self._deadline = deadline
        self.requests: list[bytes] = []
        self.connections = 0
        self.unscripted = 0
        self.restarts = 0
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
        socket, and listens on it), and the C{deadline} given to the
        constructor.  Never copy this policy to a workload.

        @raise RuntimeError: the broker is not running.
        """
        if self._policy is None or self._state != "running":
            raise RuntimeError(f"FakeBroker is {self._state}: start() it first")
        return self._policy

    @property
    def environ(self) -> Mapping[str, str]:
        """An environment with the gate on, for the clients' C{environ} argument."""
        return {GATE_ENV: ENABLED_VALUE}

    @property
    def remaining(self) -> tuple[Reply | Raw | Silent | Close | Delay, ...]:
        """The steps of the script not yet used (empty without a script)."""
        with self._script_lock:
            return tuple(self._script or ())

    def start(self) -> FakeBroker:
        """
        Make the directory and the socket and start serving.

        @raise RuntimeError: already started, or stopped (a FakeBroker runs once).
        @raise OSError: the directory or the socket could not be made.
        """
        if self._state != "new":
            raise RuntimeError(f"FakeBroker is {self._state}: a FakeBroker starts once")
        try:
            self._directory = _private_directory()
            path = os.path.join(self._directory, defaults.SOCKET_NAME)
            self._policy = TrustPolicy(
                socket_path=path, trusted_uid=os.geteuid(), deadline=self._deadline
            ).without(READ_ONLY_MOUNT, PEER_PID)
            self._listen()
        except BaseException:
            self._close()
            self._state = "stopped"
            raise
        self._state = "running"
        return self

    def restart(self) -> FakeBroker:
        """
        Stop serving and serve again at the same path, as a restarted broker
        does: every open connection is closed with no reply, the socket is
        removed, and a new socket (another inode) is bound at the same path.
        Clients that connect during the restart find no socket.  The script
        goes on where it was; L{policy} stays valid.

        @raise RuntimeError: the broker is not running.
        @raise OSError: the new socket could not be made (the broker is then stopped).
        """
        if self._state != "running":
            raise RuntimeError(f"FakeBroker is {self._state}: only a running FakeBroker restarts")
        self._halt()
        try:
            self._listen()
        except BaseException:
            self.stop()
            raise
        self.restarts += 1
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

    def _listen(self) -> None:
        """Bind and listen at the socket path, and start the serving thread."""
        assert self._directory is not None
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
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._serve, name=f"hostpid FakeBroker {path}", daemon=True
        )
        self._thread.start()

    def _halt(self) -> None:
        """End the thread, close the listener and every connection, remove our socket."""
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
        if self._directory is not None:
            self._remove_socket(self._directory)

    def _close(self) -> None:
        self._halt()
        directory, self._directory = self._directory, None
        if directory is not None:
            try:
                os.rmdir(directory)
            except OSError as error:
                # Something else was put there: it is not ours to delete.
                _log.warn("FakeBroker: {path}: left in place: {error}",
                          path=directory, error=error)

    def _remove_socket(self, directory: str) -> None:
        """Remove the socket if it is still the one we bound (by device and inode)."""
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

    # --- Serving, on the broker's own thread. ---

    def _next_step(self) -> Reply | Raw | Silent | Close | Delay | None:
        """The step for a newly accepted connection; C{None} once the script is used up."""
        if self._script is None:
            return self._always
        with self._script_lock:
            return self._script.popleft() if self._script else None

    def _serve(self) -> None:
        listener, wake = self._listener, self._wake
        assert listener is not None and wake is not None
        connections: dict[int, _Connection] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(wake[0], selectors.EVENT_READ)
            try:
                while not self._stopping.is_set():
                    dues = [c.due for c in connections.values() if c.due is not None]
                    timeout = max(0.0, min(dues) - time.monotonic()) if dues else None
                    for key, events in selector.select(timeout):
                        if key.fileobj is listener:
                            self._accept(listener, selector, connections)
                        elif isinstance(key.data, _Connection):
                            self._service(key.data, events, selector, connections)
                    now = time.monotonic()
                    for connection in list(connections.values()):
                        if connection.due is not None and connection.due <= now:
                            then, connection.due, connection.then = connection.then, None, None
                            assert then is not None
                            self._act(connection, then, selector, connections)
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
            self.connections += 1
            step = self._next_step()
            if step is None or isinstance(step, Close):
                if step is None:
                    self.unscripted += 1
                sock.close()
                continue
            sock.setblocking(False)
            connection = _Connection(sock, step)
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
                if connection.due is not None:
                    # End of file during a delay: a half-closed caller still
                    # waits for its answer; a gone one fails the send.
                    selector.unregister(connection.sock)
                    connection.watched = False
                    return
                self._drop(connection, selector, connections)
                return
            if connection.read and not connection.answering and connection.due is None:
                step, connection.step = connection.step, Silent()
                self._act(connection, step, selector, connections)
                return
            self._send(connection, selector, connections)
        except OSError:
            self._drop(connection, selector, connections)

    def _act(
        self,
        connection: _Connection,
        step: Reply | Raw | Silent | Close | Delay,
        selector: selectors.BaseSelector,
        connections: dict[int, _Connection],
    ) -> None:
        """Do C{step} with a connection whose request has been read."""
        if isinstance(step, Delay):
            connection.due = time.monotonic() + step.seconds
            connection.then = step.then
            return
        if isinstance(step, Close):
            self._drop(connection, selector, connections)
            return
        if isinstance(step, Silent):
            return  # held until the caller closes or the double stops
        answer = step.data if isinstance(step, Raw) else self._answer(connection, step)
        if answer is None:
            self._drop(connection, selector, connections)
            return
        connection.outgoing = answer
        connection.answering = True
        try:
            self._send(connection, selector, connections)
        except OSError:
            self._drop(connection, selector, connections)

    def _send(
        self,
        connection: _Connection,
        selector: selectors.BaseSelector,
        connections: dict[int, _Connection],
    ) -> None:
        if not connection.answering:
            return
        try:
            if connection.outgoing:
                sent = connection.sock.send(connection.outgoing, socket.MSG_NOSIGNAL)
                connection.outgoing = connection.outgoing[sent:]
        except BlockingIOError:
            pass
        if connection.outgoing:
            if connection.watched:
                selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
            else:
                selector.register(connection.sock, selectors.EVENT_WRITE, connection)
                connection.watched = True
        else:
            self._drop(connection, selector, connections)

    def _read(self, connection: _Connection) -> bool:
        """Read what has come; C{False} when the connection should close now."""
        if connection.answering:
            return True
        try:
            chunk = connection.sock.recv(wire.REQUEST_SIZE)
        except (BlockingIOError, InterruptedError):
            return True
        if connection.read:
            return bool(chunk)  # a held connection stays until the caller closes
        if not chunk:
            self.requests.append(connection.request)
            return False  # cut short: no reply, as from the real broker
        connection.request += chunk[: wire.REQUEST_SIZE - len(connection.request)]
        if len(connection.request) < wire.REQUEST_SIZE:
            return True
        self.requests.append(connection.request)
        connection.read = True
        return True

    @staticmethod
    def _answer(connection: _Connection, step: Reply) -> bytes | None:
        if not wire.is_valid_request(connection.request):
            return wire.INVALID_REQUEST_RESPONSE
        if step.pid is not None:
            return wire.encode_ok(step.pid)
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
        if connections.pop(connection.sock.fileno(), None) is None:
            return
        if connection.watched:
            selector.unregister(connection.sock)
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
