"""
C{twistd hostpid-broker}: options and service construction, nothing more.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import IService, MultiService
from twisted.python import usage

from hostpid import defaults
from hostpid.fsrules import BrokerStartupError
from hostpid.service import BrokerService


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
         "Active transactions at most; a connection over the limit is closed at once.",
         _positive_int],
        ["deadline", None, defaults.DEADLINE,
         "One deadline per transaction, from accept to reply, in seconds.",
         _positive_float],
    ]


class _ExitOnStartupError(MultiService):
    """
    Turn a refused startup into one line on stderr and a non-zero exit,
    instead of a traceback: the message names the path and the rule broken.
    """

    def startService(self) -> None:
        try:
            super().startService()
        except BrokerStartupError as e:
            raise SystemExit(f"hostpid-broker: cannot start: {e}") from None


def makeService(options: Options | dict[str, Any]) -> IService:
    top = _ExitOnStartupError()
    BrokerService(
        directory=options["directory"],
        maxConnections=options["max-connections"],
        deadline=options["deadline"],
        allowNonHostPidNamespace=bool(options["allow-non-host-pid-namespace"]),
    ).setServiceParent(top)
    return top
