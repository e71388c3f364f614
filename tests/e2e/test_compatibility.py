"""
One end-to-end test per compatibility cell, with the real runtime.

Each container gets what C{hostpid allocate} returns (the writable lock
parent and the read-only broker mount at C{/tmp/vgpulock/hostpid}) from a
real broker on the host, and runs, in order:

  - C{hostpid doctor} (every line kept, prefixed C{doctor: });
  - the C contract client, strict and with C{--without read-only-mount}
    (C{c-strict: }, C{c-loose: });
  - the Python client with C{read-only-mount} turned off by name
    (C{py-loose: }), as a caller "for tests and unusual nodes" may;
  - a raw exchange with no trust check at all from a child process
    (C{raw-child: }), and then, as the container's init process (PID 1
    inside, the runtime's C{--pid-file} PID outside), another raw exchange
    (C{raw: }, what the broker sees of this process) and C{exec hostpid
    query} with every default check.

The cells and their verdicts (C{docs/compatibility.md} has the table):

  - runc, crun; root and UID 1000: the host PID of the container's init;
  - runc, crun with a user namespace (0 -> 100000, as C{hostUsers: false}):
    the broker sees the right PID and, the broker mount being a plain
    read-only bind (these runtimes predate idmapped mounts), the client
    trusts it under the user-namespace rule (C{docs/userns.md}): the
    directory and socket show as the overflow UID, the listener as the
    overflow UID with PID 0;
  - rootless podman (UID 1000): the same, with its single mapping;
  - gVisor (Debian's C{runsc}), default: refused (C{sandbox}), the broker
    reaches nobody;
  - gVisor with C{--host-uds=open}, root: the broker sees one PID for every
    process of the sandbox (the gofer's), SO_PEERCRED inside names the
    caller itself; refused (C{sandbox}, and C{peer-pid} in the doctor's
    report), also with C{read-only-mount} turned off by name.  On the old
    client that last run printed the gofer's PID;
  - no broker mount (an allocation with the gate off, after an earlier one
    made the mountpoint): the doctor says so first.

Never a wrong PID: no cell may print a PID other than the runtime's own
report for the process that asked.  A runtime that cannot start a container
here skips, or fails under C{HOSTPID_REQUIRE_PRIVILEGED=1}, with its error.

Run with C{pytest -s} to see each run.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from clienttools import build_c_client
from podmanlib import RootlessPodman
from support import remove_tree, require_root, require_tool, running_broker, skip_or_fail
from test_runc import (
    WORKLOAD_UID,
    ContainerRun,
    Node,
    Runtime,
    allocate,
    private_node,
)

pytestmark = pytest.mark.privileged

C_CLIENT = "/e2e/cclient/hostpid_client"
USER_NAMESPACE = (0, 100000, 65536)

#: The Python client with only read-only-mount turned off.
LOOSE = (
    "from hostpid import TrustPolicy, HostPidUnavailable, query_host_pid\n"
    "try:\n"
    "    print('answer', query_host_pid(TrustPolicy().without('read-only-mount')))\n"
    "except HostPidUnavailable as problem:\n"
    "    print('refused', problem.check, '|', problem.observed)\n"
)

#: No trust check: what the broker answers this process.  With C{exec},
#: then becomes the strict query in the same process.
RAW = (
    "import os, socket, sys\n"
    "from hostpid import wire\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.settimeout(5)\n"
    "try:\n"
    "    s.connect('/tmp/vgpulock/hostpid/broker.sock')\n"
    "    s.sendall(wire.GET_HOST_PID_REQUEST)\n"
    "    data = s.recv(12)\n"
    "    print(sys.argv[1], wire.parse_response(data).pid if len(data) == 12 else 'nothing',"
    " flush=True)\n"
    "except OSError as e:\n"
    "    print(sys.argv[1], 'error', e.strerror, flush=True)\n"
    "if sys.argv[2:]:\n"
    "    os.execv(sys.executable, [sys.executable, '-m', 'hostpid.cli', 'query'])\n"
)


def cell_script(python: str) -> list[str]:
    py = shlex.quote(python)
    return ["/bin/sh", "-c", (
        'echo "ns-pid $$"; '
        f"{py} -m hostpid.cli doctor 2>&1 | sed 's/^/doctor: /'; "
        f"{C_CLIENT} 2>&1 | sed 's/^/c-strict: /'; "
        f"{C_CLIENT} --without read-only-mount 2>&1 | sed 's/^/c-loose: /'; "
        f"{py} -c {shlex.quote(LOOSE)} 2>&1 | sed 's/^/py-loose: /'; "
        f"{py} -c {shlex.quote(RAW)} raw-child: 2>&1; "
        f"exec {py} -c {shlex.quote(RAW)} raw: query"
    )]


class Cell:
    """What one container of a cell printed, by prefix."""

    def __init__(self, run: ContainerRun, runtime: str) -> None:
        self.run = run
        if "ns-pid 1" not in run.stdout.splitlines():
            skip_or_fail(f"{runtime} cannot start a container here: exit {run.exit_code}: "
                         f"{run.stderr.strip()}")
        self.lines: dict[str, list[str]] = {}
        for line in run.stdout.splitlines():
            prefix, _, rest = line.partition(": ")
            if rest:
                self.lines.setdefault(prefix, []).append(rest)

    def one(self, prefix: str) -> str:
        (line,) = self.lines[prefix]
        return line

    def doctor(self) -> dict[str, str]:
        """Each doctor line by check name: C{ok ...} or C{FAIL ...}."""
        found = {}
        for line in self.lines["doctor"]:
            name, _, rest = line.partition(" ")
            found[name] = rest
        return found

    def raw(self, prefix: str = "raw") -> str:
        return self.one(prefix)

    def never_a_wrong_pid(self) -> None:
        """Whatever printed a PID printed the runtime's own report for PID 1."""
        printed = self.run.printed_pid()
        assert printed is None or printed == self.run.host_pid, self.run.stdout
        for prefix in ("c-strict", "c-loose"):
            for line in self.lines.get(prefix, []):
                assert not re.fullmatch(r"\d+ \d+", line), f"{prefix} trusted: {line}"
        assert not self.one("py-loose").startswith("answer"), self.one("py-loose")


