"""
A refused start, as an operator and a supervisor see it.

Every expected refusal (a L{PathRuleError}: the broker's filesystem and
namespace rules, the lock parent, an option or endpoint the broker cannot
use) becomes one line on the process's standard error::

    hostpid-broker: cannot start: PATH: RULE

alone, with no timestamp and no traceback, and the process exits with
status 1.  The log keeps its own record of the same refusal.

Standard error, not the log, because under C{twistd} the log is standard
output (with C{--nodaemon}) and C{sys.stderr} itself is redirected into the
log: a plain C{SystemExit("message")} would come out on standard output,
timestamped, after several lines of startup chatter, where neither
C{systemctl status} nor C{kubectl describe} shows it as the reason.  So the
line goes to the stream the process was started with (C{sys.__stderr__}).

C{twistd hostpid-broker} uses L{RefuseInOneLine} as its top service; a
larger application embedding L{hostpid.broker.service.BrokerService} uses it
the same way, or L{refuse_in_one_line} around its own start-up code, or
L{refusal_line} to word the refusal itself (C{docs/embedding.md}).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from twisted.application.service import MultiService
from twisted.logger import Logger

from hostpid.errors import PathRuleError

__all__ = ["REFUSED_EXIT_STATUS", "RefuseInOneLine", "refusal_line", "refuse_in_one_line"]

#: The exit status of a refused start.
REFUSED_EXIT_STATUS = 1

_PREFIX = "hostpid-broker: cannot start: "

_log = Logger()


def refusal_line(error: BaseException) -> str | None:
    """
    The one line that reports C{error} as a refused start
    (C{hostpid-broker: cannot start: PATH: RULE}), or C{None} when C{error}
    is not an expected refusal (a bug, which deserves its traceback).
    """
    if isinstance(error, PathRuleError):
        return f"{_PREFIX}{error}"
    return None


def _write_line(line: str, stream: TextIO | None) -> None:
    target = stream if stream is not None else sys.__stderr__
    if target is None:  # no standard error at all (an embedding without one)
        os.write(2, f"{line}\n".encode(errors="replace"))
        return
    target.write(f"{line}\n")
    target.flush()


@contextmanager
def refuse_in_one_line(stream: TextIO | None = None) -> Iterator[None]:
    """
    Turn an expected refusal raised inside the block into its one line on
    C{stream} (default: the process's original standard error), a log
    record, and C{SystemExit(1)}.  Anything else passes through untouched.

    @raise SystemExit: with L{REFUSED_EXIT_STATUS}, after a refusal.
    """
    try:
        yield
    except PathRuleError as error:
        line = refusal_line(error)
        assert line is not None
        # Level error, not critical: before twistd begins logging, Twisted
        # copies critical events to stderr, which must carry the line alone.
        _log.error("{refusal}", refusal=line, path=error.path, rule=error.rule)
        _write_line(line, stream)
        raise SystemExit(REFUSED_EXIT_STATUS) from None


class RefuseInOneLine(MultiService):
    """
    A L{MultiService} whose children's refusals to start end the process
    with one line on standard error (L{refuse_in_one_line}) instead of a
    traceback in the log.

    twistd calls C{privilegedStartService} (where endpoint services bind)
    and then C{startService}; both are covered.  Children start in the
    order they were added: those before the one that refuses have started,
    those after it have not, and twistd stops none of them, since the
    process exits before the reactor runs.
    """

    def privilegedStartService(self) -> None:
        with refuse_in_one_line():
            super().privilegedStartService()

    def startService(self) -> None:
        with refuse_in_one_line():
            super().startService()
