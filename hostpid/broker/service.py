"""
The broker as a Twisted service: the lifecycle, in order.

Start: check the gate; prepare the directory; take the lock; judge what is at
the socket path; listen; watch the path.  Stop: stop accepting (the port
removes the socket only if it is still ours), let transactions in flight end
(each is bounded by its own deadline), release the lock.

L{BrokerService} is an ordinary L{IService}: C{twistd hostpid-broker} runs it
alone, and a larger Twisted application (a device plugin) can add it as a
child of its own L{MultiService}.  Whatever makes the broker stop serving
after startup (the listener fails, the socket path is removed or replaced)
is fatal: by default the process exits non-zero so its supervisor restarts it,
as the design's failure table requires.
"""

from __future__ import annotations

import os
import resource
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid import defaults
from hostpid.broker import activation, connections, disabled, fsrules, handover
from hostpid.broker.closer import CLOSER_QUEUE
from hostpid.broker.closewatch import INTERRUPTS_PER_CLOSE
from hostpid.broker.descriptors import (
    ROOM_MARGIN,
    SCM_MAX_FD,
    DescriptorMode,
    refuse_descriptor_passing,
)
from hostpid.broker.mountwatch import MountpointWatch
from hostpid.broker.pidns import OVERRIDE_OPTION, PROC_PID_INIT_INO, check_host_pid_namespace
from hostpid.broker.port import BrokerPort
from hostpid.broker.server import BrokerFactory
from hostpid.errors import PathRuleError
from hostpid.gate import GATE_ENV, gate_enabled
from hostpid.peercred import LivenessCheck, PeerIdentifier

#: How often the socket path's identity is checked while serving, in seconds.
WATCH_INTERVAL = 1.0

#: The exit status after a fatal error once serving.
FATAL_EXIT_STATUS = 1

#: For tests only: C{"1"} makes the broker receive passed descriptors (the
#: mode of kernels without C{SO_PASSRIGHTS}) even where the kernel could
#: refuse them.  It weakens nothing: that mode is safe, only slower.
RECEIVE_DESCRIPTORS_ENV = "HOSTPID_BROKER_TEST_RECEIVE_DESCRIPTORS"

#: For tests only: C{"pidfd_open"} makes the broker check callers with the
#: liveness check of kernels without C{SO_PEERPIDFD} (before Linux 6.5) even
#: where the kernel has it.  That check is weaker (docs/security.md); the
#: broker logs that it was forced, and the metrics name the check in force.
#: No value turns the check off.
LIVENESS_ENV = "HOSTPID_BROKER_TEST_LIVENESS"


def is_default_directory(directory: str) -> bool:
    """
    Whether C{directory} is the production directory under any spelling:
    C{/var/run} is a symlink to C{/run} on most systems, and
    C{/run/hami/hostpid} must get the same rules (root only, no unsafe
    override) as C{/var/run/hami/hostpid}.
    """
    return os.path.realpath(directory) == os.path.realpath(defaults.BROKER_DIRECTORY)


def expected_uid_for(directory: str) -> int:
    """
    The UID that must own the broker's files: 0 for the default directory
    (where the broker refuses to run unless it is root), otherwise this
    process's effective UID.

    @raise fsrules.BrokerStartupError: the default directory without root.
    """
    euid = os.geteuid()
    if is_default_directory(directory):
        if euid != 0:
            raise fsrules.BrokerStartupError(
                directory,
                f"the default broker directory requires effective UID 0 (running as UID {euid})",
            )
        return 0
    return euid


#: Descriptors the broker needs beyond one per active transaction, for
#: itself: the listener, the directory and lock, a transient pidfd, standard
#: streams and logs, Twisted's waker and reserved descriptor, the metrics
#: listener.  48 is several times what those take (about a dozen).
BASE_DESCRIPTORS = 48

