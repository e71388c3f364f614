"""
The disposer process that closes what clients passed (hostpid.broker.closer),
with real processes and real lingering sockets: a tenant's descriptor is
dropped unread in milliseconds, a disposer that stops making progress is abandoned
and replaced, abandoned disposers are bounded, and nothing the disposer does
queues a signal in the broker.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from attackers import LINGERING_SOCKET
from support import scaled, wait_for
from twisted.internet.testing import MemoryReactorClock

from hostpid.broker.closer import BackgroundCloser
from hostpid.broker.closewatch import CloseWatch

pytestmark = pytest.mark.kernel

#: As long as a socket can linger: only an interrupted wait ends sooner.
LINGER = 2**31 - 1


@pytest.fixture
def attacker():
    """The attack's lingering sockets, made in this process (their peers kept)."""
    made: dict[str, object] = {"socket": socket, "struct": __import__("struct"), "time": time}
    exec(LINGERING_SOCKET, made)
    yield made
    for held in made["keep"]:  # type: ignore[attr-defined]
        held.close()


def nested(attacker) -> tuple[int, socket.socket]:
    """A Unix socket whose queue holds a lingering TCP socket's last reference."""
    import array

    tcp = attacker["lingering"](LINGER)  # type: ignore[operator]
    outer, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.sendmsg([b"n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [tcp.fileno()]))])
    tcp.close()
    return outer.detach(), peer


def never_reads(channel: int, progress: int, ready: bool = True) -> subprocess.Popen[bytes]:
    """
    A disposer that says it is ready (unless not C{ready}), then takes
    nothing and closes nothing: stuck from the start.
    """
    program = (
        "import socket, struct, sys, time\n"
        "if sys.argv[2] == 'ready':\n"
        "    socket.socket(fileno=int(sys.argv[1])).send(struct.pack('=QQQ', 0, 0, 0))\n"
        "time.sleep(600)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", program, str(progress), "ready" if ready else "-"],
        pass_fds=(channel, progress), stdin=subprocess.DEVNULL,
    )


def scripted_closer(
    program: str,
) -> tuple[MemoryReactorClock, BackgroundCloser, list[subprocess.Popen[bytes]]]:
    """
    A closer on a test clock (stuck after 0.5 s) whose disposers are played
    by C{program}, run with its progress descriptor as C{argv[1]} and driven
    through its stdin and stdout; and the list of those it spawns.
    """
    spawned: list[subprocess.Popen[bytes]] = []

    def spawn(channel: int, progress: int) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", program, str(progress)],
            pass_fds=(channel, progress), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        spawned.append(process)
        return process

    clock = MemoryReactorClock()
    closer = BackgroundCloser(reactor=clock, watch=CloseWatch(), stuckAfter=0.5, spawn=spawn)
    return clock, closer, spawned


def stop_all(
    closer: BackgroundCloser, spawned: list[subprocess.Popen[bytes]], *fds: int
) -> None:
    """The closer stopped, every disposer it spawned killed and reaped, C{fds} closed."""
    closer.stop()
    for process in spawned:
        process.kill()
        process.wait()
    for fd in fds:
        os.close(fd)


def sig_queue() -> tuple[int, int]:
    """This process's UID's queued signals and its limit, from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("SigQ:"):
                queued, limit = line.split()[1].split("/")
                return int(queued), int(limit)
    raise AssertionError("no SigQ line")


def test_a_connection_carrying_a_lingering_socket_is_disposed_of_in_milliseconds(
    attacker,
) -> None:
    """
    The disposer drains a connection whose queue holds a lingering TCP
    socket's last reference without installing it: the kernel drops the
    reference, the linger's wait starts in the disposer and its timer ends
    it within milliseconds, while the attacker (the TCP socket's peer that
    never reads, its listener) is still there.  Before, a closer thread
    waited for the watchdog's second look (about 40 ms) per descriptor,
    about 50 a second with two threads.
    """
    closer = BackgroundCloser(reactor=MemoryReactorClock(), watch=CloseWatch())
    # The disposer starts with the first descriptor submitted: an interpreter
    # starting, which in a kernel guest under emulation takes seconds.  It is
    # started with a plain pipe end first, so that the clock below times the
    # lingering closes and nothing else.
    warm, other = os.pipe()
    os.close(other)
    closer.submit(warm)
    wait_for(lambda: closer.closed == 1, "the disposer to start and close a pipe")
    fds = []
    peers = []
    for _ in range(20):
        fd, peer = nested(attacker)
        fds.append(fd)
        peers.append(peer)
    started = time.monotonic()
    for fd in fds:
        closer.submit(fd)
    wait_for(lambda: closer.closed == 21, "the disposer to close all twenty",
             timeout=scaled(10))
    took = time.monotonic() - started
    assert closer.drained == 20, "each queue held a descriptor, dropped unread"
    assert closer.interrupted >= 1, "the lingering waits were cut short by the timer"
    assert closer.pending == 0
    # The bound is generous for a shared machine; the point is that no close
    # waited for a linger (2**31 - 1 s) or for an interrupt per descriptor.
    assert took < scaled(5), f"twenty closes took {took:.2f}s"
    for peer in peers:
        peer.close()
    closer.stop()


def test_a_disposer_that_makes_no_progress_is_abandoned_and_replaced() -> None:
    """
    A disposer stuck in a close that ignores signals (played here by one
    that never reads) is killed once STUCK_AFTER passes with descriptors
    owed and no close finished, counted from the first check after it said
    it runs; a fresh one closes what comes next.
    """
    clock = MemoryReactorClock()
    spawned: list[subprocess.Popen[bytes]] = []

    def first_stuck(channel: int, progress: int) -> subprocess.Popen[bytes]:
        from hostpid.broker.closer import spawn_disposer

        process = (
            never_reads(channel, progress) if not spawned else spawn_disposer(channel, progress)
        )
        spawned.append(process)
        return process

    closer = BackgroundCloser(
        limit=2, reactor=clock, watch=CloseWatch(), stuckAfter=0.5, spawn=first_stuck
    )
    read, write = os.pipe()
    closer.submit(read)
    assert (closer.pending, closer.saturated) == (1, False)
    wait_for(lambda: closer.disposerReady, "the stuck disposer to say it is ready")
    clock.advance(0.5)
    assert spawned[0].poll() is None, "its first period of running starts at this look"
    clock.advance(0.5)
    assert closer.closed == 1 and closer.pending == 0, "the stuck disposer's debt written off"
    assert spawned[0].wait(timeout=10) == -signal.SIGKILL
    read2, write2 = os.pipe()
    closer.submit(read2)
    wait_for(lambda: closer.closed == 2, "the fresh disposer to close the pipe")
    with pytest.raises(BrokenPipeError):
        os.write(write2, b"x")
    os.close(write)
    os.close(write2)
    assert len(spawned) == 2
    closer.stop()


def test_interrupts_queue_no_signal_in_the_broker(attacker) -> None:
    """
    Interrupting lingering closes costs the broker's UID no queued signal:
    the disposer's timer is a standard signal in its own process.  Before,
    the watchdog queued a real-time signal at every look into every busy
    close, forever, charged to UID 0's RLIMIT_SIGPENDING.
    """
    closer = BackgroundCloser(reactor=MemoryReactorClock(), watch=CloseWatch())
    queued_before, _ = sig_queue()
    peers = []
    for _ in range(10):
        fd, peer = nested(attacker)
        peers.append(peer)
        closer.submit(fd)
    wait_for(lambda: closer.closed == 10, "the disposer to close all ten", timeout=10)
    queued, _ = sig_queue()
    assert queued <= queued_before + 4, (queued_before, queued)
    for peer in peers:
        peer.close()
    closer.stop()


def test_a_disposer_that_cannot_start_is_not_counted_and_is_tried_again() -> None:
    """
    A disposer that fails to start (here: the system refuses the process) is
    not counted as running; the descriptor waits in the broker, counted,
    and the next look starts one.  Before, a closer thread that failed to
    start was still counted as running, so none was ever started again.
    """
    clock = MemoryReactorClock()
    refusals = [OSError(11, "Resource temporarily unavailable")]

    def refused_once(channel: int, progress: int) -> subprocess.Popen[bytes]:
        from hostpid.broker.closer import spawn_disposer

        if refusals:
            raise refusals.pop()
        return spawn_disposer(channel, progress)

    closer = BackgroundCloser(reactor=clock, watch=CloseWatch(), spawn=refused_once)
    read, write = os.pipe()
    closer.submit(read)
    assert (closer.started, closer.spawnFailures, len(closer.held), closer.pending) == (0, 1, 1, 1)
    assert closer.disposerPid is None
    clock.advance(closer.stuckAfter)
    assert closer.started == 1 and not closer.held
    wait_for(lambda: closer.closed == 1, "the disposer started on the next look to close it")
    with pytest.raises(BrokenPipeError):
        os.write(write, b"x")
    os.close(write)
    closer.stop()


def test_a_replaced_handler_is_said_once_and_ends_the_bound() -> None:
    """
    An embedding application that installs its own handler for the
    watchdog's signal after start takes the close bound away: the watch
    says so once, as an error, and no longer counts as active.  Before, the
    bound was lost silently.
    """
    from twisted.logger import globalLogPublisher

    watch = CloseWatch(signum=int(signal.SIGRTMIN) + 6)
    assert watch.install(), watch.reason
    seen: list[dict[str, object]] = []
    globalLogPublisher.addObserver(seen.append)
    previous = signal.getsignal(watch.signum)
    try:
        assert watch.checkHandler() is True
        signal.signal(watch.signum, lambda signum, frame: None)
        assert watch.checkHandler() is False
        assert watch.checkHandler() is False
    finally:
        signal.signal(watch.signum, previous)
        globalLogPublisher.removeObserver(seen.append)
    said = [e for e in seen if "no longer bounded" in str(e.get("log_format"))]
    assert len(said) == 1, seen
    assert watch.handlerLost and not watch.active


def test_a_busy_close_is_signalled_a_bounded_number_of_times() -> None:
    """
    A close that outlasts its interrupts is signalled at most
    INTERRUPTS_PER_CLOSE times, however long it lasts: a real-time signal
    queues one entry per send against the UID's RLIMIT_SIGPENDING, shared by
    every root process on the node.  Before, one was sent at every look.
    """
    from hostpid.broker.closewatch import INTERRUPTS_PER_CLOSE

    watch = CloseWatch(signum=int(signal.SIGRTMIN) + 7, stuckAfter=3600)
    assert watch.install(), watch.reason
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, [watch.signum])
    try:
        guard = watch.guard("this thread")
        guard.closes += 1
        guard.busy = True
        queued_before, _ = sig_queue()
        for _ in range(50):
            watch.look()
        queued, _ = sig_queue()
        guard.busy = False
        assert watch.interrupted == INTERRUPTS_PER_CLOSE
        # Blocked here, so every signal sent is still queued.
        assert queued - queued_before == INTERRUPTS_PER_CLOSE, (queued_before, queued)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        watch.forget(guard)


def test_a_disposer_that_reports_interrupted_waits_is_not_abandoned() -> None:
    """
    A disposer cutting one lingering close after another closes nothing for
    a while, but reports each interrupted wait: that is progress, and it is
    kept (under emulation such a disposer was abandoned after 0.5 s, and
    the descriptors it held went with it).  Once it reports nothing for
    STUCK_AFTER it is abandoned as before.
    """
    program = (
        "import socket, struct, sys, time\n"
        "progress = socket.socket(fileno=int(sys.argv[1]))\n"
        "progress.send(struct.pack('=QQQ', 0, 0, 0))\n"
        "interrupted = 0\n"
        "while sys.stdin.buffer.read(1):\n"
        "    interrupted += 1\n"
        "    progress.send(struct.pack('=QQQ', 0, 0, interrupted))\n"
        "    print('sent', flush=True)\n"
        "time.sleep(600)\n"
    )
    clock, closer, spawned = scripted_closer(program)
    read, write = os.pipe()
    try:
        closer.submit(read)
        wait_for(lambda: closer.disposerReady, "the disposer to say it is ready")
        process = spawned[0]
        assert process.stdin is not None and process.stdout is not None
        for _ in range(3):
            process.stdin.write(b"x")
            process.stdin.flush()
            assert process.stdout.readline() == b"sent\n"
            clock.advance(0.5)
            assert closer.stuckDisposers == 0, "kept: it reported an interrupted wait"
        assert closer.interrupted == 3 and closer.closed == 0
        clock.advance(0.5)
        assert process.wait(timeout=10) == -signal.SIGKILL, "abandoned: no report since"
    finally:
        stop_all(closer, spawned, write)


def test_a_disposer_is_judged_only_after_a_full_period_of_running() -> None:
    """
    The stuck clock starts when a disposer says it runs, not when it was
    started: one whose first report comes just before a check has had no
    time to drain or interrupt anything, and is not judged by that check
    (before, a disposer slow to start under emulation was abandoned a few
    milliseconds after it began, and the descriptors it held went with it).
    One that then makes no progress for STUCK_AFTER is abandoned as before.
    """
    program = (
        "import socket, struct, sys, time\n"
        "sys.stdin.buffer.read(1)\n"
        "socket.socket(fileno=int(sys.argv[1])).send(struct.pack('=QQQ', 0, 0, 0))\n"
        "time.sleep(600)\n"
    )
    clock, closer, spawned = scripted_closer(program)
    read, write = os.pipe()
    try:
        closer.submit(read)
        clock.advance(0.4)
        process = spawned[0]
        assert process.stdin is not None
        process.stdin.write(b"x")
        process.stdin.flush()
        wait_for(lambda: closer.disposerReady, "the disposer to say it is ready")
        clock.advance(0.1)
        assert process.poll() is None and closer.stuckDisposers == 0, (
            "not judged: it had run for no time at all"
        )
        clock.advance(0.5)
        assert process.wait(timeout=10) == -signal.SIGKILL, "abandoned: no progress since"
    finally:
        stop_all(closer, spawned, write)


def test_at_the_bound_a_stuck_disposer_is_kept_and_parks_what_follows() -> None:
    """
    With as many abandoned disposers alive as the bound allows (here 0), a
    stuck one is not killed: no fresh one could start, and its stream goes
    on taking connections in flight, out of the broker's descriptor table,
    far beyond the 10 messages a datagram pair would take.
    """
    clock = MemoryReactorClock()
    spawned: list[subprocess.Popen[bytes]] = []

    def stuck(channel: int, progress: int) -> subprocess.Popen[bytes]:
        process = never_reads(channel, progress)
        spawned.append(process)
        return process

    closer = BackgroundCloser(
        reactor=clock, watch=CloseWatch(), stuckAfter=0.5, maxAbandoned=0, spawn=stuck
    )
    writes = []
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(300):
            read, write = os.pipe()
            writes.append(write)
            closer.submit(read)
        wait_for(lambda: closer.disposerReady, "the stuck disposer to say it is ready")
        clock.advance(0.5)
        clock.advance(0.5)
        assert len(spawned) == 1 and spawned[0].poll() is None, "kept, not killed"
        assert not closer.held, "every one in flight to it"
        assert closer.pending == 300
        # The broker holds the write ends and two sockets to the disposer, no read end.
        assert len(os.listdir("/proc/self/fd")) == before + 300 + 2
    finally:
        closer.stop()
        spawned[0].kill()
        spawned[0].wait()
        for write in writes:
            os.close(write)


def test_a_disposer_slow_to_start_is_waited_for_and_one_that_never_does_is_abandoned() -> None:
    """
    A fresh interpreter on a loaded node, or under emulation, may take
    longer than STUCK_AFTER to start: before its first report it is not
    judged by progress (before, a kernel-matrix guest killed every disposer
    before it ran, and nothing passed was ever closed), and only one that
    never reports within STARTUP_TIMEOUT is abandoned.
    """
    from hostpid.broker.closer import STARTUP_TIMEOUT

    clock = MemoryReactorClock()
    spawned: list[subprocess.Popen[bytes]] = []

    def silent(channel: int, progress: int) -> subprocess.Popen[bytes]:
        process = never_reads(channel, progress, ready=False)
        spawned.append(process)
        return process

    closer = BackgroundCloser(reactor=clock, watch=CloseWatch(), stuckAfter=0.5, spawn=silent)
    read, write = os.pipe()
    try:
        closer.submit(read)
        clock.advance(0.5)
        clock.advance(0.5)
        assert spawned[0].poll() is None and closer.started == 1, "waited for, not abandoned"
        while clock.seconds() < STARTUP_TIMEOUT + 1:
            clock.advance(0.5)
        assert spawned[0].wait(timeout=10) == -signal.SIGKILL, "abandoned: it never started"
    finally:
        stop_all(closer, spawned, write)
