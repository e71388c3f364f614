"""
A caller's PID given to another process before the broker looks: what each
liveness check answers, with a real PID reuse (C{ns_last_pid} in a new PID
namespace; see C{pidreuse.py}).

The attack on the liveness check without SO_PEERPIDFD: on a kernel without SO_PEERPIDFD, a
process connects, hands the connection on and exits; once its PID names
another process, SO_PEERCRED alone tells the connection's holder that
other process's PID.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import require_root, require_tool, subprocess_env

pytestmark = pytest.mark.kernel

HELPER = Path(__file__).with_name("pidreuse.py")


def reuse(case: str) -> dict[str, object]:
    require_root()
    argv = [require_tool("unshare"), "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL",
            sys.executable, str(HELPER), case]
    result = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout)
    return report


def test_pid_reused_after_the_accept_is_refused_by_every_check_but_none() -> None:
    """
    The PID is given to a process started a clock tick after the accept:
    the check without SO_PEERPIDFD refuses it by its start time (without the
    start time it would answer), SO_PEERPIDFD refuses it, and SO_PEERCRED
    alone answers with the new process's PID (the control: the reuse is real).
    """
    report = reuse("after-accept")
    checks = report["checks"]
    assert isinstance(checks, dict)
    assert checks["none"] == report["reused_pid"], "the control: SO_PEERCRED alone is fooled"
    assert checks["pidfd_open_without_start_time"] == report["reused_pid"]
    assert checks["pidfd_open"] == "peer_gone"
    if checks["peerpidfd_in_force"]:
        assert checks["peerpidfd"] == "peer_gone"


def test_pid_reused_before_the_accept_is_the_window_that_remains() -> None:
    """
    The documented limit (docs/security.md): a PID reused before the broker
    accepted the connection names a process that started before the accept,
    and only SO_PEERPIDFD (which refers to the very process that connected)
    tells it apart.
    """
    report = reuse("before-accept")
    checks = report["checks"]
    assert isinstance(checks, dict)
    assert checks["none"] == report["reused_pid"]
    assert checks["pidfd_open"] == report["reused_pid"], "if this now refuses, update the docs"
    if checks["peerpidfd_in_force"]:  # SO_PEERPIDFD (6.5+); before, nothing tells it apart
        assert checks["peerpidfd"] == "peer_gone"
