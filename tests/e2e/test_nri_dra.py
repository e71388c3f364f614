"""
A GPU from a ResourceClaim, on each CRI runtime of the NRI set
(L{test_nri_containerd.NRI_CELLS}: containerd 1.7, 2.1, 2.4 and CRI-O): the
container is created as the kubelet creates a DRA pod's, with the claim's
CDI device names in C{ContainerConfig.CDIDevices} and the driver's CDI specs
(shaped like HAMi's, L{hamidra}) in the runtime's CDI directory, so the
runtime injects the device node and the driver's own bind of the lock
parent before NRI sees the container.

What each cell shows:

- the plugin adds the broker mount and the gate and keeps the driver's
  lock parent mount: one mount at C{/tmp/vgpulock}, with the driver's
  options (C{nosuid,nodev}, no C{noexec}), one at C{/tmp/vgpulock/hostpid};
  the client answers with its own host PID;
- which signal qualified the container: the plugin is given the driver's
  CDI kind before the NVIDIA preset, and its log names the first signal
  found.  Only a runtime built with NRI 0.12 (containerd 2.4.2: NRI's
  C{Container.CDI_devices}, field 20, from the CRI C{CDIDevices}) shows NRI
  the CDI names, so the CDI kind qualifies there; containerd 1.7 and 2.1
  (NRI 0.8, no such field) and CRI-O 1.34 show none, and the device node
  the CDI edits injected (major 195) qualifies there.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hamidra import (
    CDI_CLAIM_KIND,
    CDI_DEVICE_KIND,
    CDI_VENDOR,
    claim_edits,
    device_name,
    hook_files,
    standard_spec,
    write_json,
)
from test_nri_containerd import (  # noqa: F401 (fixtures)
    WORKLOAD_UID,
    GpuNode,
    Kubelet,
    Plugin,
    adjusted,
    adjusting_plugin,
    daemon,
    gpu_node,
    kubelet,
    restricted_pod,
    run_pod,
)

from hostpid import defaults

#: The cells whose NRI shows the plugin a container's CDI names.
CDI_NAMES_SHOWN = ("containerd24",)
#: What the plugin's log names for each signal (L{hostpid.nri.decision.allocation_signal}).
BY_CDI = f"GPU allocation: CDI device of kind {CDI_DEVICE_KIND}"
BY_DEVICE = "GPU allocation: device /dev/nvidia0"


@pytest.fixture
def cdi_first_plugin(daemon: Any, gpu_node: GpuNode, kubelet: Kubelet) -> Iterator[Plugin]:  # noqa: F811
    """The plugin, told the driver's CDI kind first, then the NVIDIA preset."""
    with adjusting_plugin(daemon, gpu_node, kubelet, ("--resource", f"cdi:{CDI_DEVICE_KIND}",
                                                      "--resource", "nvidia.com/gpu")) as started:
        yield started


@pytest.fixture
def claim(daemon: Any, gpu_node: GpuNode) -> Iterator[dict[str, Any]]:  # noqa: F811
    """
    A prepared claim of one device: the driver's specs in the runtime's CDI
    directory, and the allocation the kubelet hands the runtime (its CDI
    names, nothing else).
    """
    cdi_dir: Path = daemon.cdi_dir
    uid = str(uuid.uuid4())
    device = device_name(0)
    hooks = hook_files(gpu_node.node.broker_dir.parent.parent / "vgpu")
    files = [cdi_dir / f"{CDI_VENDOR}-device.json", cdi_dir / f"{CDI_VENDOR}-claim_{uid}.json"]
    write_json(files[0], standard_spec({"0": gpu_node.device}))
    write_json(files[1], {"cdiVersion": "0.5.0", "kind": CDI_CLAIM_KIND, "devices": [
        {"name": f"{uid}-{device}", "containerEdits": claim_edits(
            [{"device": device, "consumedCapacity": {"cores": "50", "memory": "8Gi"}}],
            hooks, gpu_node.node.lock_parent)}]})
    try:
        yield {"cdiDevices": [{"name": f"{CDI_DEVICE_KIND}={device}"},
                              {"name": f"{CDI_CLAIM_KIND}={uid}-{device}"}]}
    finally:
        for path in files:
            path.unlink(missing_ok=True)


def test_claim_gets_the_broker_once(request: pytest.FixtureRequest,
                                    daemon: Any, kubelet: Kubelet,  # noqa: F811
                                    gpu_node: GpuNode, cdi_first_plugin: Plugin,  # noqa: F811
                                    claim: dict[str, Any]) -> None:
    seen: dict[str, Any] = {}

    def look(host_pid: int) -> None:
        seen["mounts"] = [
            (fields[4], tuple(fields[5].split(",")))
            for fields in (line.split() for line in
                           Path(f"/proc/{host_pid}/mountinfo").read_text().splitlines())
            if fields[4] in (defaults.LOCK_PARENT, defaults.CONTAINER_BROKER_DIRECTORY)]
        seen["environ"] = Path(f"/proc/{host_pid}/environ").read_bytes().split(b"\0")

    run = run_pod(kubelet, "DRA claim", restricted_pod("dra"), [claim], before_go=look)
    runtime = request.node.callspec.params["daemon"]
    print(f"\n[nri-dra] {runtime}: mounts {seen['mounts']}")
    # The spec's mounts: the driver's lock parent (its source is the node's lock
    # parent, so the plugin adds none) and the plugin's broker directory, once each.
    assert run.adjustment == adjusted(gpu_node.node), run.adjustment
    ((lock, lock_options), (broker, broker_options)) = seen["mounts"]
    assert (lock, broker) == (defaults.LOCK_PARENT, defaults.CONTAINER_BROKER_DIRECTORY)
    assert {"rw", "nosuid", "nodev"} <= set(lock_options) and "noexec" not in lock_options
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(broker_options)
    assert b"CUDA_DEVICE_SM_LIMIT_0=50" in seen["environ"]
    assert run.exit_code == 0, (run.stdout, run.stderr, cdi_first_plugin.output())
    assert run.facts() == {"ns-pid": "1", "gate": "1", "broker-mounts": "1",
                           "uid": str(WORKLOAD_UID), "gpu": "present",
                           "socket": "present"}, run.stdout
    assert run.answer() == (run.host_pid, 1)
    # Which signal qualified it: the CDI names where the runtime shows them.
    lines = [line for line in cdi_first_plugin.output().splitlines()
             if "broker mounts and gate added" in line and "/dra-" in line]
    print(f"[nri-dra] {runtime}: {lines}")
    (line,) = lines
    cell = request.node.callspec.params["daemon"]
    expected = BY_CDI if cell in CDI_NAMES_SHOWN else BY_DEVICE
    assert expected in line, line
