"""
L{hostpid.broker.descriptors} on real sockets: what the I{received} mode does
with each descriptor a client passes, and how it closes a connection.
"""

from __future__ import annotations

import array
import os
import socket
import struct
from collections.abc import Iterator

import pytest
from kernelfeatures import has, kernel_feature
from support import wait_for

from hostpid import wire
from hostpid.broker.descriptors import (
    ROOM_MARGIN,
    SCM_MAX_FD,
    SO_PASSRIGHTS,
    BackgroundCloser,
    PassedDescriptors,
    refuse_descriptor_passing,
    unix_out_of_band_supported,
)

#: Every test twice: the fast path's calls made by the C helper, then in Python.
pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("reads")]


def rights(*fds: int) -> list[tuple[int, int, array.array]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def tcp() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected loopback TCP socket (and its listener)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    yield listener, client
    client.close()
    listener.close()


def test_an_internet_socket_is_reset_on_close_not_lingered(pair, tcp) -> None:
    server, client = pair
    _, passed = tcp
    observer = passed.dup()  # our own reference, to look at the option afterwards
    before = fd_count()
    client.sendmsg([wire.GET_HOST_PID_REQUEST], rights(passed.fileno()))
    receiver = PassedDescriptors(BackgroundCloser())
    data, carried = receiver.receive(server, 256)
    assert (data, carried) == (wire.GET_HOST_PID_REQUEST, True)
    assert struct.unpack("ii", observer.getsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, 8)) == (1, 0)
    assert fd_count() == before, "closed in place, not handed to the closer"
    assert receiver.closer.pending == 0 and receiver.received == 1
    observer.close()


def test_any_other_descriptor_is_closed_by_the_background_closer(pair) -> None:
    server, client = pair
    read, write = os.pipe()
    client.sendmsg([b"x"], rights(read))
    os.close(read)
    receiver = PassedDescriptors(BackgroundCloser())
    assert receiver.receive(server, 256) == (b"x", True)
    wait_for(lambda: receiver.closer.closed == 1, "the closer to close the pipe")
    with pytest.raises(BrokenPipeError):
        os.write(write, b"x")  # the broker's copy, the last reader, is gone
    os.close(write)


def test_release_drains_what_came_after_the_request_and_stops_the_sender(pair) -> None:
    server, client = pair
    read, write = os.pipe()
    client.sendall(wire.GET_HOST_PID_REQUEST)
    client.sendmsg([b"y"], rights(read))
    os.close(read)
    receiver = PassedDescriptors(BackgroundCloser())
    assert receiver.receive(server, 8) == (wire.GET_HOST_PID_REQUEST, False)
    assert receiver.release(server) is True, "the message behind the request was found"
    with pytest.raises(OSError):
        client.sendmsg([b"z"], rights(write))
    wait_for(lambda: receiver.closer.closed == 1, "the pipe closed off this thread")
    os.close(write)


def test_release_of_a_clean_connection_finds_nothing(pair) -> None:
    server, client = pair
    client.sendall(wire.GET_HOST_PID_REQUEST)
    receiver = PassedDescriptors(BackgroundCloser())
    assert receiver.receive(server, 8) == (wire.GET_HOST_PID_REQUEST, False)
    assert receiver.release(server) is False
    assert receiver.closer.pending == 0


def test_release_sends_the_reply_before_it_closes(pair) -> None:
    """The fast path's reply goes out in the release (one C call): before the close."""
    server, client = pair
    client.sendall(wire.GET_HOST_PID_REQUEST)
    receiver = PassedDescriptors(BackgroundCloser())
    assert receiver.receive(server, 8) == (wire.GET_HOST_PID_REQUEST, False)
    reply = wire.encode_ok(os.getpid())
    assert receiver.release(server, reply) is False
    assert server.fileno() == -1, "closed"
    client.settimeout(5)
    assert client.recv(64) == reply
    assert client.recv(64) == b"", "then end of file"


def test_release_closes_a_connection_whose_reply_cannot_be_sent(pair) -> None:
    """A client that went away gets no reply, and the close goes on as without one."""
    server, client = pair
    client.sendall(wire.GET_HOST_PID_REQUEST)
    receiver = PassedDescriptors(BackgroundCloser())
    assert receiver.receive(server, 8) == (wire.GET_HOST_PID_REQUEST, False)
    client.close()
    assert receiver.release(server, wire.encode_ok(os.getpid())) is False
    assert server.fileno() == -1 and receiver.closer.pending == 0


@kernel_feature("UNIX_OOB")
def test_out_of_band_descriptors_are_received_once_inline(pair) -> None:
    """Without SO_OOBINLINE the second read would silently discard the descriptor."""
    server, client = pair
    read, write = os.pipe()
    client.sendmsg([b"!"], rights(read), socket.MSG_OOB)
    client.sendall(wire.GET_HOST_PID_REQUEST)
    os.close(read)
    receiver = PassedDescriptors(BackgroundCloser())
    receiver.prepare(server)
    assert receiver.receive(server, 256) == (b"!", True)
    os.close(write)


