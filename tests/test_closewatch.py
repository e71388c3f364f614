"""
L{hostpid.broker.closewatch} on real sockets: a close that would linger is
interrupted, one that cannot be is reported and worked around, and the
watchdog never sends a signal that has no handler.
"""

from __future__ import annotations

import array
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from attackers import LINGERING_SOCKET
from support import wait_for
from twisted.logger import globalLogPublisher

from hostpid.broker.closewatch import CloseWatch, default_watch
from hostpid.broker.descriptors import BackgroundCloser, PassedDescriptors

pytestmark = pytest.mark.kernel

#: Far longer than any bound below: only an interrupt ends such a close sooner.
LINGER = 600


@pytest.fixture
def attacker() -> Iterator[dict[str, object]]:
    """L{LINGERING_SOCKET}'s pieces, in this process; its peers closed afterwards."""
    pieces: dict[str, object] = {"socket": socket, "struct": struct, "time": time}
    exec(LINGERING_SOCKET, pieces)
    yield pieces
    for held in pieces["keep"]:  # type: ignore[attr-defined]
        held.close()


def nested(attacker: dict[str, object]) -> tuple[int, socket.socket]:
    """
    A Unix socket (returned as a bare descriptor, the last reference) whose
    receive queue holds a lingering TCP socket, and the peer that sent it.
    """
    tcp = attacker["lingering"](LINGER)  # type: ignore[operator]
    outer, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.sendmsg([b"n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                           array.array("i", [tcp.fileno()]))])
    tcp.close()
    return outer.detach(), peer


@pytest.mark.usefixtures("reads")
def test_a_lingering_close_in_the_reactor_thread_is_interrupted(attacker) -> None:
    """
    L{PassedDescriptors.release}'s own close, made in the reactor's thread
    (here the test's, whose guard the instance registers), is bounded like
    the closer's: given a connection whose close lingers, it returns once
    interrupted, and says nothing was found.  On kernels before 6.10 a
    tenant can make that close linger (in-flight garbage is freed in it).
    The C helper must release the GIL for it, or the watchdog's thread could
    not look and the close would last LINGER seconds; and an interrupted
    close is over (Linux frees the descriptor), not an error to raise into
    the accept loop with the guard still marked busy.
    """
    watch = default_watch()
    assert watch.install(), watch.reason
    before = watch.interrupted
    receiver = PassedDescriptors(BackgroundCloser())
    # Shorter than LINGER, so that a close nothing interrupts fails in 30 s.
    connection = attacker["lingering"](30)  # type: ignore[operator]
    started = time.monotonic()
    assert receiver.release(connection) is False
    took = time.monotonic() - started
    assert took < 10, f"the close took {took:.1f}s"
    assert watch.interrupted > before
    assert receiver.guard.busy is False, "the guard says the close is over"
    assert connection.fileno() == -1


def test_the_watch_never_signals_without_its_handler() -> None:
    """
    Not installed (its real-time signal's default action would end the
    process), a watch sees a close in progress but sends nothing.
    """
    watch = CloseWatch(signum=int(default_watch().signum) + 1)
    guard = watch.guard("this thread")
    guard.closes += 1
    guard.busy = True
    for _ in range(5):
        watch.look()
    guard.busy = False
    assert watch.interrupted == 0 and not watch.active


@pytest.mark.usefixtures("reads")
def test_a_connection_closed_at_its_deadline_with_a_lingering_socket_queued(attacker) -> None:
    """
    The matrix's finding (5.10, before the fix): a connection that reaches
    its deadline with a message still unread for lack of room is handed to
    the closer whole, and closing it drops a queued lingering socket's last
    reference in the closer's thread.  That close is interrupted too.
    """
    fd, peer = nested(attacker)
    server, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client.sendmsg([b"HPID"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)  # the queued message holds the outer socket's last reference
    receiver = PassedDescriptors(BackgroundCloser(), descriptorLimit=64, reserved=0)
    assert not receiver.hasRoom()
    assert receiver.release(server) is False, "handed over whole, undrained"
    wait_for(lambda: receiver.closer.closed == 1, "the disposer to close it", timeout=10)
    assert receiver.closer.drained == 1, "the connection drained, its lingering socket dropped"
    client.close()
    peer.close()


class _EndOfTest(BaseException):
    """Ends a watchdog loop run by a test (the loop survives any C{Exception})."""


def test_the_watchdog_outlives_a_look_that_fails() -> None:
    """
    A look that raises (a log observer that fails, a replacement thread
    that cannot start) does not end the watchdog: it looks again.  Before
    the fix the thread died with its first exception, and every later
    lingering close went unbounded, silently.
    """

    class FailingOnce(CloseWatch):
        looks = 0

        def look(self) -> bool:
            self.looks += 1
            if self.looks == 1:
                raise RuntimeError("a log observer that raises")
            if self.looks == 3:
                raise _EndOfTest()
            return False

    watch = FailingOnce(pollBusy=0.001, pollIdle=0.001)
    ended: list[BaseException] = []

    def run() -> None:
        try:
            watch._run()
        except BaseException as e:  # noqa: BLE001 - what ended the loop is the finding
            ended.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the loop should have reached the third look"
    assert watch.looks == 3
    assert len(ended) == 1 and isinstance(ended[0], _EndOfTest), ended


def test_a_log_line_for_a_reactor_that_takes_no_calls_is_written_here() -> None:
    """
    The watch's reactor is the last one given to L{CloseWatch.install};
    one that cannot take calls from threads (a test's memory reactor, a
    reactor being torn down) gets the line written from the watchdog's own
    thread instead of an exception that would end the watchdog.
    """
    seen: list[dict[str, object]] = []

    class Refusing:
        def callFromThread(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("reactor stopped")

    for reactor in (object(), Refusing()):
        watch = CloseWatch()
        watch._reactor = reactor
        globalLogPublisher.addObserver(seen.append)
        try:
            watch._emit("hostpid-broker: {what}", what="said")
        finally:
            globalLogPublisher.removeObserver(seen.append)
    assert [event.get("what") for event in seen] == ["said", "said"]


@pytest.fixture(scope="module")
def private() -> Iterator[tuple[CloseWatch, socket.socket, socket.socket]]:
    """
    A watch of its own, installed (a real-time signal no other test uses),
    its thread started while a connected pair of sockets is open here.
    """
    held, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    watch = CloseWatch(
        signum=int(default_watch().signum) + 2, pollBusy=0.005, pollIdle=0.005, stuckAfter=0.05
    )
    assert watch.install(), watch.reason
    yield watch, held, peer
    held.close()
    peer.close()


def _watchdog_task(watch: CloseWatch) -> Path:
    thread = watch._thread
    assert thread is not None and thread.native_id is not None
    return Path(f"/proc/self/task/{thread.native_id}")


def test_the_watchdog_thread_holds_no_descriptor_but_0_to_2(private) -> None:
    """
    Its table is its own: while it shared the process's, the kernel took a
    reference on the file for every system call the reactor thread made on
    a descriptor (about 1.5 us a transaction in mode received).  Before
    this change the thread's table was the process's, listing every
    descriptor open here.
    """
    watch, held, _ = private
    assert watch.sharedTable is None
    task = _watchdog_task(watch)
    theirs = {int(name) for name in os.listdir(task / "fd")}
    ours = {int(name) for name in os.listdir("/proc/self/fd")}
    assert held.fileno() in ours
    assert theirs <= {0, 1, 2}, f"the watchdog's table holds {sorted(theirs)}"


def test_the_watchdog_thread_blocks_every_signal(private) -> None:
    """A signal for the process (SIGTERM) is handled where Python can wake the reactor."""
    watch, _, _ = private
    status = (_watchdog_task(watch) / "status").read_text()
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:"))
                  .split()[1], 16)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, watch.signum):
        assert blocked & (1 << (int(signum) - 1)), f"signal {int(signum)} not blocked"


def test_a_descriptor_closed_here_is_not_kept_open_by_the_watchdog(private) -> None:
    """
    The thread's table copied nothing from 3 up: a socket open when it
    started is really closed when the process closes it (a copy would hold
    it open, and its peer would never see the end of file).
    """
    _, held, peer = private
    held.close()
    peer.settimeout(10)
    assert peer.recv(1) == b"", "end of file at once"


def test_the_watchdogs_reports_are_made_in_the_main_thread(private) -> None:
    """
    The watchdog holds no descriptor, so what it has to say (a log line, a
    stuck close for the closer to replace its thread) is done in the main
    thread, which its signal wakes: a close nothing interrupts, in another
    thread, is reported, and its owner told, from there.
    """
    watch, _, _ = private
    seen: list[dict[str, object]] = []
    told: list[threading.Thread] = []
    release = threading.Event()

    def stuck() -> None:
        guard = watch.guard("a stuck thread", lambda g: told.append(threading.current_thread()))
        guard.closes += 1
        guard.busy = True  # as a close that ignores signals: the watchdog's interrupts return here
        while not release.wait(0.01):
            pass
        guard.busy = False
        watch.forget(guard)

    globalLogPublisher.addObserver(seen.append)
    thread = threading.Thread(target=stuck, daemon=True)
    thread.start()
    try:
        wait_for(lambda: told, "the stuck close to be reported", timeout=10)
    finally:
        release.set()
        thread.join(10)
        globalLogPublisher.removeObserver(seen.append)
    assert told == [threading.main_thread()]
    assert any("despite interrupts" in str(event.get("log_format")) for event in seen), seen
    assert not watch.outbox
