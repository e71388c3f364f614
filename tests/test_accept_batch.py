"""
The C helper's accept turn (C{accept_batch}) and its batch close
(C{close_all}), on a real listening Unix socket: each connection accepted in
backlog order and read once as the fast path reads it, in both descriptor
modes, with the peer's PID for one that has sent nothing yet.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

native = pytest.importorskip("_hostpid_native", reason="the C helper is not built")

REQUEST = b"HPID\x00\x01\x00\x01"


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "s.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    sock.bind(path)
    sock.listen(16)
    yield sock, path
    sock.close()


def connect(path: str, payload: bytes = b"") -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    if payload:
        client.sendall(payload)
    return client


@pytest.mark.parametrize("received", [False, True])
def test_batch_reads_each_connection_once_in_order(
    listener: tuple[socket.socket, str], received: bool
) -> None:
    sock, path = listener
    whole = connect(path, REQUEST + b"trailing")
    silent = connect(path)
    part = connect(path, REQUEST[:3])
    gone = connect(path)
    gone.close()
    with_fd = connect(path)
    if received:
        socket.send_fds(with_fd, [b"x"], [with_fd.fileno()])
    items, ended = native.accept_batch(sock.fileno(), 16, 256, received, received)
    try:
        assert ended == errno.EAGAIN, "the queue ran dry before the count"
        assert [data for _fd, data, _peer in items][:4] == [
            REQUEST + b"trailing", None, REQUEST[:3], b""]
        assert [peer for _fd, _data, peer in items][:4] == [-1, os.getpid(), -1, -1]
        if received:
            assert items[4][1] == (), "descriptors waiting: nothing read, nothing installed"
        else:
            assert items[4][1] is None
        fds = [fd for fd, _data, _peer in items]
        assert all(os.get_inheritable(fd) is False for fd in fds)
    finally:
        native.close_all([fd for fd, _data, _peer in items])
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    for client in (whole, silent, part, with_fd):
        client.close()


def test_batch_stops_at_the_count(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    clients = [connect(path, REQUEST) for _ in range(3)]
    items, ended = native.accept_batch(sock.fileno(), 2, 256, False, False)
    assert len(items) == 2 and ended == 0
    rest, ended = native.accept_batch(sock.fileno(), 2, 256, False, False)
    assert len(rest) == 1 and ended == errno.EAGAIN
    native.close_all([fd for fd, _data, _peer in items + rest])
    for client in clients:
        client.close()


def test_close_all_checks_every_item_first() -> None:
    left, right = socket.socketpair()
    with pytest.raises(TypeError):
        native.close_all([left.fileno(), "x"])
    os.fstat(left.fileno())  # still open: nothing was closed
    left.close()
    right.close()


def test_reply_close_sends_then_closes() -> None:
    left, right = socket.socketpair()
    fd = left.detach()
    native.reply_close(fd, b"HPID\x00\x01\x00\x00\x00\x00\x00\x07")
    assert right.recv(64) == b"HPID\x00\x01\x00\x00\x00\x00\x00\x07"
    assert right.recv(64) == b"", "closed after the reply"
    with pytest.raises(OSError):
        os.fstat(fd)
    left2, right2 = socket.socketpair()
    right.close()
    right2.close()
    native.reply_close(left2.detach(), b"x")  # the peer is gone: the failure is ignored