@kernel_feature("UNIX_OOB")
def test_this_kernel_has_unix_out_of_band_data(pair) -> None:
    """
    The probe agrees with what a real out-of-band message does here: it is
    queued, and marked (the kernels this suite runs on are 5.15+ with
    C{CONFIG_AF_UNIX_OOB}, Debian's default).  The attack tests in
    C{test_attack_passed_descriptors.py} then prove the inline read needed.
    """
    server, client = pair
    client.send(b"!", socket.MSG_OOB)
    assert server.recv(1, socket.MSG_OOB) == b"!"
    assert unix_out_of_band_supported() is True
    assert PassedDescriptors(BackgroundCloser()).outOfBand is True


@pytest.mark.parametrize("outOfBand", [True, False])
def test_inline_out_of_band_only_where_the_kernel_has_it(pair, outOfBand: bool) -> None:
    """Without Unix out-of-band data each connection is spared the setsockopt."""
    server, client = pair
    receiver = PassedDescriptors(BackgroundCloser(), outOfBand=outOfBand)
    client.sendall(wire.GET_HOST_PID_REQUEST)
    assert receiver.readFirst(server, 256, 0) == wire.GET_HOST_PID_REQUEST
    assert server.getsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE) == int(outOfBand)
    other, _peer = socket.socketpair()
    with other, _peer:
        receiver.prepare(other)
        assert other.getsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE) == int(outOfBand)


@kernel_feature("SO_PASSRIGHTS")
def test_this_kernel_refuses_descriptors_when_asked() -> None:
    """Linux 6.16+ (this machine runs 6.18): SO_PASSRIGHTS can be set and reads back 0."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        assert refuse_descriptor_passing(sock) is True
        assert sock.getsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS) == 0


def test_release_after_the_peer_reset_still_closes_in_place(pair) -> None:
    """A client that closes without reading the reply must not cost a closer thread."""
    server, client = pair
    client.sendall(wire.GET_HOST_PID_REQUEST)
    receiver = PassedDescriptors(BackgroundCloser())
    assert receiver.receive(server, 8) == (wire.GET_HOST_PID_REQUEST, False)
    server.send(wire.encode_ok(os.getpid()))
    client.close()  # our reply unread: the server's side sees ECONNRESET once
    assert receiver.release(server) is False
    assert receiver.closer.pending == 0 and receiver.closer.closed == 0


def test_room_counts_the_table_the_connections_and_the_closer() -> None:
    """A full message must fit both the descriptor table and the closer's queue."""
    connections = [0]
    closer = BackgroundCloser(limit=SCM_MAX_FD + 10)
    receiver = PassedDescriptors(
        closer, connections=lambda: connections[0],
        descriptorLimit=1000, reserved=100,
    )
    assert receiver.hasRoom()
    connections[0] = 1000 - 100 - SCM_MAX_FD - ROOM_MARGIN
    assert receiver.hasRoom()
    connections[0] += 1
    assert not receiver.hasRoom(), "one connection more and a message could overflow"
    connections[0] = 0
    closer.pending = 11  # as if 11 descriptors were still closing
    assert not receiver.hasRoom(), "the closer could not take a full message"
    closer.pending = 0


def test_release_without_room_hands_the_connection_over_undrained(pair) -> None:
    """No drain read when the table lacks room: the queue goes to the closer whole."""
    server, client = pair
    passed = os.open("/dev/null", os.O_RDONLY)
    client.sendmsg([b"!"], rights(*[passed] * SCM_MAX_FD))
    os.close(passed)
    closer = BackgroundCloser()
    receiver = PassedDescriptors(closer, descriptorLimit=SCM_MAX_FD + ROOM_MARGIN - 1, reserved=0)
    before = fd_count()
    assert not receiver.hasRoom()
    assert receiver.release(server) is False, "nothing was read"
    assert receiver.received == 0
    wait_for(lambda: closer.closed == 1, "the closer to close the whole connection")
    # The connection is gone; the disposer's two sockets, opened on first use, came.
    assert closer.disposerPid is not None
    assert fd_count() == before - 1 + 2
    closer.stop()
    assert fd_count() == before - 1


