"""
Reload by handover under systemd: C{systemctl reload} without a gap.

C{systemctl restart} cannot overlap two brokers of one unit: systemd starts
the new process only once the old one has exited, so connections made in
between wait in the kept listener's queue for one interpreter start.  A
reload can overlap them.  The unit's C{ExecReload=} sends C{SIGHUP} to the
broker (its main process), and the broker then:

  1. starts a new broker from the installed files, with its own command line
     and environment (C{sys.orig_argv}; its output goes where this one's
     does, systemd's journal), as a child of its own, so in the unit's
     cgroup;
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
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from hostpid.broker.sdnotify import NOTIFY_SOCKET, ReadinessNotifier

#: Seconds a new broker has, from its start, to take over or exit.  A
#: Python start and one handover (L{hostpid.broker.handover.TIMEOUT}, 5 s)
#: take well under this even under emulation.
RELOAD_TIMEOUT = 60.0


class _NewBroker(ProcessProtocol):
    """The new broker's exit, as the reactor reaps it."""

    def __init__(self, ended: Callable[[int | None], None]) -> None:
        self.ended = ended

    def processEnded(self, reason: Failure) -> None:
        self.ended(getattr(reason.value, "exitCode", None))


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
        #: The new broker of the reload under way, and its bound.
        self.pid: int | None = None
        self._process: Any = None
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
        process = self.reactor.spawnProcess(
            _NewBroker(self._ended), self.argv[0], self.argv, env=dict(self._environ),
            childFDs={0: 0, 1: 1, 2: 2},
        )
        self._process = process
        self.pid = process.pid
        self._timer = self.reactor.callLater(self.timeout, self._expired)
        self.log.info(
            "hostpid-broker: reload: started PID {pid} from the installed files to take over",
            pid=self.pid,
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
        if pid != self.pid:
            return
        self._cancel()
        self.notifier.passMainPid(pid)

    def _ended(self, status: int | None) -> None:
        pid, self.pid, self._process = self.pid, None, None
        self._cancel()
        if not self.broker.handedOver:
            self.log.warn(
                "hostpid-broker: reload failed: PID {pid} exited (status {status}) without "
                "taking over; its output says why; this broker keeps serving",
                pid=pid, status=status,
            )

    def _expired(self) -> None:
        self._timer = None
        if self._process is not None and not self.broker.handedOver:
            self.log.warn(
                "hostpid-broker: reload: PID {pid} did not take over within {timeout}s; "
                "killed", pid=self.pid, timeout=self.timeout,
            )
            try:
                self._process.signalProcess("KILL")
            except ProcessExitedAlready:
                pass

    def _cancel(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