def assert_host_pid(cell: Cell) -> None:
    run = cell.run
    assert run.exit_code == 0, run.stderr
    assert run.host_pid is not None and run.printed_pid() == run.host_pid
    assert cell.raw() == str(run.host_pid), "the broker sees the container's init"
    assert all(line.split()[1] == "ok" for line in cell.lines["doctor"]), cell.lines["doctor"]
    assert cell.doctor()["peer-pid"].startswith("ok pid 0: outside this PID namespace")
    assert re.fullmatch(r"\d+ \d+", cell.one("c-strict")), cell.one("c-strict")
    assert cell.one("py-loose").startswith("answer ")
    assert cell.raw("raw-child") not in (str(run.host_pid), "nothing")


def assert_user_namespace_served(cell: Cell, uid_map: str) -> None:
    """
    A user-namespaced container on a runtime that predates idmapped mounts:
    the broker directory is a plain read-only bind, so the host's root shows
    as the overflow UID, and the client applies the user-namespace rule
    (docs/userns.md) and trusts the broker.
    """
    assert_host_pid(cell)
    doctor = cell.doctor()
    assert doctor["user-namespace"].startswith(
        f"ok user namespace (uid_map {uid_map}): host uid 0 is not mapped"
    ), doctor["user-namespace"]
    plain = "(the host's uid 0 on a mount without an idmapping)"
    assert doctor["directory"] == f"ok directory, uid 65534, mode 0711 {plain}"
    assert doctor["socket"] == f"ok socket, uid 65534, mode 0666 {plain}"
    assert doctor["peer-uid"].startswith(
        "ok uid 65534 (pid 0): the overflow uid outside this PID namespace"
    )


