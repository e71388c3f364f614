"""
systemd readiness: C{sd_notify} without libsystemd.

With C{Type=notify}, systemd waits for C{READY=1} on the datagram socket
named by C{NOTIFY_SOCKET} before it considers the unit started, and shows
C{STOPPING=1} while it stops.  The protocol is one datagram per message; an
address starting with C{@} is in the abstract namespace.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

NOTIFY_SOCKET = "NOTIFY_SOCKET"


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """
    Send C{message} to systemd if C{NOTIFY_SOCKET} is set.

    @return: whether a notification was sent.
    @raise OSError: the socket is set but cannot be reached.
    """
    address = (os.environ if environ is None else environ).get(NOTIFY_SOCKET)
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.sendto(message.encode("utf-8"), address)
    return True


class ReadinessNotifier(Service):
    """
    Tells systemd C{READY=1} when started and C{STOPPING=1} when stopped.

    Put it in a L{MultiService} I{after} the broker: children start in order,
    so it runs once the broker listens (or has logged that it is disabled),
    and stop in reverse order, so systemd hears C{STOPPING=1} first.

    C{READY=1} waits until the reactor runs: twistd starts services before
    the reactor installs its signal handlers, and a SIGTERM in between would
    kill the process without a clean stop.  It also waits for C{ready}, if
    given: a broker that takes over from another is systemd's main process
    only once the other has passed it the main PID (L{passMainPid}), and
    systemd ignores (and logs) a notification from any other process of a
    C{NotifyAccess=main} unit.
    """

    log = Logger()

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        reactor: Any = None,
        ready: Callable[[], Deferred[None]] | None = None,
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor as _reactor

            reactor = _reactor
        self.environ = environ
        self.reactor = reactor
        self.ready = ready
        #: Set once this process passed the main PID on: it is no longer the
        #: service's, and its own stop is not the service's either.
        self.mainPidPassed = False

    def _send(self, message: str) -> bool:
        try:
            if notify(message, self.environ):
                self.log.info("hostpid-broker: told systemd {message}", message=message)
                return True
        except OSError as e:
            self.log.warn(
                "hostpid-broker: cannot notify systemd ({error})", error=e.strerror
            )
        return False

    def startService(self) -> None:
        super().startService()
        self.reactor.callWhenRunning(self._whenReady)

    def _whenReady(self) -> None:
        ready = succeed(None) if self.ready is None else self.ready()
        ready.addCallback(lambda _: self._send("READY=1") if self.running else None)

    def passMainPid(self, pid: int) -> None:
        """Tell systemd that C{pid} is the service's main process from now on."""
        self.mainPidPassed = self._send(f"MAINPID={pid}")

    def stopService(self) -> None:
        super().stopService()
        if not self.mainPidPassed:
            self._send("STOPPING=1")
