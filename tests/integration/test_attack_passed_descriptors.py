"""
Descriptors passed to the broker with C{SCM_RIGHTS}.

Item 2: a workload passes a TCP socket with C{SO_LINGER {1, 30}} and a full
send queue (to its own loopback listener, which never reads), then closes
its copy.  Before the fix the broker held the last reference and the kernel's
C{tcp_close} waited 30 s in the broker's only thread (in the fast path's
C{recv()}, which discards passed descriptors, or when Twisted closed them):
no client was answered meanwhile.  Now, where the kernel has C{SO_PASSRIGHTS}
the attacker's C{sendmsg} fails with C{EPERM}; where it does not (forced here
with the broker's test switch) the broker receives the socket, sets
C{SO_LINGER {1, 0}} and closes it at once.  The attacker is a real UID 1000
process.

Item 3: every message carrying a descriptor made Twisted log a line ("does
not provide IFileDescriptorReceiver"); now it is an outcome, logged at
powers of two.
"""

from __future__ import annotations

import array
import errno
import os
import socket
import time
from pathlib import Path

import pytest
from attackers import LINGERING_SOCKET
from kernelfeatures import MODES, kernel_feature
from support import (
    ask_pid,
    attacker_process,
    connect,
    each_answered,
    require_root,
    running_broker,
    scaled,
    thread_states,
    wait_for,
)

from hostpid import wire
from hostpid.broker import descriptors
from hostpid.broker.service import RECEIVE_DESCRIPTORS_ENV

pytestmark = [pytest.mark.privileged, pytest.mark.kernel]

#: Scaled, as the client's bound is (support.TIME_SCALE): the bound stays a sixth of it.
LINGER = round(scaled(30))
#: A real client's bound: far below the linger time, generous for a shared machine.
CLIENT_BOUND = scaled(5.0)

#: argv: socket path, how many, linger seconds, how ("whole": the request and
#: the socket in one message; "split": half the request, then the other half
#: with the socket, so it arrives on the general path; "oob": the socket on an
#: out-of-band byte, then the request: without SO_OOBINLINE the broker's next
#: read would discard that byte, releasing the socket in the broker's thread).
#: Prints one JSON list of what each sendmsg gave, then waits for stdin to
#: close (its listeners keep the passed sockets lingering).
ATTACKER = r"""
import array, errno, fcntl, json, socket, struct, sys, termios, time
path, count, linger, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
REQUEST = b"HPID\x00\x01\x00\x01"
""" + LINGERING_SOCKET + r"""
def send(conn, data, sock, flags=0):
    try:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                               array.array("i", [sock.fileno()]))], flags)
        return "sent"
    except OSError as e:
        return errno.errorcode[e.errno]
results = []
for _ in range(count):
    sock = lingering(linger)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    if how == "whole":
        results.append(send(conn, REQUEST, sock))
    elif how == "split":
        conn.sendall(REQUEST[:4])
        # Wait (bounded) until the broker has read the first half, so the
        # descriptor arrives on the general path, not with it at accept.
        unread = array.array("i", [1])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, unread)
            if unread[0] == 0:
                break
            time.sleep(0.001)
        else:
            raise SystemExit("the broker never read the first half")
        results.append(send(conn, REQUEST[4:], sock))
    else:
        results.append(send(conn, b"!", sock, socket.MSG_OOB))
        try:
            conn.sendall(REQUEST)
        except OSError:
            pass
    if results[-1] != "sent":  # still ours alone: do not linger in our own close
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    keep.append(conn)
print(json.dumps(results), flush=True)
sys.stdin.read()
"""


def _broker_env(mode: str) -> dict[str, str]:
    return {RECEIVE_DESCRIPTORS_ENV: "1"} if mode == "received" else {}