#: Descriptors reserved beyond one per active transaction: the broker's own
#: plus every connection the metrics server may hold
#: (L{defaults.METRICS_MAX_CONNECTIONS}).  At its cap the metrics server
#: evicts the oldest connection for a newcomer, and the evicted descriptor
#: closes on the next reactor turn, so for that moment one accept batch more
#: may be open (at most the listener's backlog, 50 by default): beyond this
#: headroom, a metrics flood can make the broker's own accept meet EMFILE
#: for a turn, which it backs off from and recovers (never a freeze).
DESCRIPTOR_HEADROOM = BASE_DESCRIPTORS + defaults.METRICS_MAX_CONNECTIONS
#: And, where clients can pass descriptors (no SO_PASSRIGHTS), room for one
#: full SCM_RIGHTS message (and its margin) and for those waiting in the
#: background closer.  This sizes the limit so reads rarely wait; what makes
#: a full table harmless is that no read is made without room for a full
#: message (L{PassedDescriptors.hasRoom}): a receive that found the table
#: full would make the kernel release the rest in the receiving thread.
PASSED_DESCRIPTOR_HEADROOM = SCM_MAX_FD + ROOM_MARGIN + CLOSER_QUEUE


def ensure_descriptors(maxConnections: int, extra: int = 0) -> tuple[int, int]:
    """
    Raise the soft C{RLIMIT_NOFILE} so that C{maxConnections} transactions fit
    (up to the hard limit).  Running out of descriptors is survivable (accept
    backs off), but a broker whose limit is below its own C{--max-connections}
    would refuse clients it claims to have room for.

    @return: the soft limit now in force, and the number wanted.
    """
    wanted = maxConnections + DESCRIPTOR_HEADROOM + extra
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    return soft, wanted


