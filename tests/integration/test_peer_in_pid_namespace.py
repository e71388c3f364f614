"""
Issue 20, C{peer-pid}: a listener inside the client's own private PID
namespace is not the host's broker, whatever it answers.

A real broker runs in a new PID namespace with the unsafe override
(C{--allow-non-host-pid-namespace}), so it answers PIDs of that namespace:
plausible numbers, wrong for NVML.  A client in the same namespace sees the
listener with a non-zero PID (the real broker, outside, would show as 0).
The Python client and the C contract client both refuse it with
C{peer-pid}, with the read-only-mount check turned off by name (the broker
directory is a plain directory here).  On the old code both printed the
namespace PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clienttools import build_c_client
from support import BrokerProcess, nspid, require_tool, subprocess_env, wait_for
from test_never_wrong_pid import in_new_pid_namespace

pytestmark = pytest.mark.privileged

QUERY = (
    "import os, sys\n"
    "from hostpid import TrustPolicy, HostPidUnavailable, query_host_pid\n"
    "policy = TrustPolicy(sys.argv[1]).without('read-only-mount')\n"
    "gate = {'LIBVGPU_HOSTPID_BROKER': '1'}\n"
    "try:\n"
    "    print('pid', os.getpid(), 'answer', query_host_pid(policy, gate))\n"
    "except HostPidUnavailable as problem:\n"
    "    print('pid', os.getpid(), 'refused', problem.check, '|', problem.observed)\n"
)


def test_listener_inside_the_callers_pid_namespace_is_refused(
    public_tmp: Path, tmp_path: Path
) -> None:
    nsenter = require_tool("nsenter")
    c_client = build_c_client(tmp_path)
    with BrokerProcess(
        public_tmp / "broker", ["--allow-non-host-pid-namespace"],
        argv_prefix=in_new_pid_namespace(),
    ) as broker:
        wait_for(lambda: "listening on" in broker.output(), "the broker to listen")
        twistd_pid = int(Path(f"/proc/{broker.pid}/task/{broker.pid}/children").read_text())
        assert nspid(twistd_pid)[-1] == 1, "the broker is PID 1 of its namespace"
        inside = [nsenter, f"--target={twistd_pid}", "--pid", "--"]
        env = subprocess_env(PYTHONPATH=os.pathsep.join(sys.path), LIBVGPU_HOSTPID_BROKER="1")
        python = subprocess.run(
            [*inside, sys.executable, "-c", QUERY, str(broker.socket_path)],
            env=env, capture_output=True, text=True, timeout=60,
        )
        c = subprocess.run(
            [*inside, str(c_client), "--socket", str(broker.socket_path),
             "--without", "read-only-mount"],
            env=env, capture_output=True, text=True, timeout=60,
        )
        os.kill(twistd_pid, signal.SIGTERM)
        broker.wait_exit()
    print(f"\n[peer-pid] python: {python.stdout.strip()!r}; C: {c.returncode} "
          f"{c.stdout.strip()!r} {c.stderr.strip()!r}")
    assert python.returncode == 0, python.stderr
    words = python.stdout.split()
    assert words[2:4] == ["refused", "peer-pid"], python.stdout
    assert "pid 1 is inside this process's PID namespace" in python.stdout
    assert c.returncode == 1 and c.stdout == ""
    assert c.stderr.startswith("hostpid_client: peer-pid: pid 1 is inside this process's PID ")