@pytest.fixture
def workdir() -> Iterator[Path]:
    require_root()
    path = Path(tempfile.mkdtemp(prefix="hostpid-cells-", dir="/tmp"))
    os.chmod(path, 0o755)  # a user-namespaced root, or UID 1000, must reach into it
    try:
        yield path
    finally:
        remove_tree(path, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[Node]:
    with private_node() as made:
        yield made


@pytest.fixture
def c_client_dir(workdir: Path) -> Path:
    out = workdir / "cclient"
    out.mkdir()
    build_c_client(out)
    return out


def runtime_command(name: str) -> list[str]:
    """
    The runtime's command line.  crun 1.8 refuses a hybrid cgroup layout
    (cgroup v1 with an empty v2 hierarchy at C{/sys/fs/cgroup/unified}), so
    on such a host it runs in a private mount namespace without that
    mount: crun then sees cgroup v1 alone.
    """
    if name == "crun":
        crun = require_tool("crun")
        if os.path.ismount("/sys/fs/cgroup/unified"):
            return [require_tool("unshare"), "--mount", "--propagation", "private", "sh", "-c",
                    'umount -l /sys/fs/cgroup/unified && exec "$@"', "crun", crun]
        return [crun]
    if name == "runsc":
        return [require_tool("runsc"), "--network=none"]
    return [require_tool(name)]


def run_cell(workdir: Path, node: Node, c_client_dir: Path, command: list[str], name: str,
             uid: int = 0, uid_mappings: tuple[int, int, int] | None = None) -> Cell:
    runtime = Runtime(command, workdir, uid_mappings)
    runtime.extra_binds.append((str(c_client_dir), "/e2e/cclient"))
    with running_broker(node.broker_dir):
        mounts, envs, _ = allocate(node, "1")
        run = runtime.run(name, mounts, envs, uid, cell_script(runtime.python.executable))
    return Cell(run, os.path.basename(command[-1]))


def fresh(workdir: Path, name: str) -> Path:
    path = workdir / name
    path.mkdir(mode=0o755)
    return path


@pytest.mark.parametrize("uid", [0, WORKLOAD_UID])
@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_runc_and_crun_answer_the_host_pid(
    workdir: Path, node: Node, c_client_dir: Path, runtime: str, uid: int
) -> None:
    cell = run_cell(fresh(workdir, "r"), node, c_client_dir, runtime_command(runtime),
                    f"{runtime}, uid {uid}", uid)
    assert_host_pid(cell)


@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_user_namespace_answers_the_host_pid(
    workdir: Path, node: Node, c_client_dir: Path, runtime: str
) -> None:
    cell = run_cell(fresh(workdir, "u"), node, c_client_dir, runtime_command(runtime),
                    f"{runtime}, user namespace 0 -> 100000", 0, USER_NAMESPACE)
    assert_user_namespace_served(cell, "0->100000x65536")


def test_rootless_podman_answers_the_host_pid(
    workdir: Path, node: Node, c_client_dir: Path
) -> None:
    podman = RootlessPodman(fresh(workdir, "p"))
    podman.extra_binds.append((str(c_client_dir), "/e2e/cclient"))
    try:
        with running_broker(node.broker_dir):
            mounts, envs, _ = allocate(node, "1")
            run = podman.run("rootless podman, uid 1000",
                             [(m.container_path, m.host_path, m.read_only) for m in mounts],
                             envs, cell_script(podman.python.executable))
    finally:
        podman.close()
    cell = Cell(run, "rootless podman")
    assert_user_namespace_served(cell, "0->1000x1")


def test_gvisor_default_is_refused(workdir: Path, node: Node, c_client_dir: Path) -> None:
    cell = run_cell(fresh(workdir, "g"), node, c_client_dir, runtime_command("runsc"),
                    "gVisor, default")
    run = cell.run
    assert run.exit_code == 1 and run.printed_pid() is None
    assert run.stderr.startswith("hostpid query: sandbox check failed: gVisor (runsc) detected")
    assert cell.raw().startswith("error "), "the broker is not reached at all"
    assert cell.doctor()["sandbox"].startswith("FAIL gVisor (runsc) detected")
    assert cell.one("c-strict").startswith("hostpid_client: sandbox: gVisor (runsc) detected")
    cell.never_a_wrong_pid()


@pytest.mark.parametrize("host_uds", ["open", "all"])
def test_gvisor_with_host_sockets_never_trusts_the_gofer(
    workdir: Path, node: Node, c_client_dir: Path, host_uds: str
) -> None:
    """
    The cell that was one check away from a wrong PID.  The broker answers
    the gofer's PID, the same for every process of the sandbox, and
    SO_PEERCRED inside names the caller itself as root: C{peer-uid} passes,
    C{peer-pid} does not.  With C{read-only-mount} turned off by name (as the
    gVisor releases that report C{ST_RDONLY} would pass it), the Python and
    C clients must still refuse.
    """
    command = [*runtime_command("runsc"), f"--host-uds={host_uds}"]
    cell = run_cell(fresh(workdir, "h"), node, c_client_dir, command,
                    f"gVisor --host-uds={host_uds}, root")
    run = cell.run
    gofer = cell.raw()
    assert gofer.isdigit() and gofer == cell.raw("raw-child"), (
        "the broker sees one PID for every process of the sandbox")
    assert gofer != str(run.host_pid)
    # read-only-mount turned off by name: still refused, never the gofer's PID.
    assert cell.one("py-loose").startswith("refused sandbox | gVisor (runsc) detected"), (
        f"the gofer is PID {gofer}: {cell.one('py-loose')}")
    assert cell.one("c-loose").startswith("hostpid_client: sandbox: gVisor (runsc) detected")
    cell.never_a_wrong_pid()
    doctor = cell.doctor()
    assert doctor["peer-uid"].startswith("ok uid 0 (pid "), "gVisor echoes the caller: root"
    echoed = doctor["peer-uid"].removeprefix("ok uid 0 (pid ").rstrip(")")
    assert doctor["peer-pid"].startswith(
        f"FAIL /tmp/vgpulock/hostpid/broker.sock: pid {echoed} is this process itself: "
        "sandboxed runtime")
    assert doctor["sandbox"].startswith("FAIL gVisor (runsc) detected")
    assert doctor["reply"] == "FAIL not tried: peer-pid failed"
    assert run.exit_code == 1 and run.printed_pid() is None
    assert run.stderr.startswith("hostpid query: sandbox check failed: gVisor (runsc) detected")


def test_no_broker_mount_says_so(workdir: Path, node: Node, c_client_dir: Path) -> None:
    """
    The cell of a container whose allocation has no broker mount, on a node
    where an earlier broker-enabled allocation made the mountpoint: the
    doctor says so first, in those words, instead of a missing socket.
    """
    runtime = Runtime(runtime_command("runc"), fresh(workdir, "n"))
    runtime.extra_binds.append((str(c_client_dir), "/e2e/cclient"))
    with running_broker(node.broker_dir):
        allocate(node, "1")
        mounts, envs, _ = allocate(node, "0")
        run = runtime.run("runc, no broker mount", mounts, envs, WORKLOAD_UID,
                          cell_script(runtime.python.executable))
    cell = Cell(run, "runc")
    assert cell.lines["doctor"][0].startswith(
        "broker-mount FAIL /tmp/vgpulock/hostpid is not a mount point: this container's "
        "allocation has no broker mount")
    assert run.exit_code == 1 and run.printed_pid() is None
    assert "gate check failed" in run.stderr
    cell.never_a_wrong_pid()
