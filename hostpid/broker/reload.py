"""
Reload by handover under systemd: C{systemctl reload} without a gap.

C{systemctl restart} cannot overlap two brokers of one unit: systemd starts
the new process only once the old one has exited, so connections made in
between wait in the kept listener's queue for one interpreter start.  A
reload can overlap them.  The unit's C{ExecReload=} sends C{SIGHUP} to the
broker (its main process), and the broker then:

  1. starts a new broker from the installed files, with its own command line
     and environment (C{sys.orig_argv}; its output goes where this one's
     does, systemd's journal), in the unit's cgroup, through a launcher that
     exits at once so that systemd becomes its parent (L{_LAUNCHER});
  2. hands it the listener and lock over the control socket when it asks
     (L{hostpid.broker.handover}): both accept on the same socket for a
     moment, and there is no instant without an accepting listener;
  3. before telling it C{RELEASED}, tells systemd C{MAINPID=} the new
     broker's PID.  systemd accepts that from the main process
     (C{NotifyAccess=main}) and reads notifications before exits
     (C{EVENT_PRIORITY_NOTIFY} is above C{EVENT_PRIORITY_SIGCHLD} in
     systemd's C{src/core/manager.c}), so the old broker's exit is no longer
     the service's, and the unit stays active;
  4. answers what it accepted and exits 0.  The new broker tells systemd
     C{READY=1} only once it has heard C{RELEASED}, so as the main process.

A new broker that fails (the new version refuses to start, the handover is
refused) exits and says why in its one line; this broker keeps serving and
logs the reload as failed.  One that neither takes over nor exits within
L{RELOAD_TIMEOUT} is killed.  One reload at a time.

Only under a service manager (C{$NOTIFY_SOCKET} set): elsewhere (a container,
a terminal) nothing would follow the new main PID, and C{SIGHUP} keeps its
default meaning.  A reload keeps the running broker's command line and
environment: options and the gate change with a restart.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application.service import Service
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid.broker.sdnotify import NOTIFY_SOCKET, ReadinessNotifier

#: Seconds a new broker has, from its start, to take over or exit.  A
#: Python start and one handover (L{hostpid.broker.handover.TIMEOUT}, 5 s)
#: take well under this even under emulation.
RELOAD_TIMEOUT = 60.0

#: The descriptor the launcher reports the new broker's PID on.
_REPORT_FD = 3

#: Starts the new broker as its own child and exits at once, so that the
#: new broker is re-parented to systemd (PID 1) long before it is passed
#: the main PID.  systemd marks a main PID whose parent is not systemd
#: "alien" ("Supervising process N which is not our child") and, stopping
#: the unit, does not wait for an alien main process after SIGTERM: it sends
#: SIGKILL at once (seen under systemd 252), which would cut the stop's last
#: answers and end the unit with result "signal".  Standard library only,
#: run isolated (C{-I -S}); the report descriptor is not inherited.
_LAUNCHER = f"""
import os, sys
os.set_inheritable({_REPORT_FD}, False)
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.stderr.write("hostpid-broker: reload: cannot run %s: %s\\n" % (sys.argv[1], e.strerror))
    os._exit(127)
os.write({_REPORT_FD}, b"%d\\n" % pid)
os._exit(0)
"""


class _Launcher(ProcessProtocol):
    """The launcher: the new broker's PID it reports, then its own exit."""

    def __init__(self, launched: Callable[[int | None], None]) -> None:
        self.launched = launched
        self.report = b""

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == _REPORT_FD:
            self.report += data[:32]

    def processEnded(self, reason: Failure) -> None:
        try:
            pid: int | None = int(self.report.strip())
        except ValueError:
            pid = None
        self.launched(pid)


class _Exit:
    """A pidfd in the reactor: readable once the process it names has exited."""

    def __init__(self, reactor: Any, pidfd: int, ended: Callable[[], None]) -> None:
        self.reactor = reactor
        self.pidfd = pidfd
        self.ended = ended
        reactor.addReader(self)

    def fileno(self) -> int:
        return self.pidfd

    def logPrefix(self) -> str:
        return "hostpid-reload"

    def doRead(self) -> None:
        self.close()
        self.ended()

    def connectionLost(self, reason: Failure) -> None:
        self.close()

    def kill(self) -> None:
        """SIGKILL the very process (a pidfd cannot name a reused PID)."""
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.pidfd >= 0:
            self.reactor.removeReader(self)
            os.close(self.pidfd)
            self.pidfd = -1


