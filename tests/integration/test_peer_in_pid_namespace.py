"""
The C{peer-pid} check, for real in private PID namespaces: from a private
PID namespace the host's broker shows as PID 0, and anything else is
refused.

1. A listener inside the client's own PID namespace: a real broker runs in
   a new PID namespace with the unsafe override
   (C{--allow-non-host-pid-namespace}), so it answers PIDs of that
   namespace, plausible and wrong for NVML.  On the old code the Python and
   C clients printed the namespace PID.
2. The listener that is the caller itself, as gVisor's sentry reports it to
   a client of a host socket: in a new PID namespace a process listens on
   the broker's path, forks a server that answers every request with PID
   4242, and then C{exec}s the client (the same PID).  The kernel names the
   client itself as the listener; someone else answers.  The Python client
   (blocking and Twisted), C{hostpid doctor} and the C contract client all
   refuse with C{peer-pid}, with C{read-only-mount} turned off by name (a
   plain directory here), before sending a byte.  On the old code every one
   of them printed 4242.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clienttools import build_c_client, make_directory
from support import BrokerProcess, nspid, require_root, require_tool, subprocess_env, wait_for
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


#: Listen on argv[1], fork a server answering PID 4242 to every request on
#: that listener, then become argv[2:] (the same PID, the listener's).
LISTEN_SERVE_EXEC = (
    "import os, socket, sys\n"
    "listener = socket.socket(socket.AF_UNIX)\n"
    "listener.bind(sys.argv[1])\n"
    "listener.listen(8)\n"
    "ANSWER = b'HPID\\x00\\x01\\x00\\x00' + (4242).to_bytes(4, 'big')\n"
    "if os.fork() == 0:\n"
    "    listener.settimeout(20)\n"
    "    try:\n"
    "        while True:\n"
    "            connection, _ = listener.accept()\n"
    "            connection.settimeout(5)\n"
    "            try:\n"
    "                if len(connection.recv(8)) == 8:\n"
    "                    connection.sendall(ANSWER)\n"
    "            except OSError:\n"
    "                pass\n"
    "            connection.close()\n"
    "    except OSError:\n"
    "        os._exit(0)\n"
    "os.set_inheritable(listener.fileno(), True)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)

PYTHON_BLOCKING = (
    "import sys\n"
    "from hostpid import HostPidUnavailable, TrustPolicy, query_host_pid\n"
    "try:\n"
    "    print(query_host_pid(TrustPolicy(sys.argv[1]).without('read-only-mount')))\n"
    "except HostPidUnavailable as problem:\n"
    "    sys.exit(f'{problem}')\n"
)

PYTHON_TWISTED = (
    "import sys\n"
    "from twisted.internet.task import react\n"
    "from hostpid import HostPidUnavailable, TrustPolicy, query_host_pid_deferred\n"
    "def main(reactor):\n"
    "    d = query_host_pid_deferred(TrustPolicy(sys.argv[1]).without('read-only-mount'))\n"
    "    d.addCallback(print)\n"
    "    def refused(failure):\n"
    "        failure.trap(HostPidUnavailable)\n"
    "        print(failure.value, file=sys.stderr)\n"
    "        raise SystemExit(1)\n"
    "    return d.addErrback(refused)\n"
    "react(main)\n"
)


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_client(tmp_path_factory.mktemp("cclient"))


@pytest.mark.parametrize("which", ["python", "twisted", "doctor", "c"])
def test_listener_that_is_the_caller_itself_is_refused(
    tmp_path: Path, c_client: Path, which: str
) -> None:
    require_root()
    unshare = require_tool("unshare")
    directory = make_directory(tmp_path / "hostpid")
    socket_path = str(directory / "broker.sock")
    client = {
        "python": [sys.executable, "-c", PYTHON_BLOCKING, socket_path],
        "twisted": [sys.executable, "-c", PYTHON_TWISTED, socket_path],
        "doctor": [sys.executable, "-m", "hostpid.cli", "doctor", "--socket", socket_path],
        "c": [str(c_client), "--socket", socket_path, "--without", "read-only-mount"],
    }[which]
    result = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", "--kill-child",
         sys.executable, "-c", LISTEN_SERVE_EXEC, socket_path, *client],
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        capture_output=True, text=True, timeout=60,
    )
    print(f"\n[peer-pid] {which}: exit {result.returncode} {result.stdout.strip()!r} "
          f"{result.stderr.strip()!r}")
    assert "4242" not in result.stdout, "the answer of a listener that is the caller itself"
    assert result.returncode == 1
    if which == "doctor":
        lines = {line.split()[0]: line for line in result.stdout.splitlines()}
        assert lines["peer-uid"] == "peer-uid ok uid 0 (pid 1)"
        assert lines["peer-pid"].startswith(
            f"peer-pid FAIL {socket_path}: pid 1 is this process itself: sandboxed runtime")
        assert lines["reply"] == "reply FAIL not tried: peer-pid failed"
    elif which == "c":
        assert result.stderr.startswith(
            "hostpid_client: peer-pid: pid 1 is this process itself: sandboxed runtime")
    else:
        assert result.stdout == ""
        assert result.stderr.startswith(
            "peer-pid: pid 1 is this process itself: sandboxed runtime"), result.stderr
