"""
User-namespaced pods (C{hostUsers: false}) through runtimes that make
idmapped mounts: containerd 2.4 and CRI-O 1.34, each with runc 1.5.

The sandbox and container configs carry what the kubelet sends for such a
pod (L{kubeletlib.apply_user_namespace}: CRI C{userns_options}, mode C{POD},
65,536 IDs from L{USERNS_BASE}; the same mapping on every CRI mount).  Two
ways the broker reaches the container, as docs/userns.md says:

  - the NRI plugin's mounts: a plain read-only bind (NRI's C{Mount} has no
    mapping and the plugin never asks for C{idmap}), so the container sees
    the broker's directory owned by the overflow UID (65534);
  - the same directories as CRI mounts (a webhook's C{hostPath} volumes, a
    device plugin's mounts): the kubelet gives them the pod's mapping and
    runc 1.5 makes them idmapped, so the container sees them owned by 0.

In each the client (the static C client, as the pod's PID 1, UID 1000 of the
pod) must answer with the host PID the runtime reports.  The idmapped case
needs idmapped mounts on the filesystem that holds the private node (C{/tmp}):
its kernel probe (L{kernelfeatures}) says by name when it is absent.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import test_nri_containerd
from crilib import Containerds
from kernelfeatures import kernel_feature
from support import wait_for
from test_nri_containerd import (
    Adjustment,
    GpuNode,
    Kubelet,
    Plugin,
    adjusted,
    restricted_pod,
    run_pod,
)
from test_nri_tenant import mount_options

from hostpid.defaults import CONTAINER_BROKER_DIRECTORY, LOCK_PARENT
from hostpid.gate import GATE_ENV

pytestmark = pytest.mark.privileged

#: test_nri_containerd's fixtures, shared.
gpu_node = test_nri_containerd.gpu_node

#: The pod's mapping: host IDs 262144..327679 (a multiple of 65,536, as the
#: kubelet allocates; other than the integration tests' 100000).
USERNS_BASE = 4 * 65536
OVERFLOW_UID = 65534

#: The cells with an OCI runtime that makes idmapped mounts (runc 1.2+);
#: C{containerd21runc15} is the cluster tier's pairing.
USERNS_CELLS = ["runc15", "containerd21runc15", "crio"]

#: What the container reports besides L{test_nri_containerd.SCRIPT}: its
#: uid_map, the owner it sees of the broker's directory and its own
#: mountinfo lines of the lock parent and the broker's directory.
PROLOGUE = ('echo "uidmap $(cat /proc/self/uid_map)"; '
            'set -- $(ls -lnd /tmp/vgpulock/hostpid 2>/dev/null) x x x; '
            'echo "owner $3"; '
            f'grep {LOCK_PARENT} /proc/self/mountinfo | '
            'while read -r line; do echo "mountinfo $line"; done; ')


@pytest.fixture(scope="module", params=USERNS_CELLS)
def daemon(request: pytest.FixtureRequest, containerds: Containerds) -> Any:
    return containerds.runtime(request.param)


@pytest.fixture
def kubelet(daemon: Any) -> Kubelet:
    """Every pod it runs is user-namespaced."""
    return Kubelet(daemon, userns_base=USERNS_BASE)


def allocation(gpu_node: GpuNode) -> dict[str, Any]:
    """
    The GPU at its own path inside the container too.  In a user namespace
    runc makes a device node by binding the host's file at the OCI device's
    path (C{libcontainer/rootfs_linux.go} C{bindMountDeviceNode}: the spec
    has no host path), so the private fake GPU must keep its host path: a
    real GPU's C{/dev/nvidia0} does.  The plugin is told that path as its
    device signal (C{--resource device:PATH}).
    """
    path = str(gpu_node.device)
    return {"envs": {"NVIDIA_VISIBLE_DEVICES": "0"},
            "devices": [{"containerPath": path, "hostPath": path, "permissions": "rw"}]}


@pytest.fixture
def plugin(daemon: Any, gpu_node: GpuNode, kubelet: Kubelet) -> Iterator[Plugin]:
    """The plugin, its device signal the fake GPU's path; connected and adjusting."""
    started = Plugin(daemon, gpu_node.node, daemon.workdir / f"plugin-{uuid.uuid4().hex[:6]}.log",
                     ("--resource", f"device:{gpu_node.device}"))
    want = adjusted(gpu_node.node)

    def adjusting() -> bool:
        if started.process.poll() is not None:
            raise AssertionError(started.output())
        pod = userns_pod("probe")
        with kubelet.pod_sandbox(pod) as (sandbox_id, sandbox):
            container_id, _ = kubelet.create(pod, sandbox_id, sandbox, [allocation(gpu_node)])
            try:
                return Adjustment.of(kubelet.spec(container_id)) == want
            finally:
                kubelet.remove(container_id)

    try:
        wait_for(adjusting, "a user-namespaced GPU container adjusted by the plugin", 30.0)
        yield started
    finally:
        started.stop()


