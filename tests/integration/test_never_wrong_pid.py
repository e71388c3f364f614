"""
Never a wrong PID: the broker refuses to serve outside the host PID
namespace, and refuses a caller that is no longer the process that connected.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from support import (
    BrokerProcess,
    ask_pid,
    connect,
    exchange,
    nspid,
    read_until_eof,
    require_root,
    require_tool,
    running_broker,
    subprocess_env,
    wait_for,
)

from hostpid import wire
from hostpid.broker.service import LIVENESS_ENV
from hostpid.peercred import LivenessCheck

SECCOMP = Path(__file__).resolve().parent.parent / "seccompfilter.py"


@attrs.frozen
class Liveness:
    """How a broker under test is made to use one liveness check, and the line that says so."""

    env: dict[str, str] = attrs.field(factory=dict)
    prefix: list[str] = attrs.field(factory=list)
    line: str | None = None


def seccomp(*options: str) -> list[str]:
    """A prefix that runs the broker under L{SECCOMP}'s filter (x86_64 only)."""
    if os.uname().machine != "x86_64":
        pytest.skip(f"not applicable: the seccomp filter is x86_64-only ({os.uname().machine})")
    return [sys.executable, str(SECCOMP), *options, "--"]


#: The liveness checks every answering test here runs with: whatever this
#: kernel offers (SO_PEERPIDFD from Linux 6.5, pidfd_open before); the
#: pidfd_open check forced by the test switch; and this kernel made to answer
#: SO_PEERPIDFD with ENOPROTOOPT at the system call boundary (a seccomp
#: filter), as kernels before 6.5 do, so that the broker finds the fallback
#: itself.  On those kernels the three are the same check.
LIVENESS = ["kernel", "pidfd_open", "no-so_peerpidfd"]


@pytest.fixture(params=LIVENESS)
def liveness(request: pytest.FixtureRequest) -> Liveness:
    if request.param == "pidfd_open":
        return Liveness(
            env={LIVENESS_ENV: LivenessCheck.PIDFD_OPEN.value},
            line=f"liveness check forced to pidfd_open by {LIVENESS_ENV}",
        )
    if request.param == "no-so_peerpidfd":
        return Liveness(
            prefix=seccomp("--no-peerpidfd"),
            line="this kernel has no SO_PEERPIDFD; callers are checked with pidfd_open",
        )
    return Liveness()


def assert_check_in_force(broker: BrokerProcess, liveness: Liveness) -> None:
    """The broker says which check it uses (so the test is not vacuous)."""
    if liveness.line is not None:
        line = liveness.line
        wait_for(lambda: line in broker.output(), "the broker to name its liveness check")

pytestmark = pytest.mark.kernel


def in_new_pid_namespace() -> list[str]:
    require_root()
    return [require_tool("unshare"), "--pid", "--fork", "--kill-child=SIGTERM"]


def test_broker_in_a_new_pid_namespace_refuses_to_start(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "broker", argv_prefix=in_new_pid_namespace()) as broker:
        assert broker.wait_exit() != 0
        output = broker.output()
    assert "/proc/self/ns/pid: the broker runs in PID namespace pid:[" in output
    assert "not the host's pid:[4026531836]" in output
    assert "hostPID: true" in output
    assert not (tmp_path / "broker" / "broker.sock").exists()


@pytest.mark.parametrize(
    "directory", [None, "/var/run/hami/./hostpid", "/run/hami/hostpid"],
    ids=["default", "same-path-spelled-differently", "through-/var/run-symlink"],
)
def test_override_is_refused_with_the_default_directory(directory: str | None) -> None:
    require_root()
    if directory == "/run/hami/hostpid" and os.path.realpath("/var/run") != "/run":
        pytest.skip("/var/run is not a symlink to /run on this machine")
    with BrokerProcess(directory, ["--allow-non-host-pid-namespace"]) as broker:
        assert broker.wait_exit() == 1
        output = broker.output()
    assert "--allow-non-host-pid-namespace is refused with the default broker directory" in output