@pytest.mark.parametrize(
    "how", ["whole", "split", pytest.param("oob", marks=kernel_feature("UNIX_OOB"))]
)
@pytest.mark.parametrize("mode", MODES)
def test_passed_lingering_socket_does_not_freeze_the_broker(
    public_tmp: Path, mode: str, how: str
) -> None:
    require_root()
    with running_broker(public_tmp / "broker", env=_broker_env(mode)) as broker:
        with attacker_process(ATTACKER, str(broker.socket_path), "3", str(LINGER), how) as (
            _, results
        ):
            each_answered(broker.socket_path, 20, CLIENT_BOUND)
        if mode == "refused":
            assert results == ["EPERM"] * 3, "the kernel refuses SCM_RIGHTS to the broker"
            assert "descriptor passing refused by the kernel" in broker.output()
        else:
            assert results == ["sent"] * 3
            wait_for(lambda: "descriptors transactions so far: 2" in broker.output(),
                     "the passed sockets counted as outcome descriptors")
            assert "descriptor passing: forced by" in broker.output()
            # The attack met the C helper's reads wherever it is built (the
            # unit tests of both paths are tests/test_descriptors.py's).
            built = descriptors._native is not None
            assert ("made by the C helper" in broker.output()) is built, broker.output()
        # Connections held as descriptors in both modes, wherever it is built.
        assert ("connections held as descriptors" in broker.output()) is (
            descriptors._native is not None
        ), broker.output()


@kernel_feature("SO_PASSRIGHTS")
def test_so_passrights_is_inherited_by_accepted_connections(public_tmp: Path) -> None:
    """The option is set on the listener only; an accepted connection refuses too."""
    with running_broker(public_tmp / "broker") as broker:
        with connect(broker.socket_path) as sock:
            # The broker has accepted us once a byte it reads leaves the queue:
            # send half a request, wait for it to be read, then try a descriptor.
            sock.sendall(wire.GET_HOST_PID_REQUEST[:4])
            wait_for(lambda: _unread(sock) == 0, "the broker to read the first bytes")
            with pytest.raises(PermissionError) as caught:
                sock.sendmsg([wire.GET_HOST_PID_REQUEST[4:]], [_rights(sock.fileno())])
            assert caught.value.errno == errno.EPERM
            sock.sendall(wire.GET_HOST_PID_REQUEST[4:])
            assert sock.recv(64) == wire.encode_ok(os.getpid())


def _unread(sock: socket.socket) -> int:
    """Bytes we sent that the peer has not read yet (SIOCOUTQ on a Unix socket)."""
    import fcntl
    import termios

    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
    return buf[0]


def _rights(fd: int) -> tuple[int, int, array.array]:
    return (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))


def _broker_log_lines(output: str) -> int:
    return len(output.splitlines())


@pytest.mark.parametrize("mode", MODES)
def test_descriptor_messages_do_not_flood_the_log(public_tmp: Path, mode: str) -> None:
    """
    1,000 connections x 7 one-byte messages, each with a descriptor: < 30 log
    lines.  All from this process, with no bound per peer
    (C{--max-waiting-per-peer} above the limit), so that they are read and
    counted as descriptors rather than closed at accept by the fairness
    rule between peers.
    """
    with running_broker(public_tmp / "broker", "--max-waiting-per-peer", "100000",
                        env=_broker_env(mode)) as broker:
        before = _broker_log_lines(broker.output())
        results: dict[str, int] = {}
        passed = os.open("/dev/null", os.O_RDONLY)
        try:
            for _ in range(1000):
                with connect(broker.socket_path) as sock:
                    for _ in range(7):
                        try:
                            sock.sendmsg([b"H"], [_rights(passed)])
                            outcome = "sent"
                        except OSError as e:
                            outcome = errno.errorcode[e.errno or 0]
                        results[outcome] = results.get(outcome, 0) + 1
        finally:
            os.close(passed)
        started = time.monotonic()
        answer = ask_pid(broker.socket_path)
        assert answer == os.getpid(), (
            f"not answered ({answer}) after {time.monotonic() - started:.1f} s, once the "
            f"connections {results} were closed; broker threads: {thread_states(broker.pid)}; "
            f"log:\n{broker.output()[-3000:]}"
        )
        added = _broker_log_lines(broker.output()) - before
        assert added < 30, f"{added} log lines:\n{broker.output()[-3000:]}"
        if mode == "refused":
            assert results == {"EPERM": 7000}
        else:
            assert results.get("sent", 0) >= 1000, results
            wait_for(lambda: "descriptors transactions so far: 512" in broker.output(),
                     "the connections counted as outcome descriptors")
        assert _broker_log_lines(broker.output()) - before < 30