def userns_pod(name: str) -> dict[str, Any]:
    pod = restricted_pod(name)
    pod["spec"]["hostUsers"] = False
    (container,) = pod["spec"]["containers"]
    container["command"] = ["/bin/sh", "-c", PROLOGUE + container["command"][2]]
    return pod


def facts(stdout: str) -> dict[str, str]:
    found = {}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("uidmap", "owner", "ns-pid", "uid", "broker-mounts"):
            found[key] = " ".join(value.split())
    return found


def test_nri_plain_mount_in_a_user_namespace(kubelet: Kubelet, gpu_node: GpuNode,
                                             plugin: Plugin) -> None:
    """
    The NRI plugin's mounts in a user-namespaced GPU pod: plain, so the
    broker's directory shows as the overflow UID; the client's rule for a
    namespace without the host's root applies and it is told its host PID.
    Both mounts carry C{nosuid,nodev,noexec} in the container's own
    mountinfo (per-mount options): runc 1.5 applies the spec's flags to a
    bind mount in a user namespace too, by an C{MS_BIND|MS_REMOUNT} after the
    bind (C{libcontainer/rootfs_linux.go} C{mountToRootfs}, case C{"bind"}),
    and adding a flag is never refused there (only clearing a locked one).
    """
    run = run_pod(kubelet, "userns gpu, NRI mounts", userns_pod("userns-nri"),
                  [allocation(gpu_node)])
    seen = facts(run.stdout)
    print(f"\n[userns] NRI plain mount: {seen} answer={run.answer()}")
    assert run.adjustment == adjusted(gpu_node.node)
    assert seen["uidmap"] == f"0 {USERNS_BASE} 65536"
    assert seen["owner"] == str(OVERFLOW_UID)
    assert run.exit_code == 0, (run.stdout, run.stderr)
    assert run.answer() == (run.host_pid, 1)
    lock_parent = mount_options(run.stdout, LOCK_PARENT)
    broker = mount_options(run.stdout, CONTAINER_BROKER_DIRECTORY)
    print(f"[userns] NRI plain mount options: lock parent {sorted(lock_parent)}, "
          f"broker {sorted(broker)}")
    assert {"rw", "nosuid", "nodev", "noexec"} <= lock_parent, lock_parent
    assert {"ro", "nosuid", "nodev", "noexec"} <= broker, broker


@kernel_feature("idmapped_mounts")
def test_idmapped_cri_mounts_in_a_user_namespace(kubelet: Kubelet, gpu_node: GpuNode) -> None:
    """
    The same directories as CRI mounts with the pod's mapping (the
    webhook's C{hostPath} volumes and the gate; no NRI plugin connected):
    runc 1.5 makes them idmapped, the broker's directory shows as 0, and the
    client is told its host PID.
    """
    node = gpu_node.node
    mounts = {**allocation(gpu_node),
              "envs": {"NVIDIA_VISIBLE_DEVICES": "0", GATE_ENV: "1"},
              "mounts": [{"containerPath": "/tmp/vgpulock", "hostPath": str(node.lock_parent),
                              "readOnly": False},
                             {"containerPath": "/tmp/vgpulock/hostpid",
                              "hostPath": str(node.broker_dir), "readOnly": True}]}
    run = run_pod(kubelet, "userns gpu, idmapped CRI mounts", userns_pod("userns-idmap"),
                  [mounts])
    seen = facts(run.stdout)
    print(f"\n[userns] idmapped CRI mount: {seen} answer={run.answer()}")
    assert seen["uidmap"] == f"0 {USERNS_BASE} 65536"
    assert seen["owner"] == "0"
    assert run.exit_code == 0, (run.stdout, run.stderr)
    assert run.answer() == (run.host_pid, 1)
