"""
End to end with a real CDI consumer: Debian's podman 4.3 with
runc applies the spec that C{hostpid cdi} (or the broker's C{--cdi-dir})
wrote, and a container naming C{hami.io/hostpid=broker} gets its host PID.

Every podman here runs inside a private mount namespace whose C{/etc/cdi} and
C{/var/run/cdi} are fresh tmpfs mounts (L{podmanlib.CdiNode}), so the only
spec podman can see is the one under test.  The container runs as UID 1000
and execs C{python -m hostpid.cli query} with every default trust check (the
read-only broker mount, root-owned socket, peer UID 0 ...) as its init
process: the PID it prints must be the one podman wrote to C{--pidfile}.

Run with C{pytest -s} to see each run's host PIDs and times.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from podmanlib import CdiNode
from support import (
    BrokerProcess,
    hostpid_argv,
    remove_tree,
    require_root,
    running_broker,
    subprocess_env,
    wait_for,
)
from test_runc import ContainerRun, Node, assert_host_pid_answered, private_node

from hostpid.gate import GATE_ENV

pytestmark = pytest.mark.privileged

BROKER_DEVICE = "hami.io/hostpid=broker"
LOCK_PARENT_DEVICE = "hami.io/hostpid=lock-parent"
SPEC = "/var/run/cdi/hami.io-hostpid.json"


@pytest.fixture
def cdi_node() -> Iterator[CdiNode]:
    require_root()
    workdir = Path(tempfile.mkdtemp(prefix="hostpid-podman-"))
    node = CdiNode(workdir)
    try:
        yield node
    finally:
        node.close()
        remove_tree(workdir, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[Node]:
    """Private stand-ins for C{/var/run/hami} and C{/tmp} (as the runc e2e test has)."""
    with private_node() as made:
        yield made


def write_spec(cdi_node: CdiNode, node: Node, gate: str) -> dict[str, object]:
    """C{hostpid cdi} inside the namespace, with the default C{--dir}: the spec podman reads."""
    env = subprocess_env()
    env[GATE_ENV] = gate
    result = cdi_node.inside(
        hostpid_argv("cdi", "--lock-parent", str(node.lock_parent),
                     "--broker-dir", str(node.broker_dir)),
        env=env,
    )
    assert result.stdout.startswith(f"{SPEC}: CDI spec written"), result.stdout
    spec: dict[str, object] = json.loads(cdi_node.inside(["cat", SPEC]).stdout)
    return spec


def assert_gate_fallback(run: ContainerRun) -> None:
    assert run.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0"}, run.stdout
    assert run.exit_code == 1
    assert run.printed_pid() is None
    assert run.stderr.count("\n") == 1 and "gate check failed" in run.stderr, run.stderr


def test_spec_from_hostpid_cdi_gives_the_host_pid(cdi_node: CdiNode, node: Node) -> None:
    with running_broker(node.broker_dir) as broker:
        spec = write_spec(cdi_node, node, "1")
        assert [d["name"] for d in spec["devices"]] == ["broker", "lock-parent"]  # type: ignore[index]
        first = cdi_node.run("cdi broker device, uid 1000", devices=[BROKER_DEVICE])
        assert_host_pid_answered(first)
        second = cdi_node.run("cdi broker device, uid 1000, again", devices=[BROKER_DEVICE])
        assert_host_pid_answered(second)
        assert second.host_pid != first.host_pid
        assert broker.pid not in (first.host_pid, second.host_pid)


def test_lock_parent_device_stops_at_the_gate(cdi_node: CdiNode, node: Node) -> None:
    with running_broker(node.broker_dir):
        write_spec(cdi_node, node, "1")
        run = cdi_node.run("cdi lock-parent device", devices=[LOCK_PARENT_DEVICE])
    assert_gate_fallback(run)


def test_gate_off_spec_still_starts_a_container_naming_broker(
    cdi_node: CdiNode, node: Node
) -> None:
    """A cached allocation names C{broker} after the broker was turned off."""
    with running_broker(node.broker_dir):
        write_spec(cdi_node, node, "1")
        on = cdi_node.run("cdi broker device, gate on", devices=[BROKER_DEVICE])
        spec = write_spec(cdi_node, node, "0")
        assert [len(d["containerEdits"]["mounts"]) for d in spec["devices"]] == [1, 1]  # type: ignore[index]
        off = cdi_node.run("cdi broker device, spec rewritten gate off",
                           devices=[BROKER_DEVICE])
    assert_host_pid_answered(on)
    assert_gate_fallback(off)


def test_without_the_spec_podman_refuses_the_device(cdi_node: CdiNode) -> None:
    """Control: the device comes from the spec and nowhere else."""
    run = cdi_node.run("control: no spec", devices=[BROKER_DEVICE], args=["/bin/true"])
    assert run.exit_code != 0
    assert "unresolvable CDI devices hami.io/hostpid=broker" in run.stderr


def test_spec_written_by_the_broker_at_startup(cdi_node: CdiNode, node: Node) -> None:
    args = ("--cdi-dir", "/var/run/cdi", "--lock-parent", str(node.lock_parent))
    with running_broker(node.broker_dir, *args, argv_prefix=cdi_node.prefix) as broker:
        assert "CDI spec written" in broker.output()
        run = cdi_node.run("broker-written spec, broker device", devices=[BROKER_DEVICE])
        fallback = cdi_node.run("broker-written spec, lock-parent device",
                                devices=[LOCK_PARENT_DEVICE])
    assert_host_pid_answered(run)
    assert_gate_fallback(fallback)
    # The same broker restarted with its gate off rewrites the spec gate-off.
    with BrokerProcess(node.broker_dir, args, gate="0", argv_prefix=cdi_node.prefix) as off:
        wait_for(lambda: "disabled" in off.output(), "the disabled broker")
        cached = cdi_node.run("broker-written spec, gate off, broker device",
                              devices=[BROKER_DEVICE])
        off.terminate()
    assert_gate_fallback(cached)


def test_unqualified_spec_directory_is_the_namespace_one(cdi_node: CdiNode) -> None:
    """The host's own spec directories were not written by these tests."""
    for directory in ("/etc/cdi", "/run/cdi"):
        if os.path.isdir(directory):
            assert "hami.io-hostpid.json" not in os.listdir(directory)
    listed = subprocess.run([*cdi_node.prefix, "findmnt", "-n", "-o", "FSTYPE", "/run/cdi"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert listed.stdout.strip() == "tmpfs"
