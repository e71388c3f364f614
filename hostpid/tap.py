"""
C{twistd hostpid-broker}: options and service construction, nothing more.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

from twisted.application.service import IService, IServiceCollection
from twisted.logger import ILogObserver
from twisted.python import usage
from twisted.python.components import Componentized

from hostpid import defaults, logs
from hostpid.broker.fsrules import BrokerStartupError
from hostpid.broker.refusal import RefuseInOneLine, refuse_in_one_line
from hostpid.broker.reload import Reloader
from hostpid.broker.sdnotify import ReadinessNotifier
from hostpid.broker.service import BrokerService
from hostpid.version import VersionOption

#: Bounds of the numeric options: beyond them a value is a typo, and far
#: beyond them it overflows the kernel's types.
MAX_CONNECTIONS_LIMIT = 1 << 20
MAX_DEADLINE = 3600.0


def _connections(option: str, value: object) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if not 1 <= number <= MAX_CONNECTIONS_LIMIT:
        raise BrokerStartupError(
            option, f"must be a whole number from 1 to {MAX_CONNECTIONS_LIMIT}, got {value!r}"
        )
    return number


def _seconds(option: str, value: object) -> float:
    try:
        number = float(str(value))
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and 0 < number <= MAX_DEADLINE):
        raise BrokerStartupError(
            option,
            f"must be a positive number of seconds, at most {MAX_DEADLINE:g}, got {value!r}",
        )
    return number


class Options(VersionOption, usage.Options):
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
         "slot of the oldest connection still waiting for its request from the peer "
         "(process) holding the most.",
         ],
        ["max-waiting-per-peer", None, None,
         "Connections still waiting for their request that one peer (process) may hold; "
         "beyond them its newcomers are closed at accept.  Default: a sixteenth of "
         "--max-connections (32 of 512), at least 1.",
         ],
        ["deadline", None, defaults.DEADLINE,
         "One deadline per transaction, from accept to reply, in seconds.",
         ],
        ["metrics", None, None,
         "Twisted endpoint string for the HTTP metrics and health server "
         "(/metrics, /healthz, /readyz), e.g. tcp:9394:interface=127.0.0.1.  Off by default.  "
         "It holds at most 16 connections, serves GET and HEAD only, and refuses request "
         "bodies."],
        ["cdi-dir", None, None,
         "Write the CDI spec (kind hami.io/hostpid) into this directory at startup, "
         "following the gate, after preparing the lock parent; e.g. /var/run/cdi.  Off by "
         "default."],
        ["lock-parent", None, defaults.LOCK_PARENT,
         "The host lock parent the CDI spec mounts at /tmp/vgpulock (with --cdi-dir)."],
        ["after-handover", None, "exit",
         "What this broker does once a newer one took its listener over: 'exit' (status 0; "
         "systemd, a process supervisor) or 'wait' (stop serving and idle until SIGTERM: a "
         "Kubernetes container that exited would be restarted and take the listener back)."],
        ["ready-file", None, None,
         "A file this broker creates once it holds the listener (bound, passed, or taken "
         "over) and removes when it stops or hands over, for a readiness check that must "
         "tell this broker from one it takes over from, e.g. /run/hostpid-ready/ready in a "
         "container's own emptyDir.  Off by default."],
        ["log-format", None, "text",
         "text (twistd's) or json: one JSON object per line with time (RFC 3339, UTC), "
         "level, logger, message and the event's own fields, where twistd writes its log "
         "(standard output with --nodaemon, else --logfile)."],
        ["log-files", None, logs.MAX_ROTATED_FILES,
         "Rotated log files kept beside --logfile (twistd rotates it at 1 MB and on SIGUSR1; "
         "by itself it keeps every one)."],
    ]

    def postOptions(self) -> None:
        """
        A bad value is refused now, before anything is created: one line on
        standard error naming the option (not twistd's usage text on stdout).
        """
        with refuse_in_one_line():
            self["max-connections"] = _connections("--max-connections", self["max-connections"])
            self["deadline"] = _seconds("--deadline", self["deadline"])
            if self["max-waiting-per-peer"] is not None:
                self["max-waiting-per-peer"] = _connections(
                    "--max-waiting-per-peer", self["max-waiting-per-peer"]
                )
            if self["metrics"]:
                from hostpid.broker.metricsport import parse_metrics_endpoint

                self.metricsEndpoint = parse_metrics_endpoint(self["metrics"])
            if self["after-handover"] not in ("exit", "wait"):
                raise BrokerStartupError(
                    "--after-handover", f"must be 'exit' or 'wait', got {self['after-handover']!r}"
                )
            try:
                self["log-files"] = logs.parse_log_files(self["log-files"])
            except ValueError as e:
                raise BrokerStartupError("--log-files", str(e)) from None
            if self["log-format"] not in logs.LOG_FORMATS:
                raise BrokerStartupError(
                    "--log-format",
                    f"must be one of {', '.join(logs.LOG_FORMATS)}, got {self['log-format']!r}",
                )


class _ExitOnStartupError(RefuseInOneLine):
    """
    The plugin's top service: a refused startup is one line on stderr and
    exit status 1 (L{RefuseInOneLine}), the metrics port's failed listen
    included (L{hostpid.broker.metricsport.MetricsEndpointService}), since twistd binds it in
    C{privilegedStartService}.

    @ivar logObserver: with C{--log-format json}, the observer twistd is to
        log through instead of its text one.
    """

    logObserver: ILogObserver | None = None

    def setServiceParent(self, parent: IServiceCollection) -> None:
        """
        twistd makes this service the child of its C{Application} and only
        then starts logging, through the application's L{ILogObserver}
        component when it has one (and no C{--logger} was given): that is
        the documented place for an application's own log observer
        (Twisted: C{twisted/application/app.py}, C{AppLogger.start}).
        """
        if self.logObserver is not None and isinstance(parent, Componentized):
            parent.setComponent(ILogObserver, self.logObserver)
        super().setServiceParent(parent)

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


def _specPublisher(options: Options | dict[str, Any]) -> Callable[[bool], None] | None:
    """C{--cdi-dir}: the node side's spec writer, run by the broker at every start."""
    directory = options.get("cdi-dir")
    if directory is None:
        return None
    from hostpid.node.cdiwrite import SpecPublisher

    return SpecPublisher(
        directory,
        lock_parent=options.get("lock-parent", defaults.LOCK_PARENT),
        broker_directory=options["directory"],
    )


def _logObserver(options: Options | dict[str, Any]) -> ILogObserver | None:
    """
    C{--log-format json}: JSON lines where twistd (the options' parent)
    logs; a text log file with at most C{--log-files} rotated files.
    """
    return logs.observer(getattr(options, "parent", None), options.get("log-format", "text"),
                         int(options.get("log-files", logs.MAX_ROTATED_FILES)))


def _makeService(options: Options | dict[str, Any]) -> IService:
    top = _ExitOnStartupError()
    top.logObserver = _logObserver(options)
    broker = BrokerService(
        directory=options["directory"],
        maxConnections=options["max-connections"],
        deadline=options["deadline"],
        maxPerPeer=options.get("max-waiting-per-peer"),
        allowNonHostPidNamespace=bool(options["allow-non-host-pid-namespace"]),
        prepareNode=_specPublisher(options),
        lockParent=options.get("lock-parent", defaults.LOCK_PARENT),
        readyFile=options.get("ready-file"),
    )
    if options.get("after-handover", "exit") == "wait":
        # Stop serving, but leave the process (and twistd's reactor) running
        # until the pod is deleted.
        broker.onHandedOver = broker.stopService
    if options["metrics"]:
        from hostpid.broker.metrics import metrics_site
        from hostpid.broker.metricsport import MetricsEndpointService, parse_metrics_endpoint

        description = options["metrics"]
        endpoint = getattr(options, "metricsEndpoint", None) or parse_metrics_endpoint(description)
        MetricsEndpointService(description, endpoint, metrics_site(broker)).setServiceParent(top)
    broker.setServiceParent(top)
    notifier = ReadinessNotifier(ready=broker.whenSettled)
    notifier.setServiceParent(top)
    Reloader(broker, notifier).setServiceParent(top)
    return top
