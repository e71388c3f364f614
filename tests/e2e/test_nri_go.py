"""
The NRI plugin against NRI's own Go code: the runtime side that containerd
and CRI-O link (C{pkg/adaptation}), built from Debian's sources of two NRI
releases (L{nrilib}), listens on a private socket; the plugin connects,
registers, is configured and synchronized; nrigo then sends CreateContainer
requests and prints the merged responses, which the tests compare with
what the plugin must answer.

A control plugin written with NRI's own stub (C{nristub}) runs through the
same driver first, so an empty answer from hostpid's plugin is its answer,
not a driver that never reaches plugins.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelfeatures import kernel_feature
from nrigolib import (
    NRI_RELEASES,
    NriPrograms,
    PluginRun,
    build,
    drive,
    nri_container,
    nri_pod,
)
from support import TWISTD, require_root, subprocess_env

from hostpid import defaults
from hostpid.gate import GATE_ENV

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = [pytest.mark.privileged, kernel_feature("immutable_tmp")]


@pytest.fixture(scope="module", params=sorted(NRI_RELEASES))
def programs(request: pytest.FixtureRequest) -> Iterator[NriPrograms]:
    require_root()
    out = Path(tempfile.mkdtemp(prefix="hostpid-nrigo-"))
    try:
        yield build(NRI_RELEASES[request.param], out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def workdir() -> Iterator[Path]:
    made = Path(tempfile.mkdtemp(prefix="hostpid-nri-go-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def test_control_stub_adjustment_is_reported(programs: NriPrograms, workdir: Path) -> None:
    """NRI's own stub plugin, through NRI's own runtime side: its env reaches the answer."""
    pod = nri_pod("p", str(uuid.uuid4()))
    socket = workdir / "nri.sock"
    driven = drive(programs, [PluginRun([str(programs.nristub), str(socket), "10"])], {
        "synchronize": {"pods": [pod], "containers": [nri_container("running", pod)]},
        "cases": [{"pod": pod, "container": nri_container("first", pod)},
                  {"pod": pod, "container": nri_container("second", pod)}],
    }, socket)
    assert driven.answer["synchronized"] and not driven.answer["syncError"]
    assert [driven.adjustment(i).get("env") for i in (0, 1)] == [
        [{"key": "NRISTUB_SEEN", "value": "first"}],
        [{"key": "NRISTUB_SEEN", "value": "second"}],
    ], driven.answer


# -- hostpid's plugin ---------------------------------------------------------------------


def plugin_argv(socket: Path, lock_parent: Path, broker_dir: Path, *extra: str) -> list[str]:
    """C{twistd hostpid-nri} on C{socket}, from the working tree."""
    return [*TWISTD, "--nodaemon", "--pidfile=", "hostpid-nri", "--nri-socket", str(socket),
            "--lock-parent", str(lock_parent), "--broker-dir", str(broker_dir), *extra]


def node_paths(workdir: Path) -> tuple[Path, Path]:
    """
    The lock parent and the broker's directory, both present: the plugin
    adjusts only while both bind sources exist on the host.
    """
    lock_parent, broker_dir = workdir / "vgpulock", workdir / "hostpid"
    lock_parent.mkdir(mode=0o1777)
    broker_dir.mkdir(mode=0o711)
    return lock_parent, broker_dir


def hostpid_plugin(socket: Path, lock_parent: Path, broker_dir: Path, workdir: Path,
                   *extra: str) -> PluginRun:
    """The plugin with its gate on, its output in C{workdir/plugin.log}."""
    return PluginRun(plugin_argv(socket, lock_parent, broker_dir, *extra),
                     subprocess_env({GATE_ENV: "1"}), workdir / "plugin.log")


def expected_gpu_adjustment(lock_parent: Path, broker_dir: Path) -> dict[str, Any]:
    """
    The canonical mounts (lock parent writable, then the broker directory
    read-only) and the gate, as NRI's runtime side merges them (protobuf
    JSON, proto field names).
    """
    return {
        "mounts": [
            {"destination": defaults.LOCK_PARENT, "type": "bind", "source": str(lock_parent),
             "options": ["rbind", "rprivate", "rw", "nosuid", "nodev", "noexec"]},
            {"destination": defaults.CONTAINER_BROKER_DIRECTORY, "type": "bind",
             "source": str(broker_dir),
             "options": ["rbind", "rprivate", "ro", "nosuid", "nodev", "noexec"]},
        ],
        "env": [{"key": GATE_ENV, "value": "1"}],
    }


def test_plugin_adjusts_only_allocated_containers(programs: NriPrograms, workdir: Path) -> None:
    """
    Registered with NRI's own runtime side, synchronized with a running GPU
    container (no update: running workloads keep what they have), the
    plugin answers each CreateContainer as the design says: a GPU device
    node gets the mounts and the gate; a CDI GPU device too; a container
    without an allocation nothing, whether or not its own env names the
    gate or a GPU; a pod that opts out nothing.  (A CDI GPU device reaches
    the plugin as the device nodes CDI injected: the NRI releases these
    containerds link have no C{CDI_devices} field in C{Container}.)
    """
    lock_parent, broker_dir = node_paths(workdir)
    pod = nri_pod("gpu", str(uuid.uuid4()), labels={"pod-security.kubernetes.io/enforce":
                                                     "restricted"})
    opted = nri_pod("opted", str(uuid.uuid4()), labels={"hostpid.hami.io/nri": "disabled"})
    gpu_env = {"NVIDIA_VISIBLE_DEVICES": "0"}
    cases = [
        nri_container("gpu", pod, env=gpu_env, devices=["/dev/nvidia0"]),
        nri_container("plain", pod),
        nri_container("forged", pod, env={GATE_ENV: "1", **gpu_env}),
        nri_container("gpu", opted, env=gpu_env, devices=["/dev/nvidia0"]),
        nri_container("wrong-gate", pod, env={GATE_ENV: "0"}, devices=["/dev/nvidia1"]),
    ]
    socket = workdir / "nri.sock"
    driven = drive(programs, [hostpid_plugin(socket, lock_parent, broker_dir, workdir)], {
        "synchronize": {"pods": [pod], "containers": [
            nri_container("running", pod, env=gpu_env, devices=["/dev/nvidia0"])]},
        "cases": [{"pod": opted if c["podSandboxId"] == opted["id"] else pod, "container": c}
                  for c in cases],
    }, socket)
    assert driven.answer["synchronized"] and not driven.answer["syncError"], driven.answer
    assert not driven.answer["syncUpdates"]
    gpu = expected_gpu_adjustment(lock_parent, broker_dir)
    got = [driven.adjustment(i) for i in range(len(cases))]
    assert got == [gpu, {}, {}, {}, gpu], (got, (workdir / "plugin.log").read_text())


def test_plugin_gate_off_registers_and_adjusts_nothing(programs: NriPrograms,
                                                      workdir: Path) -> None:
    lock_parent, broker_dir = node_paths(workdir)
    pod = nri_pod("gpu", str(uuid.uuid4()))
    socket = workdir / "nri.sock"
    env = subprocess_env()
    env.pop(GATE_ENV, None)
    plugin = PluginRun(plugin_argv(socket, lock_parent, broker_dir), env, workdir / "plugin.log")
    driven = drive(programs, [plugin], {
        "cases": [{"pod": pod, "container": nri_container("gpu", pod,
                                                          devices=["/dev/nvidia0"])}],
    }, socket)
    assert driven.adjustment(0) == {}


def test_plugin_beside_another_plugin(programs: NriPrograms, workdir: Path) -> None:
    """
    Two plugins at once, as on a node with a device-injecting plugin: NRI's
    runtime side merges both answers, and hostpid's adds nothing that
    conflicts (a conflict is an error that fails the container).
    """
    lock_parent, broker_dir = node_paths(workdir)
    pod = nri_pod("gpu", str(uuid.uuid4()))
    socket = workdir / "nri.sock"
    stub = PluginRun([str(programs.nristub), str(socket), "10"], log=workdir / "stub.log")
    driven = drive(programs, [stub, hostpid_plugin(socket, lock_parent, broker_dir, workdir)], {
        "cases": [{"pod": pod, "container": nri_container("gpu", pod,
                                                          devices=["/dev/nvidia0"])}],
    }, socket)
    adjust = driven.adjustment(0)
    gpu = expected_gpu_adjustment(lock_parent, broker_dir)
    assert adjust["mounts"] == gpu["mounts"]
    assert sorted(adjust["env"], key=lambda e: e["key"]) == [
        {"key": GATE_ENV, "value": "1"}, {"key": "NRISTUB_SEEN", "value": "gpu"}]