class Reloader(Service):
    """
    C{SIGHUP}: start a new broker that takes over, and pass it the main PID.

    @param broker: the L{hostpid.broker.service.BrokerService} to hand over.
    @param notifier: tells systemd C{MAINPID=} (and, after that, no
        C{STOPPING=1} for this process, which is no longer the service's).
    @param argv: the new broker's command line; default, this process's own.
    """

    log = Logger()

    def __init__(
        self,
        broker: Any,
        notifier: ReadinessNotifier,
        reactor: Any = None,
        environ: Mapping[str, str] | None = None,
        argv: list[str] | None = None,
        timeout: float = RELOAD_TIMEOUT,
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor as _reactor

            reactor = _reactor
        self.broker = broker
        self.notifier = notifier
        self.reactor = reactor
        self.environ = environ
        self.argv = argv if argv is not None else [sys.executable, *sys.orig_argv[1:]]
        self.timeout = timeout
        #: The new broker of the reload under way (0 while it is launched),
        #: its exit as the reactor sees it, and its bound.
        self.pid: int | None = None
        self._exit: _Exit | None = None
        self._timer: IDelayedCall | None = None
        self._previous: Any = None

    @property
    def _environ(self) -> Mapping[str, str]:
        return os.environ if self.environ is None else self.environ

    def startService(self) -> None:
        super().startService()
        if not self._environ.get(NOTIFY_SOCKET):
            return
        self.broker.handOverObservers.append(self._handingOver)
        self._previous = signal.signal(
            signal.SIGHUP, lambda signum, frame: self.reactor.callFromThread(self.reload)
        )

    def stopService(self) -> None:
        super().stopService()
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._previous)
            self._previous = None

    def reload(self) -> None:
        """Start a new broker to take over, unless one is under way or none can."""
        if self.pid is not None:
            self.log.warn(
                "hostpid-broker: reload ignored: PID {pid} is still taking over", pid=self.pid
            )
            return
        problem = self._problem()
        if problem is not None:
            self.log.warn("hostpid-broker: reload ignored: {problem}", problem=problem)
            return
        try:
            self.reactor.spawnProcess(
                _Launcher(self._launched), sys.executable,
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, *self.argv],
                env=dict(self._environ), childFDs={0: 0, 1: 1, 2: 2, _REPORT_FD: "r"},
            )
        except OSError as e:
            self.log.warn("hostpid-broker: reload failed: cannot start a process ({error})",
                          error=e.strerror)
            return
        self.pid = 0  # launching
        self._timer = self.reactor.callLater(self.timeout, self._expired)

    def _launched(self, pid: int | None) -> None:
        if pid is None:
            self._end()
            self.log.warn("hostpid-broker: reload failed: the new broker could not be started")
            return
        self.pid = pid
        try:
            self._exit = _Exit(self.reactor, os.pidfd_open(pid), self._ended)
        except ProcessLookupError:
            self._ended()
            return
        except OSError as e:
            # Not watched: only the bound ends this reload if it fails.
            self.log.warn("hostpid-broker: reload: cannot watch PID {pid} ({error})",
                          pid=pid, error=e.strerror)
        self.log.info(
            "hostpid-broker: reload: started PID {pid} from the installed files to take over",
            pid=pid,
        )

    def _problem(self) -> str | None:
        broker = self.broker
        if not broker.running or not broker.enabled:
            return "this broker is disabled and holds nothing to hand over; restart it instead"
        if broker.handedOver:
            return "this broker has already handed over"
        if broker.control is None or not broker.ready():
            return "this broker is not serving with a handover control socket"
        return None

    def _handingOver(self, pid: int) -> None:
        """The handover's last step: a reload's new broker becomes systemd's main process."""
        if not pid or pid != self.pid:
            return
        self._end()
        self.notifier.passMainPid(pid)

    def _ended(self) -> None:
        pid = self.pid
        self._end()
        if not self.broker.handedOver:
            self.log.warn(
                "hostpid-broker: reload failed: PID {pid} exited without taking over; its "
                "output says why; this broker keeps serving", pid=pid,
            )

    def _expired(self) -> None:
        self._timer = None
        if self.broker.handedOver:
            return
        self.log.warn(
            "hostpid-broker: reload: PID {pid} did not take over within {timeout}s; killed",
            pid=self.pid, timeout=self.timeout,
        )
        if self._exit is not None:
            self._exit.kill()
        self._end()

    def _end(self) -> None:
        """No reload under way any more: a later SIGHUP may start one."""
        self.pid = None
        exit, self._exit = self._exit, None
        if exit is not None:
            exit.close()
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
