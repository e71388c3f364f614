"""
The client in the production layout, as root: a real broker serves its
directory; a private mount namespace bind-mounts that directory read-only at
C{/tmp/vgpulock/hostpid} (over a private tmpfs C{/tmp}, so the host's
C{/tmp/vgpulock} is never touched); and the clients run there, inside a new
PID namespace, with the default socket path and every check on.

Each reported host PID is compared with the kernel's C{NSpid} for that very
process, read from the host's C{/proc} while the client is kept as a zombie
(see C{nslayout.py}).
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from clienttools import build_c_client
from support import (
    WAIT_SECONDS,
    BrokerProcess,
    nspid,
    require_root,
    require_tool,
    running_broker,
    subprocess_env,
)

pytestmark = pytest.mark.privileged

LAUNCHER = Path(__file__).resolve().parent / "nslayout.py"
STORM = 300


@pytest.fixture(scope="module")
def layout_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_root()
    for tool in ("unshare", "mount"):
        require_tool(tool)
    return tmp_path_factory.mktemp("layout")


@pytest.fixture(scope="module")
def broker(layout_root: Path) -> Iterator[BrokerProcess]:
    with running_broker(layout_root / "broker") as broker:
        yield broker


@pytest.fixture(scope="module")
def work(layout_root: Path) -> Path:
    path = layout_root / "work"
    path.mkdir()
    build_c_client(path)
    return path


class Namespace:
    """The launcher running as PID 1 of new mount and PID namespaces."""

    def __init__(self, broker: BrokerProcess, stage: Path, work: Path, mode: str,
                 *command: str) -> None:
        stage.mkdir(parents=True)
        self.process = subprocess.Popen(
            [
                "unshare", "--mount", "--propagation", "private",
                "--pid", "--fork", "--mount-proc",
                sys.executable, str(LAUNCHER),
                str(broker.directory), str(stage), str(work), mode, *command,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        )

    def report(self) -> dict[str, object]:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(WAIT_SECONDS * 4):
                raise AssertionError("the namespace launcher printed nothing")
        line = self.process.stdout.readline()
        if not line:
            assert self.process.stderr is not None
            self.process.wait(WAIT_SECONDS)
            raise AssertionError(
                f"launcher failed ({self.process.returncode}): "
                + self.process.stderr.read().decode()
            )
        report: dict[str, object] = json.loads(line)
        return report

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            assert self.process.wait(WAIT_SECONDS) == 0
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


@contextmanager
def in_layout(
    broker: BrokerProcess, tmp_path: Path, work: Path, mode: str, *command: str
) -> Iterator[tuple[list[dict[str, object]], str]]:
    namespace = Namespace(broker, tmp_path / "stage", work, mode, *command)
    try:
        report = namespace.report()
        results = report["results"]
        assert isinstance(results, list)
        mountinfo = report["mountinfo"]
        assert isinstance(mountinfo, str)
        yield results, mountinfo
    finally:
        namespace.close()


def assert_host_pid(result: dict[str, object], reported: int) -> None:
    """The kernel says: the process that printed C{reported} has it as host PID."""
    ns_pid = result["ns_pid"]
    assert nspid(reported) == [reported, ns_pid], (reported, ns_pid)


def broker_mount_line(mountinfo: str) -> str:
    [line] = [
        line for line in mountinfo.splitlines() if line.split()[4] == "/tmp/vgpulock/hostpid"
    ]
    return line


def test_python_query_in_the_production_layout(
    broker: BrokerProcess, tmp_path: Path, work: Path
) -> None:
    with in_layout(broker, tmp_path, work, "ro", "query") as (results, mountinfo):
        assert broker_mount_line(mountinfo).split()[5].startswith("ro")
        [result] = results
        assert result["status"] == 0, result["stderr"]
        assert result["stderr"] == ""
        stdout = result["stdout"]
        assert isinstance(stdout, str) and stdout.endswith("\n")
        host_pid = int(stdout)
        assert host_pid != result["ns_pid"], "a PID namespace PID is not a host PID"
        assert_host_pid(result, host_pid)


def test_doctor_in_a_healthy_layout(broker: BrokerProcess, tmp_path: Path, work: Path) -> None:
    with in_layout(broker, tmp_path, work, "ro", "doctor") as (results, _):
        [result] = results
        assert result["status"] == 0, result
        stdout = result["stdout"]
        assert isinstance(stdout, str)
        lines = stdout.splitlines()
        assert [line.split()[:2] for line in lines] == [
            [name, "ok"]
            for name in (
                "gate", "sandbox", "directory", "socket", "read-only-mount", "connect",
                "peer-uid", "peer-pid", "reply",
            )
        ]
        assert lines[2] == "directory ok directory, uid 0, mode 0711"
        assert lines[3] == "socket ok socket, uid 0, mode 0666"
        assert lines[4] == "read-only-mount ok read-only"
        # The broker is outside this PID namespace: the kernel reports its PID as 0.
        assert lines[6] == "peer-uid ok uid 0 (pid 0)"
        assert lines[7] == "peer-pid ok pid 0: outside this PID namespace (the host's)"
        assert_host_pid(result, int(lines[8].split()[-1]))


def test_doctor_and_query_in_a_read_write_layout(
    broker: BrokerProcess, tmp_path: Path, work: Path
) -> None:
    """The broken layout: the same mount, but read-write."""
    with in_layout(broker, tmp_path / "d", work, "rw", "doctor") as (results, mountinfo):
        assert broker_mount_line(mountinfo).split()[5].startswith("rw")
        [result] = results
        assert result["status"] == 1
        stdout = result["stdout"]
        assert isinstance(stdout, str)
        lines = stdout.splitlines()
        assert lines[4] == "read-only-mount FAIL /tmp/vgpulock/hostpid: read-write mount"
        assert [line.split()[1] for line in lines] == ["ok"] * 4 + ["FAIL"] + ["ok"] * 4
    with in_layout(broker, tmp_path / "q", work, "rw", "query") as (results, _):
        [result] = results
        assert (result["status"], result["stdout"]) == (1, "")
        assert result["stderr"] == (
            "hostpid query: read-only-mount check failed: /tmp/vgpulock/hostpid: "
            "read-write mount\n"
        )


def test_c_client_in_the_production_layout(
    broker: BrokerProcess, tmp_path: Path, work: Path
) -> None:
    with in_layout(
        broker, tmp_path, work, "ro", "c-client", "/tmp/work/hostpid_client"
    ) as (results, _):
        [result] = results
        assert result["status"] == 0, result["stderr"]
        stdout = result["stdout"]
        assert isinstance(stdout, str)
        host_pid, own_pid = map(int, stdout.split())
        assert own_pid == result["ns_pid"]
        assert_host_pid(result, host_pid)


def test_c_client_storm(broker: BrokerProcess, tmp_path: Path, work: Path) -> None:
    """300 C clients released at once: each gets its own host PID, none fails."""
    with in_layout(
        broker, tmp_path, work, "ro", "c-storm", "/tmp/work/hostpid_client", str(STORM)
    ) as (results, _):
        assert len(results) == STORM
        failures = [r for r in results if r["status"] != 0]
        host_pids = []
        for result in results:
            if result["status"] != 0:
                continue
            stdout = result["stdout"]
            assert isinstance(stdout, str)
            host_pid, own_pid = map(int, stdout.split())
            assert own_pid == result["ns_pid"]
            assert_host_pid(result, host_pid)
            host_pids.append(host_pid)
        line = (
            f"storm: {STORM} concurrent C clients, {len(host_pids)} ok, "
            f"{len(failures)} failed, {len(set(host_pids))} distinct host PIDs, "
            "each equal to the kernel's NSpid"
        )
        print(line)
        assert not failures, failures[:5]
        assert len(set(host_pids)) == STORM, line
