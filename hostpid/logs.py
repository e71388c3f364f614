"""
Log output as JSON lines, for the collectors that parse logs rather than
read them (Fluent Bit, Vector, Loki, Elastic).

C{twistd hostpid-broker --log-format json} writes every log event as one
JSON object per line, to the destination twistd would write its text log
to (standard output with C{--nodaemon}, else C{--logfile}), with::

    {"time": "2026-12-03T17:24:43.123456Z", "level": "info",
     "logger": "hostpid.broker.service", "message": "hostpid-broker: listening on ...",
     "path": "/var/run/hami/hostpid/broker.sock", ...}

C{time} is RFC 3339 in UTC, C{level} Twisted's level name (C{debug},
C{info}, C{warn}, C{error}, C{critical}), C{logger} the event's namespace,
C{message} the text a text log would show; then the event's own structured
fields (C{path}, C{outcome}, C{count}, ...), a value JSON cannot hold as its
C{repr}.  C{system} and C{traceback} appear when the event has them.

L{json_record} decides the object (pure); L{JSONLinesObserver} writes it.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import IO, Any

import attrs
from twisted.logger import ILogObserver, LogLevel, formatEvent, textFileLogObserver
from twisted.python import logfile
from twisted.python.failure import Failure
from zope.interface import implementer

from hostpid.errors import PathRuleError

#: The values of C{--log-format}.
LOG_FORMATS = ("text", "json")

#: The keys the record itself defines: an event field of the same name is kept as
#: C{field_NAME} rather than overwrite them.
RESERVED = frozenset({"time", "level", "logger", "message", "system", "traceback"})

#: The keys C{twisted.python.log} (the legacy API, which twistd itself and some of
#: Twisted still use) adds beside the new-style ones: repeats of what the record already
#: says (C{message} is the text as a tuple, C{time} the timestamp, C{failure} the
#: traceback), dropped from a legacy event.
LEGACY_KEYS = frozenset({"message", "time", "isError", "system", "format", "why", "failure",
                         "logLevel", "printed"})


def _rfc3339(timestamp: object) -> str:
    """C{timestamp} in RFC 3339, UTC; now, for an event without a usable time."""
    if not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp):
        timestamp = time.time()
    moment = datetime.fromtimestamp(timestamp, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _level(event: Mapping[str, Any]) -> str:
    level = event.get("log_level")
    return level.name if isinstance(level, type(LogLevel.info)) else "info"


def _json_safe(value: object) -> object:
    """C{value} if JSON holds it exactly (no NaN, no odd keys), else its C{repr}."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)
    return value


def _legacy(event: Mapping[str, Any]) -> bool:
    return "isError" in event and "message" in event


def json_record(event: Mapping[str, Any]) -> dict[str, object]:
    """
    The JSON object for one log event: C{time}, C{level}, C{logger},
    C{message}, then the event's own fields.  Twisted's private C{log_*}
    keys appear only as mapped (C{log_time}, C{log_level}, C{log_namespace},
    C{log_format}, C{log_system}, C{log_failure}).
    """
    legacy = _legacy(event)
    message = formatEvent(dict(event))
    failure = event.get("log_failure")
    if failure is None and legacy and isinstance(event.get("failure"), Failure):
        failure = event["failure"]
    if not message and failure is not None:
        message = failure.getErrorMessage()
    record: dict[str, object] = {
        "time": _rfc3339(event.get("log_time")),
        "level": _level(event),
        "logger": str(event.get("log_namespace") or "-"),
        "message": message,
    }
    system = event.get("log_system")
    if system is not None and system != "-":
        record["system"] = str(system)
    if failure is not None:
        try:
            record["traceback"] = failure.getTraceback()
        except Exception:  # a failure that cannot even print itself
            record["traceback"] = repr(failure)
    for key, value in event.items():
        key = str(key)
        if key.startswith("log_") or (legacy and key in LEGACY_KEYS):
            continue
        record[f"field_{key}" if key in RESERVED else key] = _json_safe(value)
    return record


def json_line(event: Mapping[str, Any]) -> str:
    """One event as one line of JSON (no newline inside: JSON escapes them)."""
    return json.dumps(json_record(event), allow_nan=False, separators=(",", ":"))


@implementer(ILogObserver)
@attrs.define
class JSONLinesObserver:
    """
    Writes each event as a JSON line to C{file} and flushes, so a line is
    whole in the file as soon as the event happened (a collector tails it;
    a crash loses nothing already logged).
    """

    file: IO[str]

    def __call__(self, event: Mapping[str, Any]) -> None:
        self.file.write(json_line(event) + "\n")
        self.file.flush()


