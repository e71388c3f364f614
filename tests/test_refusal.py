"""
L{hostpid.broker.refusal}: every expected refusal (any L{PathRuleError}) is
one line on standard error, a log record and exit status 1; anything else
passes through.  The real twistd runs are in
C{tests/integration/test_twistd_plugin.py} and C{test_embedding.py}.
"""

from __future__ import annotations

import fcntl
import io
import os
from pathlib import Path

import pytest
from twisted.application.service import MultiService, Service
from twisted.logger import LogEvent, globalLogPublisher

from hostpid.broker.fsrules import BrokerStartupError, LockHeld
from hostpid.broker.refusal import RefuseInOneLine, refusal_line, refuse_in_one_line
from hostpid.broker.service import BrokerService
from hostpid.errors import PathRuleError
from hostpid.node.lockparent import LockParentError

ENABLED = {"LIBVGPU_HOSTPID_BROKER": "1"}


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (BrokerStartupError("/d/broker.sock", "is a regular file"),
         "hostpid-broker: cannot start: /d/broker.sock: is a regular file"),
        (LockHeld("/d/broker.lock", "held by another broker"),
         "hostpid-broker: cannot start: /d/broker.lock: held by another broker"),
        (LockParentError("/tmp/vgpulock", "is a symlink"),
         "hostpid-broker: cannot start: unsafe lock parent: /tmp/vgpulock: is a symlink"),
        (PathRuleError("--metrics", "not an endpoint"),
         "hostpid-broker: cannot start: --metrics: not an endpoint"),
    ],
)
def test_every_path_rule_error_is_one_line(error: PathRuleError, line: str) -> None:
    assert refusal_line(error) == line
    stream = io.StringIO()
    events: list[LogEvent] = []
    globalLogPublisher.addObserver(events.append)
    try:
        with pytest.raises(SystemExit) as caught, refuse_in_one_line(stream):
            raise error
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert caught.value.code == 1
    assert stream.getvalue() == line + "\n"
    [record] = [e for e in events if e.get("refusal") == line]
    assert (record["path"], record["rule"], record["log_level"].name) == (
        error.path, error.rule, "error"
    )


def test_anything_else_passes_through() -> None:
    stream = io.StringIO()
    assert refusal_line(ValueError("x")) is None
    with pytest.raises(ValueError), refuse_in_one_line(stream):
        raise ValueError("a bug keeps its traceback")
    assert stream.getvalue() == ""


def test_default_stream_is_the_original_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit), refuse_in_one_line():
        raise BrokerStartupError("/d", "rule")
    assert capfd.readouterr().err == "hostpid-broker: cannot start: /d: rule\n"


def lock_is_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def refused_application(tmp_path: Path, top: MultiService) -> tuple[Service, Service, Service]:
    directory = tmp_path / "broker"
    directory.mkdir()
    directory.chmod(0o711)
    (directory / "broker.sock").write_text("not a socket")
    before, after = Service(), Service()
    broker = BrokerService(directory=str(directory), environ=ENABLED)
    for child in (before, broker, after):
        child.setServiceParent(top)
    return before, broker, after


def test_refused_start_in_a_multiservice(tmp_path: Path) -> None:
    """What docs/embedding.md says: the refusal propagates from startService."""
    top = MultiService()
    before, broker, after = refused_application(tmp_path, top)
    with pytest.raises(BrokerStartupError, match="is a regular file"):
        top.startService()
    assert (before.running, broker.running, after.running) == (1, False, 0)
    assert lock_is_free(tmp_path / "broker" / "broker.lock"), "nothing left half-started"
    top.stopService()
    assert not before.running


def test_refused_start_in_refuse_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    top = RefuseInOneLine()
    refused_application(tmp_path, top)
    with pytest.raises(SystemExit) as caught:
        top.startService()
    assert caught.value.code == 1
    assert capfd.readouterr().err == (
        f"hostpid-broker: cannot start: {tmp_path}/broker/broker.sock: is a regular file, "
        "not a socket; refusing to replace it (left untouched)\n"
    )
