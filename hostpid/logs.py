"""
Log output choices for twistd.

C{twistd --logger hostpid.logs.json_lines ...} writes every log event as one
JSON object per line on standard output (Twisted's event format, with the
structured fields such as C{path}, C{outcome} and C{count}), for collectors
that parse logs rather than read them.
"""

from __future__ import annotations

import sys

from twisted.logger import ILogObserver, jsonFileLogObserver


def json_lines() -> ILogObserver:
    """A twistd C{--logger} factory: JSON lines on standard output."""
    return jsonFileLogObserver(sys.stdout, recordSeparator="")
