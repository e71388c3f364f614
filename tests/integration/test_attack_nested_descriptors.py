"""
A lingering socket nested inside a passed Unix socket.

The earlier fix met a lingering TCP socket passed directly: it is
an Internet socket, so the broker resets its linger and closes it at once.
Nested one level down it is out of reach: a real UID 1000 attacker makes a
Unix socket pair, sends the lingering TCP socket into one end's receive
queue, and passes I{that} end to the broker.  Whoever closes the last
reference to the outer socket purges its queue and drops the TCP socket's
last reference, so the kernel's C{tcp_close} waits out the linger in the
closing thread (C{sk_stream_wait_close}).  Before the fix, four such sockets
held both background closer threads for the linger time and filled the
closer's queue past the room a read wanted (253 free slots), so the broker
read no request again: 0 of 20 real clients answered, for as long as the
attacker lived.

The variants: C{nested} (Unix -> lingering TCP), C{double} (Unix -> Unix ->
lingering TCP) and C{garbage} (a Unix socket that carries itself and the
lingering TCP socket: once the broker closes its copy, only the garbage
collector can free it, and on kernels before 6.10 it runs in whichever
thread next closes any Unix socket).  Mode C{received} only: where the
kernel has C{SO_PASSRIGHTS} nothing can be passed (see
test_attack_passed_descriptors.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from attackers import NESTED_LINGERING_SOCKETS
from support import (
    attacker_process,
    each_answered,
    require_root,
    running_broker,
    scaled,
    wait_for,
)

from hostpid.broker.service import RECEIVE_DESCRIPTORS_ENV

pytestmark = pytest.mark.privileged

#: As long as a socket can linger: only an interrupted close ends sooner.
LINGER = 2**31 - 1
#: A real client's bound, generous for a shared machine.
CLIENT_BOUND = scaled(5.0)

#: argv: socket path, how many connections, linger seconds, nesting.  Each
#: connection passes one outer Unix socket with its request.  Prints the
#: sendmsg results as JSON, then waits for stdin to close.
ATTACKER = r"""
import array, errno, json, socket, struct, sys, time
path, count, linger, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
REQUEST = b"HPID\x00\x01\x00\x01"
""" + NESTED_LINGERING_SOCKETS + r"""
results = []
for _ in range(count):
    outer = nested(linger, how)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    try:
        conn.sendmsg([REQUEST], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                  array.array("i", [outer.fileno()]))])
        results.append("sent")
    except OSError as e:
        results.append(errno.errorcode[e.errno])
    outer.close()
    keep.append(conn)
print(json.dumps(results), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("how", ["nested", "double", "garbage"])
def test_nested_lingering_sockets_do_not_stop_reads(public_tmp: Path, how: str) -> None:
    require_root()
    with running_broker(public_tmp / "broker", env={RECEIVE_DESCRIPTORS_ENV: "1"}) as broker:
        with attacker_process(ATTACKER, str(broker.socket_path), "4", str(LINGER), how) as (
            _, results
        ):
            assert results == ["sent"] * 4
            wait_for(lambda: "descriptors transactions so far: 4" in broker.output(),
                     "the four passed sockets counted as outcome descriptors")
            try:
                # Then clients keep coming, as a node's workloads do, each
                # bounded; before the fix none was answered from here on.
                each_answered(broker.socket_path, 20, CLIENT_BOUND)
                # The outer sockets went to the disposer, which closed them
                # while the attacker (the lingering sockets' peers) still
                # lives: disarmed or interrupted, never left to linger.
                wait_for(lambda: "passed descriptors closed by the disposer" in broker.output(),
                         "the broker to say the disposer closed them")
            except AssertionError as failure:
                # What the broker said of its disposers names the step that failed.
                raise AssertionError(
                    f"{failure}\nthe broker's log:\n{broker.output()[-6000:]}"
                ) from None