def test_without_room_a_read_takes_only_bytes_without_descriptors(pair) -> None:
    """
    Without room for a full message, reads go on: a peek shows what is
    queued, and bytes are read only if the peek met no descriptor.  A peek
    that reaches a message with descriptors reads nothing at all: it is left
    queued, nothing installed in our table, its descriptor still open (here
    a pipe's last write end: no end of file).  (A peek that ends exactly
    where such a message begins reports it too: the kernel attaches its
    descriptors before it sees there is no room for its bytes.)
    """
    server, client = pair
    read, write = os.pipe()
    os.set_blocking(read, False)
    receiver = PassedDescriptors(BackgroundCloser(), descriptorLimit=64, reserved=0)
    assert not receiver.hasRoom()
    client.sendall(wire.GET_HOST_PID_REQUEST[:5])
    assert receiver.receiveWithoutRoom(server, 256) == (wire.GET_HOST_PID_REQUEST[:5], False)
    client.sendall(b"xy")
    client.sendmsg([wire.GET_HOST_PID_REQUEST[5:]], rights(write))
    os.close(write)
    before = fd_count()
    assert receiver.receiveWithoutRoom(server, 256) == (b"", True), "descriptors waiting"
    assert receiver.receiveWithoutRoom(server, 256) == (b"", True), "still waiting, unread"
    assert fd_count() == before and receiver.received == 0
    with pytest.raises(BlockingIOError):
        os.read(read, 1)  # the write end is still open, in the queue
    assert receiver.release(server) is False, "not drained: no room"
    wait_for(lambda: receiver.closer.closed == 1, "the closer to close the connection whole")
    assert os.read(read, 1) == b"", "the queued write end went with it"
    os.close(read)
    assert receiver.withoutRoom == 3


def test_without_room_the_fast_path_read_answers_a_plain_request(pair) -> None:
    """The fast path's read without room: a plain request is read; end of file is b''."""
    server, client = pair
    receiver = PassedDescriptors(BackgroundCloser(), descriptorLimit=64, reserved=0)
    client.sendall(wire.GET_HOST_PID_REQUEST)
    assert receiver.readFirst(server, 256, 0) == wire.GET_HOST_PID_REQUEST
    client.shutdown(socket.SHUT_WR)
    assert receiver.readFirst(server, 256, 0) == b""
    assert receiver.withoutRoom == 2


def test_a_peek_never_drops_a_queued_descriptor(pair) -> None:
    """
    L{PassedDescriptors.release} asks "is the queue empty?" with a peek
    without room for ancillary data.  The kernel lends a peek references of
    its own and takes those back: the queued message keeps its own, so the
    passed descriptor stays open (here: a pipe's write end, the last one, so
    the read end sees no end of file) until the drain receives it.
    """
    server, client = pair
    read, write = os.pipe()
    os.set_blocking(read, False)
    client.sendall(wire.GET_HOST_PID_REQUEST)
    client.sendmsg([b"y"], rights(write))
    os.close(write)  # the queued message holds the last reference now
    receiver = PassedDescriptors(BackgroundCloser())
    assert receiver.receive(server, 8) == (wire.GET_HOST_PID_REQUEST, False)
    server.shutdown(socket.SHUT_RD)
    assert server.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"y"
    with pytest.raises(BlockingIOError):
        os.read(read, 1)  # no end of file: the write end is still open
    assert receiver.release(server) is True, "the drain received it"
    wait_for(lambda: receiver.closer.closed == 1, "the pipe closed off this thread")
    assert os.read(read, 1) == b"", "now the last write end is closed"
    os.close(read)


def test_read_first_reads_inline_and_refuses_descriptors(pair) -> None:
    """
    The fast path's read: out-of-band inline where the kernel has Unix
    out-of-band data (not 5.10), C{None} for a message with descriptors.
    """
    server, client = pair
    receiver = PassedDescriptors(BackgroundCloser())
    client.sendall(wire.GET_HOST_PID_REQUEST)
    assert receiver.readFirst(server, 256, 0) == wire.GET_HOST_PID_REQUEST
    inline = server.getsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE)
    assert inline == int(has("UNIX_OOB"))
    read, write = os.pipe()
    client.sendmsg([b"x"], rights(read))
    os.close(read)
    assert receiver.readFirst(server, 256, 0) is None
    assert receiver.received == 1
    with pytest.raises(BlockingIOError):
        receiver.readFirst(server, 256, 0)
    wait_for(lambda: receiver.closer.closed == 1, "the closer to close the pipe")
    os.close(write)


def test_the_c_helper_is_used_wherever_it_is_built(reads: str) -> None:
    """
    By default the fast path's calls go through the C helper if it is built
    (the C{c} run: it is, or that run failed in the fixture); asking for it
    where it is not is an error, not a silent fallback.
    """
    from hostpid.broker import descriptors

    assert PassedDescriptors(BackgroundCloser()).native is (reads == "c")
    assert PassedDescriptors(BackgroundCloser(), native=False).native is False
    if reads == "python":
        with pytest.raises(RuntimeError, match="_hostpid_native is not built"):
            PassedDescriptors(BackgroundCloser(), native=True)
    else:
        native = descriptors._native
        with pytest.raises(ValueError, match="size out of range"):
            native.read(0, native.READ_MAX + 1, False, True)
        with pytest.raises(ValueError, match="not a descriptor"):
            native.release(-1, None)
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with pytest.raises(OSError):  # not a socket: the system call's own error
                native.read(fd, 8, True, True)
        finally:
            os.close(fd)