def _rotate_on_sigusr1(log: logfile.LogFile) -> None:
    """What twistd does for its own log file: rotate on C{SIGUSR1}, unless taken."""
    if signal.getsignal(signal.SIGUSR1):
        return

    def rotate(signum: int, frame: object) -> None:
        from twisted.internet import reactor

        reactor.callFromThread(log.rotate)  # type: ignore[attr-defined]

    signal.signal(signal.SIGUSR1, rotate)


#: Rotated log files kept beside the one written (C{--log-files}).  twistd's
#: own C{--logfile} rotates at 1 MB (C{twisted.python.logfile.LogFile}'s
#: C{rotateLength}) and keeps every rotated file (its C{maxRotatedFiles} is
#: None): a client that makes the server log, a webhook's pods or a broker's
#: refused callers, would fill the disk a megabyte at a time.
MAX_ROTATED_FILES = 5


def parse_log_files(value: Any) -> int:
    """C{--log-files}: a whole number from 1 to 1000; ValueError names what was given."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if not 1 <= count <= 1000:
        raise ValueError(f"must be a whole number from 1 to 1000, got {value!r}")
    return count


def _logs_to_standard_output(twistd_options: Mapping[str, Any]) -> bool:
    name = twistd_options.get("logfile")
    return name == "-" or (bool(twistd_options.get("nodaemon")) and not name)


def twistd_log_file(twistd_options: Mapping[str, Any] | None,
                    max_rotated: int = MAX_ROTATED_FILES) -> IO[str]:
    """
    The file twistd would write its text log to, chosen by the same rules:
    with C{--nodaemon} and no C{--logfile} (or C{--logfile -}), standard
    output; else C{--logfile} (default C{twistd.log}), rotated on
    C{SIGUSR1} and at 1 MB, as twistd does, but keeping at most
    C{max_rotated} rotated files (L{MAX_ROTATED_FILES}).  (Twisted:
    C{twisted/scripts/_twistd_unix.py}, C{UnixAppLogger._getLogObserver},
    which this follows.)  Standard output is the stream as it is now, before
    twistd redirects C{sys.stdout} into the log.

    @param twistd_options: twistd's own options (the plugin options'
        C{parent}); C{None} outside twistd: standard output.
    @raise PathRuleError: C{--syslog} (JSON has no place there), a daemon
        asked to log to standard output (as twistd itself refuses), or a log
        file that cannot be opened.
    """
    if twistd_options is None:
        return sys.stdout
    if twistd_options.get("syslog"):
        raise PathRuleError(
            "--log-format json",
            "writes JSON lines to twistd's log file or standard output; it cannot be combined "
            "with twistd --syslog (use --log-format text there)",
        )
    name = twistd_options.get("logfile")
    nodaemon = bool(twistd_options.get("nodaemon"))
    if _logs_to_standard_output(twistd_options):
        if not nodaemon:
            raise PathRuleError("--logfile -", "a daemon cannot log to standard output")
        return sys.stdout
    path = name or "twistd.log"
    try:
        log = logfile.LogFile.fromFullPath(path, maxRotatedFiles=max_rotated)
    except OSError as e:
        raise PathRuleError(path, f"cannot open the log file (--logfile): {e.strerror}") from None
    _rotate_on_sigusr1(log)
    return log


def observer(twistd_options: Mapping[str, Any] | None, log_format: str = "text",
             max_rotated: int = MAX_ROTATED_FILES) -> ILogObserver | None:
    """
    The observer a twistd plugin gives its application (the C{ILogObserver}
    component twistd logs through), or None to leave twistd's own: JSON
    lines wherever twistd would log (L{twistd_log_file}); text to a log
    file twistd's way but with at most C{max_rotated} rotated files; text to
    standard output or syslog, twistd's own.
    """
    if log_format == "json":
        return JSONLinesObserver(twistd_log_file(twistd_options, max_rotated))
    if (twistd_options is None or twistd_options.get("syslog")
            or _logs_to_standard_output(twistd_options)):
        return None
    return textFileLogObserver(twistd_log_file(twistd_options, max_rotated))


def json_lines() -> ILogObserver:
    """
    A twistd C{--logger} factory (C{twistd --logger hostpid.logs.json_lines
    ...}): the same JSON lines on standard output, for a twistd run of
    another plugin.  The broker's own spelling is C{--log-format json}.
    """
    return JSONLinesObserver(sys.stdout)