def test_with_the_override_it_serves_pids_of_its_own_namespace(
    public_tmp: Path, liveness: Liveness
) -> None:
    """
    The unsafe override, proven to do what the documentation warns: a client
    in the broker's namespace is told its PID *in that namespace*, and a
    client in the host namespace (invisible from there: PID 0) gets nothing.
    """
    nsenter = require_tool("nsenter")
    with BrokerProcess(
        public_tmp / "broker",
        ["--allow-non-host-pid-namespace"],
        argv_prefix=[*in_new_pid_namespace(), *liveness.prefix],
        env=liveness.env,
    ) as broker:
        wait_for(lambda: "listening on" in broker.output(), "the broker to listen")
        assert "NOT host PIDs" in broker.output()
        assert ask_pid(broker.socket_path) is None, "a host client is not visible: no reply"

        twistd_pid = int(Path(f"/proc/{broker.pid}/task/{broker.pid}/children").read_text())
        assert nspid(twistd_pid)[-1] == 1, "the broker is PID 1 of its namespace"
        script = (
            "import os\n"
            "from support import ask_pid\n"
            f"print(os.getpid(), ask_pid({str(broker.socket_path)!r}), flush=True)\n"
        )
        result = subprocess.run(
            [nsenter, f"--target={twistd_pid}", "--pid", "--", sys.executable, "-c", script],
            env=subprocess_env(PYTHONPATH=os.pathsep.join(sys.path)),
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, result.stderr
        inner_pid, reported = map(int, result.stdout.split())
        assert reported == inner_pid, "it reports the namespace's PID, as documented"
        assert_check_in_force(broker, liveness)
        if liveness.line is not None:
            # unshare --pid without --mount-proc: /proc is the host's, whose
            # PID numbers are not the broker's; start times are not read there.
            assert "so start times are not compared" in broker.output()
        # unshare --fork blocks SIGTERM while it waits: stop the broker itself.
        os.kill(twistd_pid, signal.SIGTERM)
        broker.wait_exit()


def test_caller_that_exited_after_connecting_gets_no_reply(
    public_tmp: Path, liveness: Liveness
) -> None:
    """
    The process that connects hands the connection to a forked child and
    exits; once it is reaped, its PID may name anyone.  The child sends the
    request: the broker closes with no reply, whether it checks with
    SO_PEERPIDFD or (kernels before 6.5) with pidfd_open; SO_PEERCRED alone
    would answer with the exited caller's PID.
    """
    with running_broker(
        public_tmp / "broker", "--deadline", "10", env=liveness.env, argv_prefix=liveness.prefix
    ) as broker:
        go_read, go_write = os.pipe()
        result_read, result_write = os.pipe()
        connector = os.fork()
        if connector == 0:  # pragma: no cover - runs in the child
            try:
                sock = connect(broker.socket_path, timeout=10)
                if os.fork() == 0:
                    os.read(go_read, 1)
                    try:
                        sock.sendall(wire.GET_HOST_PID_REQUEST)
                        reply = read_until_eof(sock)
                    except OSError:
                        reply = b"error"
                    os.write(result_write, struct.pack("q", len(reply)) + reply)
            finally:
                os._exit(0)
        os.waitpid(connector, 0)  # the connecting process is gone and reaped
        os.close(result_write)
        os.write(go_write, b"x")
        with os.fdopen(result_read, "rb") as reader:
            data = reader.read()
        (length,) = struct.unpack_from("q", data)
        assert data[8:] == b"" and length == 0, f"expected no reply, got {data[8:]!r}"
        wait_for(lambda: "peer_gone transactions so far: 1" in broker.output(), "the log line")
        # The normal client still gets its own PID.
        assert exchange(broker.socket_path) == wire.encode_ok(os.getpid())
        assert_check_in_force(broker, liveness)


def test_where_pidfd_open_is_refused_the_broker_says_so_and_still_answers(
    public_tmp: Path,
) -> None:
    """
    A kernel without SO_PEERPIDFD whose pidfd_open a seccomp filter refuses
    (EPERM, both at the system call boundary): the broker falls back to
    SO_PEERCRED alone, says so once with the errno, and answers callers.
    """
    prefix = seccomp("--no-peerpidfd", "--no-pidfd-open")
    with running_broker(public_tmp / "broker", argv_prefix=prefix) as broker:
        for _ in range(3):
            assert exchange(broker.socket_path) == wire.encode_ok(os.getpid())
        line = "pidfd_open is refused (EPERM); replies rest on SO_PEERCRED alone"
        wait_for(lambda: line in broker.output(), "the fallback's log line")
        assert broker.output().count(line) == 1