def passing_unrefusable() -> bool:
    """Whether this kernel lacks C{SO_PASSRIGHTS} (asked on a throwaway socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            return not refuse_descriptor_passing(probe)
        except OSError:
            return True


def exit_process(reactor: Any, status: int = FATAL_EXIT_STATUS) -> None:
    """
    Stop the reactor and make the process exit with C{status}.

    twistd exits 0 after C{reactor.stop()} and swallows C{sys.exit} in a
    shutdown trigger; an "after shutdown" trigger that calls C{os._exit}
    is what gives the supervisor a non-zero status.
    """

    def _exit() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    reactor.addSystemEventTrigger("after", "shutdown", _exit)
    if reactor.running:
        reactor.stop()


class BrokerService(Service):
    """
    Runs one broker on C{directory}.

    @ivar factory: the transaction factory once listening (counts, limits).
    @ivar port: the listening port once listening.
    """

    name = "hostpid-broker"
    log = Logger()

    def __init__(
        self,
        directory: str = defaults.BROKER_DIRECTORY,
        maxConnections: int = defaults.MAX_CONNECTIONS,
        deadline: float = defaults.DEADLINE,
        reactor: Any = None,
        environ: Mapping[str, str] | None = None,
        onFatal: Callable[[], None] | None = None,
        watchInterval: float = WATCH_INTERVAL,
        allowNonHostPidNamespace: bool = False,
        identifier: PeerIdentifier | None = None,
        prepareNode: Callable[[bool], None] | None = None,
        lockParent: str = defaults.LOCK_PARENT,
        receiveDescriptors: bool | None = None,
        maxPerPeer: int | None = None,
        onHandedOver: Callable[[], None] | None = None,
        readyFile: str | None = None,
    ) -> None:
        """
        @param prepareNode: what the node side needs ready at every start,
            called with whether the broker is enabled: after the lock is
            taken and before listening, or, with the gate off, instead of
            serving.  A L{PathRuleError} it raises is a startup refusal.  The
            twistd plugin's C{--cdi-dir} passes
            L{hostpid.node.cdiwrite.SpecPublisher} here; the broker itself
            knows nothing of CDI.
        @param lockParent: the host lock parent, whose C{hostpid} mountpoint
            the broker watches while serving.
        @param receiveDescriptors: receive passed descriptors instead of
            having the kernel refuse them (C{SO_PASSRIGHTS}), as a kernel
            without that option forces; for tests.  C{None}: as
            L{RECEIVE_DESCRIPTORS_ENV} in C{environ} says (default off).
        @param maxPerPeer: waiting connections one peer may hold (see
            L{hostpid.broker.waiting}); C{None}: the factory's default, a
            sixteenth of C{maxConnections}.
        @param onHandedOver: called once a new broker took the listener and
            the lock over (L{hostpid.broker.handover}); default: stop the
            reactor (twistd then exits 0).
        @param readyFile: a path (in a place of this broker's own, such as
            a container's emptyDir) created once this broker holds the
            listener and removed when it stops or hands over: during a
            handover both brokers answer on the socket, and only this tells
            a readiness check which one it is.
        """
        if reactor is None:
            from twisted.internet import reactor as _reactor

            reactor = _reactor
        self.directory = directory
        self.socketPath = os.path.join(directory, defaults.SOCKET_NAME)
        self.maxConnections = maxConnections
        self.maxPerPeer = maxPerPeer
        self.deadline = deadline
        self.reactor = reactor
        self.enabled = gate_enabled(environ)
        self._environ = environ
        self.onFatal = onFatal if onFatal is not None else lambda: exit_process(reactor)
        self.watchInterval = watchInterval
        self.allowNonHostPidNamespace = allowNonHostPidNamespace
        self.identifier = identifier
        self.prepareNode = prepareNode
        self.lockParent = lockParent
        #: Watches C{<lockParent>/hostpid} while serving: quiet until it has
        #: been seen (a broker that cannot see the lock parent never logs).
        self.mountpointWatch = MountpointWatch(lockParent)
        if receiveDescriptors is None:
            env = os.environ if environ is None else environ
            receiveDescriptors = env.get(RECEIVE_DESCRIPTORS_ENV) == "1"
        self.receiveDescriptors = receiveDescriptors
        #: Whether L{LIVENESS_ENV} forced the check (said in the log at start).
        self.livenessForced = False
        if identifier is None:
            forced = (os.environ if environ is None else environ).get(LIVENESS_ENV)
            if forced == LivenessCheck.PIDFD_OPEN.value:
                self.identifier = PeerIdentifier(check=LivenessCheck.PIDFD_OPEN)
                self.livenessForced = True
            elif forced:
                self.log.warn(
                    "hostpid-broker: {env}={value!r} ignored (the only value is \"pidfd_open\")",
                    env=LIVENESS_ENV, value=forced,
                )
        self.onHandedOver = onHandedOver if onHandedOver is not None else reactor.stop
        self.readyFile = readyFile
        self.factory: BrokerFactory | None = None
        self.port: BrokerPort | None = None
        self.failed = False
        #: The listener and lock taken over from a running broker, until done.
        self._takeover: handover.Takeover | None = None
        #: The control socket a newer broker asks for a handover on.
        self.control: handover.ControlListener | None = None
        #: Set once this broker handed its listener to another.
        self.handedOver = False
        #: Called with the new broker's PID as this one hands over, before
        #: the new one hears that it did (L{hostpid.broker.reload}).
        self.handOverObservers: list[Callable[[int], None]] = []
        #: Waiting for a takeover to settle (L{whenSettled}).
        self._settling: list[Deferred[None]] = []
        #: Whether systemd holds the listener too (passed by socket
        #: activation or the descriptor store, or stored): then it outlives
        #: this process, and the path is left in place at stop.
        self.listenerKept = False
        self._directoryFd: int | None = None
        self._lockFd: int | None = None
        self._watch: LoopingCall | None = None

    @property
    def listening(self) -> bool:
        return self.port is not None and bool(self.port.connected)

    def startService(self) -> None:
        """
        Start serving, or raise L{fsrules.BrokerStartupError} naming the path
        and the rule broken (nothing is left half-started).
        """
        super().startService()
        if not self.enabled:
            try:
                self._prepareNode()
            except BaseException:
                self.running = False
                raise
            self.log.info(
                "hostpid-broker: disabled ({gate} is not exactly \"1\"); no socket is created",
                gate=GATE_ENV,
            )
            self._removeStaleSocket()
            return
        try:
            self._start()
        except BaseException:
            self._release()
            self.running = False
            raise

    def _removeStaleSocket(self) -> None:
        """
        Gate off: remove a socket a killed broker left, if it is stale and
        ours (L{disabled.remove_stale_socket}); never fail startup over it.
        """
        try:
            expectedUid = expected_uid_for(self.directory)
        except fsrules.BrokerStartupError:
            return
        kept = disabled.remove_stale_socket(self.directory, expectedUid)
        if kept is None:
            self.log.info(
                "hostpid-broker: disabled: stale socket removed: {path}", path=self.socketPath
            )
        elif os.path.lexists(self.socketPath):
            self.log.info(
                "hostpid-broker: disabled: {path} left in place: {reason}",
                path=self.socketPath, reason=kept,
            )

    def _start(self) -> None:
        namespace = check_host_pid_namespace(
            self.allowNonHostPidNamespace, is_default_directory(self.directory)
        )
        if namespace != PROC_PID_INIT_INO:
            self.log.warn(
                "hostpid-broker: serving outside the host PID namespace (pid:[{namespace}]) "
                "because {option} was given: the PIDs it reports are NOT host PIDs",
                namespace=namespace, option=OVERRIDE_OPTION,
            )
        expectedUid = expected_uid_for(self.directory)
        limit, wanted = ensure_descriptors(
            self.maxConnections, PASSED_DESCRIPTOR_HEADROOM
            if self.receiveDescriptors or passing_unrefusable() else 0,
        )
        if limit < wanted:
            self.log.warn(
                "hostpid-broker: RLIMIT_NOFILE is {limit}, below the {wanted} descriptors that "
                "{maxConnections} active transactions need; raise the hard limit "
                "(systemd LimitNOFILE=, ulimit -n)",
                limit=limit, wanted=wanted, maxConnections=self.maxConnections,
            )
        fsrules.check_socket_path_length(self.socketPath)
        self._directoryFd = fsrules.open_broker_directory(self.directory, expectedUid)
        self.log.info(
            "hostpid-broker: directory prepared: {path} (UID {uid}, mode 0711)",
            path=self.directory, uid=expectedUid,
        )
        try:
            self._lockFd = fsrules.take_lock(self._directoryFd, self.directory, expectedUid)
        except fsrules.LockHeld as held:
            self._takeover = self._askForHandover(held, expectedUid)
            self._lockFd = self._takeover.lockFd
        else:
            self.log.info(
                "hostpid-broker: lock taken: {path}",
                path=os.path.join(self.directory, defaults.LOCK_NAME),
            )
        # After the lock (a second enabled broker, which will not serve, does
        # not rewrite the CDI spec) and before listening (a refusal leaves no
        # socket behind).  A disabled broker prepares without the lock, which
        # lives in the directory it does not create: both steps are safe to
        # race (the spec is renamed into place, the lock parent prepared
        # race-free by renameat2).
        self._prepareNode()
        takeover = self._takeover
        passed = self._passedListener(expectedUid, use=takeover is None)
        if takeover is None and passed is None:
            state = fsrules.clear_socket_path(self._directoryFd, self.directory, expectedUid)
            if state is fsrules.SocketPathState.STALE_REMOVED:
                self.log.info(
                    "hostpid-broker: stale socket removed: {path}", path=self.socketPath
                )
        self.factory = BrokerFactory(
            self.reactor, self.deadline, self.maxConnections, self.identifier,
            maxPerPeer=self.maxPerPeer,
        )
        self.port = BrokerPort(
            self.socketPath,
            self._directoryFd,
            self.factory,
            self.reactor,
            self._listenerFailed,
            expectedUid=expectedUid,
            receiveDescriptors=self.receiveDescriptors,
            listener=takeover.listener if takeover is not None
            else passed[0] if passed is not None else None,
            identity=takeover.identity if takeover is not None
            else passed[1] if passed is not None else None,
        )
        self.port.startListening()
        # A listener taken over is the one the old broker stored already
        # (systemd keeps one copy of a socket), and only the main process
        # may store: this one is not yet.
        self._storeListener(stored=passed is not None or takeover is not None)
        if self.port.descriptorMode is DescriptorMode.REFUSED:
            self.log.info(
                "hostpid-broker: descriptor passing refused by the kernel (SO_PASSRIGHTS=0): "
                "a client's sendmsg with SCM_RIGHTS fails with EPERM"
            )
        else:
            self.log.info(
                "hostpid-broker: descriptor passing: {why}; descriptors clients pass are "
                "received and disposed of off the hot path (no reply; outcome descriptors)",
                why="forced by " + RECEIVE_DESCRIPTORS_ENV if self.receiveDescriptors
                else "this kernel has no SO_PASSRIGHTS (Linux 6.16+)",
            )
            self._logClosesBounded()
        if self.factory.calls.native:
            self.log.info(
                "hostpid-broker: the fast path's system calls are made by the C helper "
                "_hostpid_native (connections held as descriptors)"
            )
        else:
            self.log.warn(
                "hostpid-broker: the C helper _hostpid_native is not in use ({why}): the "
                "fast path's system calls are made from Python, about 2 us more per "
                "transaction (5 us in descriptor mode received)",
                why=connections.NATIVE_MISSING or "turned off",
            )
        identifier = self.factory.identifier
        if self.livenessForced and identifier.check is not None:
            self.log.warn(
                "hostpid-broker: liveness check forced to {check} by {env} "
                "(SO_PEERPIDFD not used even if the kernel has it){refused}{procNote}",
                check=identifier.check.value, env=LIVENESS_ENV,
                refused=f"; pidfd_open refused: {identifier.pidfdOpenRefused}"
                if identifier.pidfdOpenRefused is not None else "",
                procNote="" if identifier.startTimes else (
                    "; /proc is not this PID namespace's, so start times are not compared"
                ),
            )
        self.log.info(
            "hostpid-broker: listening on {path} (max {maxConnections} active, "
            "{maxPerPeer} waiting per peer, deadline {deadline}s)",
            path=self.socketPath, maxConnections=self.maxConnections,
            maxPerPeer=self.factory.maxPerPeer, deadline=self.deadline,
        )
        self._watch = LoopingCall(self.checkSocketPath)
        self._watch.clock = self.reactor
        self._watch.start(self.watchInterval, now=False)
        self._markReady(True)
        if takeover is not None:
            # TAKEN only once this reactor runs, so that the old broker stops
            # accepting only when this one does.
            self.reactor.callWhenRunning(
                lambda: self.reactor.callLater(0, self._completeTakeover, expectedUid)
            )
        else:
            self._openControl(expectedUid)

    def _markReady(self, holding: bool) -> None:
        """Create or remove L{readyFile}; a failure is logged, never fatal."""
        if self.readyFile is None:
            return
        try:
            if holding:
                fd = os.open(self.readyFile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                             | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                os.write(fd, f"{os.getpid()}\n".encode())
                os.close(fd)
            else:
                os.unlink(self.readyFile)
        except FileNotFoundError:
            pass
        except OSError as e:
            self.log.warn("hostpid-broker: ready file {path}: {error}",
                          path=self.readyFile, error=e.strerror)

    def _passedListener(
        self, expectedUid: int, use: bool
    ) -> tuple[socket.socket, fsrules.SocketIdentity] | None:
        """
        The listener systemd passed (socket activation, or the descriptor
        store after a restart), checked; C{None} if none was passed.  Other
        descriptors passed are closed.

        @raise fsrules.BrokerStartupError: one was passed that breaks a rule.
        """
        environ = os.environ if self._environ is None else self._environ
        passed = activation.passed_descriptors(environ)
        if self._environ is None:
            activation.forget(os.environ)
        chosen: tuple[socket.socket, fsrules.SocketIdentity] | None = None
        try:
            for descriptor in passed:
                if use and chosen is None and descriptor.name == activation.LISTENER_NAME:
                    assert self._directoryFd is not None
                    chosen = activation.check_listener(
                        descriptor.fd, self._directoryFd, self.directory, expectedUid
                    )
                elif descriptor.name != activation.LISTENER_NAME:
                    self.log.warn(
                        "hostpid-broker: passed descriptor {fd} named {name!r} is not the "
                        "broker's listener; closed", fd=descriptor.fd, name=descriptor.name,
                    )
        except BaseException:
            if chosen is not None:
                chosen[0].close()
            raise
        finally:
            for descriptor in passed:
                os.close(descriptor.fd)
        if chosen is not None:
            self.listenerKept = True
            self.log.info(
                "hostpid-broker: listener passed by systemd (socket activation or descriptor "
                "store): {path}, inode {inode}", path=self.socketPath, inode=chosen[1].inode,
            )
        return chosen

    def _storeListener(self, stored: bool) -> None:
        """Give systemd's descriptor store a copy of the listener, where there is one."""
        environ = os.environ if self._environ is None else self._environ
        if stored or self.port is None or not activation.store_enabled(environ):
            return
        try:
            activation.store(self.port.socket, environ)
        except OSError as e:
            self.log.warn(
                "hostpid-broker: cannot store the listener with systemd ({error}): a restart "
                "will leave a gap", error=e.strerror,
            )
            return
        self.listenerKept = True
        self.log.info(
            "hostpid-broker: listener stored with systemd (FDSTORE=1, FDNAME={name}): "
            "it outlives a restart", name=activation.LISTENER_NAME,
        )

    def _askForHandover(self, held: fsrules.LockHeld, expectedUid: int) -> handover.Takeover:
        """
        The lock is held: ask the running broker for its listener and lock,
        or refuse as before, saying why the handover did not happen.
        """
        assert self._directoryFd is not None
        try:
            takeover = handover.take_over(self._directoryFd, self.directory, expectedUid)
        except handover.HandoverFailed as e:
            raise fsrules.LockHeld(held.path, f"{held.rule}; no handover: {e}") from None
        except OSError as e:
            raise fsrules.LockHeld(
                held.path, f"{held.rule}; no handover: {e.strerror or e}"
            ) from None
        self.log.info(
            "hostpid-broker: lock held by PID {pid}: it handed over its listener and lock "
            "(socket inode {inode}, the same file){kept}",
            pid=takeover.peerPid, inode=takeover.identity.inode,
            kept="; systemd keeps the listener too" if takeover.kept else "",
        )
        if takeover.kept:
            # systemd passes it again at the next start: leave the path in place.
            self.listenerKept = True
        return takeover

    def whenSettled(self) -> Deferred[None]:
        """
        Fires once this broker's serving is its own: at once, or, while it
        takes over from a running broker, when that one has said it stopped
        accepting (or the handover ended otherwise).
        """
        if self._takeover is None:
            return succeed(None)
        settled: Deferred[None] = Deferred()
        self._settling.append(settled)
        return settled

    def _settled(self) -> None:
        settling, self._settling = self._settling, []
        for settled in settling:
            settled.callback(None)

    def _completeTakeover(self, expectedUid: int) -> None:
        takeover, self._takeover = self._takeover, None
        if takeover is None:  # stopped meanwhile: stopService settled its waiters
            return

        def done(problem: str | None) -> None:
            if problem is None:
                self.log.info(
                    "hostpid-broker: handover complete: PID {pid} stopped accepting",
                    pid=takeover.peerPid,
                )
            else:
                self.log.warn(
                    "hostpid-broker: handover: {problem} (serving regardless)", problem=problem
                )
            if self.running and not self.failed:
                self._openControl(expectedUid)
            self._settled()

        handover.complete(takeover, self.reactor, done)

    def _openControl(self, expectedUid: int) -> None:
        """Listen for a newer broker's handover request (never fatal)."""
        assert self._directoryFd is not None
        control = handover.ControlListener(
            self._directoryFd, self.directory, expectedUid, self.reactor,
            self._offer, self._handOver,
        )
        problem = control.open()
        if problem is not None:
            self.log.warn(
                "hostpid-broker: no handover control socket ({problem}): a new broker will "
                "have to wait for this one to stop", problem=problem,
            )
            return
        self.control = control
        self.log.info("hostpid-broker: handover control socket: {path}", path=control.path)

    def _offer(self) -> handover.Offer | str:
        """What to hand over: only while serving."""
        port = self.port
        if not self.ready() or port is None or port.identity is None or self._lockFd is None:
            return "this broker is not serving"
        return handover.Offer(port.fileno(), self._lockFd, port.identity, kept=self.listenerKept)

    def _handOver(self, pid: int) -> None:
        """A new broker accepts on the listener: stop accepting, keep the path, stop."""
        self.handedOver = True
        self._markReady(False)
        self.control = None
        if self._watch is not None and self._watch.running:
            self._watch.stop()
        if self.port is not None:
            self.port.handOverPath()
        self.log.info(
            "hostpid-broker: handed over to PID {pid}: it accepts on the socket now; "
            "answering what this broker accepted, then exiting", pid=pid,
        )
        for observer in self.handOverObservers:
            observer(pid)
        self.onHandedOver()

    def _logClosesBounded(self) -> None:
        """Mode received: say whether a close that would linger can be cut short."""
        passed = self.factory.passed if self.factory is not None else None
        if passed is None:
            return
        watch = passed.closer.watch
        if watch.active:
            self.log.info(
                "hostpid-broker: closes are bounded: passed descriptors are never installed "
                "here; connections carrying them are drained by a disposer process (waits "
                "interrupted within a few ms, a disposer stuck in one that ignores signals "
                "abandoned after {stuck}s); the broker's own closes are interrupted after about "
                "{bound:.0f} ms (signal {signum}, at most {most} times a close)",
                stuck=passed.closer.stuckAfter, bound=2000 * watch.pollBusy,
                signum=int(watch.signum), most=INTERRUPTS_PER_CLOSE,
            )
            if watch.sharedTable is not None:
                self.log.warn(
                    "hostpid-broker: the close watchdog shares the descriptor table ({reason}): "
                    "every system call on a descriptor costs the reactor thread more",
                    reason=watch.sharedTable,
                )
        else:
            self.log.warn(
                "hostpid-broker: the broker's own closes cannot be interrupted ({reason}): "
                "passed descriptors are still closed by a disposer process, but in-flight "
                "garbage freed in the reactor thread (kernels before 6.10) is not bounded",
                reason=watch.reason,
            )
        if not passed.hasRoom():
            self.log.warn(
                "hostpid-broker: RLIMIT_NOFILE {limit} leaves no room for a full SCM_RIGHTS "
                "message: every request is read by peeking first (two system calls)",
                limit=passed.descriptorLimit,
            )

    def _prepareNode(self) -> None:
        """Run L{prepareNode}; its refusal is the broker's startup refusal."""
        if self.prepareNode is None:
            return
        try:
            self.prepareNode(self.enabled)
        except fsrules.BrokerStartupError:
            raise
        except PathRuleError as e:
            raise fsrules.BrokerStartupError(e.path, e.rule) from e

    def socketPathProblem(self) -> str | None:
        """
        Is the socket path still the socket we listen on?  Say what is wrong
        with it, or C{None}.  Looks only; changes nothing.
        """
        if self.port is None or self.port.identity is None or self._directoryFd is None:
            return "not listening"
        info = fsrules.identify_socket(self._directoryFd)
        if info is None:
            return "the socket was removed while the broker was serving"
        if not self.port.identity.matches(info):
            kind = "another socket" if stat.S_ISSOCK(info.st_mode) else "another file"
            return (
                f"the socket was replaced by {kind} (UID {info.st_uid}) while the broker "
                "was serving; the newcomer is left untouched"
            )
        return None

    def ready(self) -> bool:
        """
        Serving: enabled, listening, not failed, the path still ours, and
        accepting (not paused for L{port.PAUSE_REPORTED_AFTER} or more).
        """
        return (
            self.enabled and self.listening and not self.failed
            and self.servingProblem() is None
        )

    def servingProblem(self) -> str | None:
        """What keeps a listening broker from serving now, or C{None}."""
        problem = self.socketPathProblem()
        if problem is None and self.port is not None:
            problem = self.port.pauseProblem()
        return problem

    def checkSocketPath(self) -> str | None:
        """
        The periodic watch: if someone removed or replaced the socket path,
        clients can no longer reach this broker, so fail (leaving whatever is
        there now untouched).

        @return: the problem found, or C{None}.
        """
        if not self.listening:
            return None
        self.mountpointWatch.check()
        passed = self.factory.passed if self.factory is not None else None
        if passed is not None:
            passed.closer.watch.checkHandler()
        problem = self.socketPathProblem()
        if problem is not None:
            self._fail(problem)
        return problem

    def _listenerFailed(self, reason: Failure) -> None:
        self._fail(f"the listening socket failed: {reason.getErrorMessage()}")

    def _fail(self, problem: str) -> None:
        if self.failed:
            return
        self.failed = True
        self.log.critical(
            "hostpid-broker: {path}: {problem}; exiting so the supervisor restarts the broker",
            path=self.socketPath, problem=problem,
        )
        if self._watch is not None and self._watch.running:
            self._watch.stop()
        self._markReady(False)
        if self.listenerKept:
            # A stored listener no longer matches the path: the next start
            # must bind anew, not be handed what it would refuse.  (It is
            # still closed without a shutdown: systemd may hold it too.)
            environ = os.environ if self._environ is None else self._environ
            if activation.store_enabled(environ):
                try:
                    activation.remove_stored(environ)
                except OSError:
                    pass
        self.onFatal()

    def stopService(self) -> Deferred[None] | None:
        """
        Answer what waits in the queue in one last turn (unless the listener
        was handed over: the new broker accepts it), stop accepting, let
        transactions in flight end (each within its deadline), then release
        the lock.  Stopping twice is harmless.
        """
        if not self.running:
            return None
        super().stopService()
        if self._watch is not None and self._watch.running:
            self._watch.stop()
        self._watch = None
        self._markReady(False)
        control, self.control = self.control, None
        if control is not None:
            control.close()
        if self._takeover is not None:
            self._takeover.connection.close()
            self._takeover = None
        self._settled()
        port, factory = self.port, self.factory
        if port is None or factory is None:
            self._release()
            return None
        if self.listenerKept and not self.handedOver:
            # systemd keeps the listener for the next start: connections made
            # meanwhile wait in its queue.  Neither remove the path nor shut
            # the socket down.
            port.handOverPath()
        self.log.info("hostpid-broker: stopping: {path}", path=self.socketPath)
        if not self.handedOver:
            port.acceptQueued()
        stopped: Deferred[None] = maybeDeferred(port.stopListening)

        def portClosed(_: object) -> Deferred[None]:
            if self.handedOver:
                self.log.info(
                    "hostpid-broker: socket left to the broker that took over: {path}",
                    path=self.socketPath,
                )
            elif self.listenerKept:
                self.log.info(
                    "hostpid-broker: socket left in place: systemd keeps the listener for "
                    "the next start: {path}", path=self.socketPath,
                )
            elif port.removed:
                self.log.info("hostpid-broker: socket removed: {path}", path=self.socketPath)
            else:
                self.log.warn(
                    "hostpid-broker: socket left in place: {path} is no longer the socket "
                    "this broker created",
                    path=self.socketPath,
                )
            idle: Deferred[None] = Deferred()
            factory.whenIdle(lambda: idle.callback(None))
            return idle

        def released(result: object) -> object:
            self._release()
            self.log.info("hostpid-broker: stopped; lock released")
            return result

        stopped.addCallback(portClosed)
        stopped.addBoth(released)
        return stopped

    def _release(self) -> None:
        """Close the lock (releasing it), then the directory.  Idempotent."""
        lockFd, self._lockFd = self._lockFd, None
        directoryFd, self._directoryFd = self._directoryFd, None
        for fd in (lockFd, directoryFd):
            if fd is not None:
                os.close(fd)
