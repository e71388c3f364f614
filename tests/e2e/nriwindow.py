"""
The window between hostpid's look at the broker mountpoint and the runtime's
mount, opened on purpose: a second NRI plugin, at a later index than
hostpid's, so that the runtime calls it after hostpid has answered and before
it creates the container (NRI calls the plugins of a CreateContainer one after
the other, by index, and applies their adjustments only after the last).

At each CreateContainer it does what a HAMi node does meanwhile: HAMi's device
plugin, allocating for another pod, makes the lock parent 0777
(C{os.Chmod("/tmp/vgpulock", 0777)}, which drops the sticky bit), and a
tenant's loop (L{TENANT}) acts on the mountpoint.  It then waits until the
tenant has started and finished a round after that chmod (the tenant publishes
its round count in a file), bounded well under the runtime's 2 s request
timeout, and answers an empty adjustment.  Each window is logged as one JSON
line with the rounds seen before and after, so that a test counts the windows
the tenant really acted in: nothing depends on how long anything takes.

Usage: nriwindow.py SOCKET INDEX LOCK_PARENT ROUNDS_FILE
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time

#: The most a window waits for the tenant (the runtime drops a plugin that
#: takes 2 s).
WINDOW_BOUND = 1.0

#: What a UID 1000 process with the lock parent does, in a loop: move the
#: mountpoint away (renaming a mountpoint moves the broker mounts on it out of
#: every running container's C{/tmp/vgpulock/hostpid}) and remove it (which
#: detaches them), then put a symlink to C{/etc} (the runtime resolves it
#: inside the next container) or a file (the runtime fails the container) at
#: the name.  It publishes its round count (8 bytes) in ROUNDS_FILE and stops
#: when STOP exists; it prints what succeeded, as JSON.  A sleep of half a
#: millisecond per round keeps it from taking a core of a shared machine.
#: Usage: python -c TENANT LOCK_PARENT ROUNDS_FILE STOP
TENANT = r"""
import json, os, struct, sys, time
lock_parent, rounds_path, stop = sys.argv[1:4]
os.chdir(lock_parent)
out = os.open(rounds_path, os.O_WRONLY)
done = {"rounds": 0, "renamed_root_dir": 0, "removed_root_dir": 0, "symlink": 0, "file": 0}
while not os.path.exists(stop):
    moved = "moved-%d" % done["rounds"]
    try:
        st = os.lstat("hostpid")
        os.rename("hostpid", moved)
    except OSError:
        st = None
    else:
        if os.path.isdir(moved) and not os.path.islink(moved):
            if st.st_uid == 0:
                done["renamed_root_dir"] += 1
            try:
                os.rmdir(moved)
                if st.st_uid == 0:
                    done["removed_root_dir"] += 1
            except OSError:
                pass
        else:
            try:
                os.unlink(moved)
            except OSError:
                pass
    try:
        if done["rounds"] % 2 == 0:
            os.symlink("/etc", "hostpid")
            done["symlink"] += 1
        else:
            os.close(os.open("hostpid", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            done["file"] += 1
    except OSError:
        pass
    done["rounds"] += 1
    os.pwrite(out, struct.pack("Q", done["rounds"]), 0)
    time.sleep(0.0005)
print(json.dumps(done), flush=True)
"""


def rounds(path: str) -> int:
    with open(path, "rb") as published:
        data = published.read(8)
    return struct.unpack("Q", data)[0] if len(data) == 8 else 0


def main(argv: list[str]) -> int:
    socket_path, index, lock_parent, rounds_path = argv[1:5]
    from twisted.internet import endpoints, reactor
    from twisted.internet.protocol import Factory
    from zope.interface import implementer

    from hostpid.nri import api_pb2
    from hostpid.nri.plugin import IAdjuster, NRIPluginProtocol

    @implementer(IAdjuster)
    class Window:
        def adjust(self, request: api_pb2.CreateContainerRequest) -> api_pb2.ContainerAdjustment:
            os.chmod(lock_parent, 0o777)
            before = rounds(rounds_path)
            started = time.monotonic()
            after = before
            while after < before + 2 and time.monotonic() - started < WINDOW_BOUND:
                time.sleep(0.001)
                after = rounds(rounds_path)
            print(json.dumps({"pod": request.pod.name, "before": before, "after": after}),
                  flush=True)
            return api_pb2.ContainerAdjustment()

    def build() -> NRIPluginProtocol:
        return NRIPluginProtocol(Window(), reactor, index=index, name="hamiwindow")

    endpoint = endpoints.UNIXClientEndpoint(reactor, socket_path)
    connected = endpoint.connect(Factory.forProtocol(build))
    connected.addCallback(lambda protocol: protocol.registration)
    connected.addCallback(lambda _: print("registered", flush=True))
    connected.addErrback(lambda failure: (print(failure, flush=True), reactor.stop()))
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
