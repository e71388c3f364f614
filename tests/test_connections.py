"""
What a fast-path connection is (L{hostpid.broker.connections}): a bare
descriptor with the C helper's calls, a socket object with the socket
module's.  Each test runs both ways (the C{reads} fixture) on real sockets
and a real listener, and the two must behave alike: the same bytes, the
same errors, the same end of the connection.
"""

from __future__ import annotations

import _socket
import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from hostpid import wire
from hostpid.broker import connections
from hostpid.broker.connections import ConnectionCalls, default_calls, descriptor_calls
from hostpid.broker.fsrules import open_broker_directory
from hostpid.broker.port import BrokerPort
from hostpid.broker.server import BrokerFactory, Outcome
from hostpid.peercred import PeerIdentifier

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("reads")]

_DONTWAIT = int(socket.MSG_DONTWAIT)
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


@pytest.fixture
def calls(reads: str) -> ConnectionCalls:
    made = default_calls()
    assert made.native is (reads == "c"), "the C helper is the default wherever it is built"
    return made


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[socket.socket]:
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(tmp_path / "l.sock"))
    listening.listen(8)
    listening.setblocking(False)
    yield listening
    listening.close()


def connect(listener: socket.socket) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(listener.getsockname())
    return client


def test_accept_recv_send_close(calls: ConnectionCalls, listener: socket.socket) -> None:
    accept = calls.acceptorFor(listener)
    with pytest.raises(BlockingIOError):
        accept()
    client = connect(listener)
    conn = accept()
    try:
        if calls.native:
            assert type(conn) is int
            assert fcntl.fcntl(conn, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "close-on-exec"
        else:
            assert type(conn) is _socket.socket
        with pytest.raises(BlockingIOError):
            calls.recv(conn, 256, _DONTWAIT)
        client.sendall(wire.GET_HOST_PID_REQUEST + b"extra")
        assert calls.recv(conn, 256, _DONTWAIT) == wire.GET_HOST_PID_REQUEST + b"extra"
        assert PeerIdentifier().host_pid(conn) == os.getpid(), "the kernel's word, either way"
        assert calls.send(conn, b"reply", _SEND_FLAGS) == 5
        assert client.recv(64) == b"reply"
        calls.close(conn)
        assert client.recv(64) == b"", "the connection ended"
    finally:
        client.close()


def test_errors_are_the_system_calls(calls: ConnectionCalls, listener: socket.socket) -> None:
    """End of file reads as no bytes; a peer gone fails the send with EPIPE, no signal."""
    client = connect(listener)
    conn = calls.acceptorFor(listener)()
    client.close()
    assert calls.recv(conn, 256, _DONTWAIT) == b""
    with pytest.raises(BrokenPipeError):
        calls.send(conn, b"reply", _SEND_FLAGS)
    calls.close(conn)


def test_a_connection_handed_on_is_a_socket_object_that_owns_it(
    calls: ConnectionCalls, listener: socket.socket
) -> None:
    client = connect(listener)
    conn = calls.acceptorFor(listener)()
    sock = calls.socketOf(conn)
    assert type(sock) is _socket.socket and sock.family == socket.AF_UNIX
    if calls.native:
        assert sock.fileno() == conn
    client.sendall(b"HP")
    assert sock.recv(8) == b"HP"
    sock.close()
    assert client.recv(8) == b""
    client.close()


def test_the_calls_that_end_a_connection_take_descriptors_only(reads: str, pair) -> None:
    """
    The helper's C{close} (and C{accept}) refuse a socket object: closing
    its descriptor behind its back would leave it holding a number the next
    C{accept} reuses.  Its reads take either, and a closed socket object
    gets EBADF, as from the socket module.  Where it is not built, asking
    for descriptors is an error, not a silent fallback.
    """
    if reads == "python":
        with pytest.raises(RuntimeError, match="_hostpid_native is not built"):
            descriptor_calls()
        return
    native = descriptor_calls()
    server, client = pair
    with pytest.raises(TypeError):
        native.close(server)
    with pytest.raises(TypeError):
        connections.helper.accept(server)
    assert server.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM, "open"
    client.sendall(b"x")
    assert native.recv(server, 8, _DONTWAIT) == b"x"
    server.close()
    with pytest.raises(OSError) as raised:
        native.recv(server, 8, _DONTWAIT)
    assert raised.value.errno == errno.EBADF


def test_recv_never_returns_more_than_its_buffer(calls: ConnectionCalls) -> None:
    """
    With C{MSG_TRUNC} the kernel returns a datagram's whole length (6,000)
    however small the buffer (4,096 bytes at most in the C helper): the
    helper used to return that many bytes, read past its buffer on the
    stack.  It refuses the flag; a plain read of the same datagram gives
    the buffer's worth, from either path.
    """
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with left, right:
        left.send(b"x" * 6000)
        if calls.native:
            with pytest.raises(ValueError, match="MSG_TRUNC"):
                calls.recv(right, 4096, _DONTWAIT | socket.MSG_TRUNC)
        assert calls.recv(right, 4096, _DONTWAIT) == b"x" * 4096


def test_a_real_port_answers_at_accept_and_hands_on_the_rest(
    reads: str, tmp_path: Path
) -> None:
    """
    The listening port, on a real listener, accepts connections of its
    factory's kind: one whose request is waiting is answered at accept, one
    with half a request goes to the waiting room as a socket object and is
    answered there.
    """
    directory = tmp_path / "broker"
    fd = open_broker_directory(str(directory), os.geteuid())
    clock = MemoryReactorClock()
    factory = BrokerFactory(clock, 0.5, 4)
    assert factory.calls.native is (reads == "c")
    fatal: list[Failure] = []
    port = BrokerPort(str(directory / "broker.sock"), fd, factory, clock, fatal.append)
    port.startListening()
    clients = []
    try:
        for request in (wire.GET_HOST_PID_REQUEST, wire.GET_HOST_PID_REQUEST[:3]):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(str(directory / "broker.sock"))
            client.sendall(request)
            clients.append(client)
        port.doRead()  # the first turn accepts one (the port's adaptive batch)
        port.doRead()
        assert clients[0].recv(64) == wire.encode_ok(os.getpid())
        assert factory.counts[Outcome.OK] == 1
        [waiting] = [reader for reader in clock.readers if reader is not port]
        assert type(waiting.socket) is _socket.socket
        clients[1].sendall(wire.GET_HOST_PID_REQUEST[3:])
        waiting.doRead()
        assert clients[1].recv(64) == wire.encode_ok(os.getpid())
        assert factory.counts[Outcome.OK] == 2 and factory.active == 0
        assert fatal == []
    finally:
        for client in clients:
            client.close()
        port.socket.close()  # type: ignore[union-attr]
        os.close(fd)
