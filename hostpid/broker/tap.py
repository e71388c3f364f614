"""
C{twistd hostpid-broker}: options and service construction, nothing more.
"""

from __future__ import annotations

import gc
from typing import Any

from twisted.application import strports
from twisted.application.service import IService, MultiService
from twisted.internet.error import CannotListenError
from twisted.python import usage

from hostpid import defaults
from hostpid.broker.fsrules import BrokerStartupError
from hostpid.broker.refusal import RefuseInOneLine, refuse_in_one_line
from hostpid.broker.sdnotify import ReadinessNotifier
from hostpid.broker.service import BrokerService


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise ValueError(f"must be a positive number of seconds, got {value!r}")
    return number


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Serve the host PID broker: a Unix socket that tells each caller its own "
        "host PID, from SO_PEERCRED.  Enabled only when LIBVGPU_HOSTPID_BROKER is "
        "exactly \"1\"; otherwise the service runs and creates nothing.  Run it as "
        "`twistd --nodaemon --pidfile= hostpid-broker`."
    )
    optFlags = [
        ["allow-non-host-pid-namespace", None,
         "Serve even outside the kernel's initial PID namespace.  UNSAFE: the PIDs "
         "reported are then not host PIDs.  For tests; refused with the default directory."],
    ]
    optParameters = [
        ["directory", None, defaults.BROKER_DIRECTORY,
         "Broker directory; the socket and lock live inside.  The default "
         "requires root."],
        ["max-connections", None, defaults.MAX_CONNECTIONS,
         "Active transactions at most; when every slot is held, a newcomer takes the "
         "slot of the oldest connection still waiting for its request.",
         _positive_int],
        ["deadline", None, defaults.DEADLINE,
         "One deadline per transaction, from accept to reply, in seconds.",
         _positive_float],
        ["metrics", None, None,
         "Twisted endpoint string for the HTTP metrics and health server "
         "(/metrics, /healthz, /readyz), e.g. tcp:9394:interface=127.0.0.1.  Off by default."],
        ["cdi-dir", None, None,
         "Write the CDI spec (kind hami.io/hostpid) into this directory at startup, "
         "following the gate, after preparing the lock parent; e.g. /var/run/cdi.  Off by "
         "default."],
        ["lock-parent", None, defaults.LOCK_PARENT,
         "The host lock parent the CDI spec mounts at /tmp/vgpulock (with --cdi-dir)."],
    ]


class _ExitOnStartupError(RefuseInOneLine):
    """
    The plugin's top service: a refused startup is one line on stderr and
    exit status 1 (L{RefuseInOneLine}), the metrics port's
    C{CannotListenError} included, since twistd binds it here too.
    """

    def privilegedStartService(self) -> None:
        """twistd binds endpoint services (the metrics port) here, before startService."""
        with refuse_in_one_line():
            try:
                MultiService.privilegedStartService(self)
            except CannotListenError as e:
                raise BrokerStartupError("metrics endpoint", str(e)) from None

    def startService(self) -> None:
        super().startService()
        # Everything imported and built so far lives as long as the process.
        # Freezing it keeps the cyclic collector from walking those few
        # hundred thousand objects again and again: a full collection is a
        # pause of tens of milliseconds in which no caller is answered.
        gc.freeze()


def makeService(options: Options | dict[str, Any]) -> IService:
    """
    The metrics server (if asked for) first, so that a port conflict refuses
    startup before the broker creates its socket; then the broker; then the
    systemd notifier, which so runs once the broker listens.
    """
    with refuse_in_one_line():
        return _makeService(options)


def _makeService(options: Options | dict[str, Any]) -> IService:
    top = _ExitOnStartupError()
    broker = BrokerService(
        directory=options["directory"],
        maxConnections=options["max-connections"],
        deadline=options["deadline"],
        allowNonHostPidNamespace=bool(options["allow-non-host-pid-namespace"]),
        cdiDirectory=options.get("cdi-dir"),
        lockParent=options.get("lock-parent", defaults.LOCK_PARENT),
    )
    if options["metrics"]:
        from hostpid.broker.metrics import metrics_site

        strports.service(options["metrics"], metrics_site(broker)).setServiceParent(top)
    broker.setServiceParent(top)
    ReadinessNotifier().setServiceParent(top)
    return top
