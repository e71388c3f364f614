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
from collections.abc import Mapping
from typing import Any

from twisted.application.service import Service
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
    kill the process without a clean stop.
    """

    log = Logger()

    def __init__(self, environ: Mapping[str, str] | None = None, reactor: Any = None) -> None:
        if reactor is None:
            from twisted.internet import reactor as _reactor

            reactor = _reactor
        self.environ = environ
        self.reactor = reactor

    def _send(self, message: str) -> None:
        try:
            if notify(message, self.environ):
                self.log.info("hostpid-broker: told systemd {message}", message=message)
        except OSError as e:
            self.log.warn(
                "hostpid-broker: cannot notify systemd ({error})", error=e.strerror
            )

    def startService(self) -> None:
        super().startService()
        self.reactor.callWhenRunning(self._send, "READY=1")

    def stopService(self) -> None:
        super().stopService()
        self._send("STOPPING=1")
