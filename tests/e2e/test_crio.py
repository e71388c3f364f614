"""
CRI-O's own behaviour, measured on the built CRI-O (L{builds.CRIO}) where it
differs from containerd or where the NRI plugin's decision relies on it.

  - its default configuration (C{crio config --default}): NRI on, the
    socket C{/var/run/nri/nri.sock}, and a default runtime handler that
    allows the C{io.kubernetes.cri-o.Devices} annotation for the devices
    C{allowed_devices} names (C{/dev/fuse}, C{/dev/net/tun});
  - what the NRI plugin is shown at CreateContainer: the kubelet's devices,
    CDI devices (the field, and the device nodes CDI injects) and a device
    plugin's C{/dev/null} mounts are all in the container NRI sees
    (CRI-O's C{server/container_create.go}: C{specSetDevices}, with CDI
    injection, runs before C{s.nri.createContainer}), as on containerd;
  - what a pod's own annotation puts into C{linux.devices}: with the
    default handler, any device C{allowed_devices} names, at any path under
    C{/dev} the pod chooses (C{internal/config/device/device_linux.go}
    C{DevicesFromAnnotation}: the host path must be allowed, the container
    path only has to start with C{/dev/}), so a restricted pod can show NRI
    a C{/dev/nvidia0} that is C{/dev/fuse}.  The plugin must not take that
    for a GPU;
  - with bookworm's crun 1.8.1, CRI-O 1.34 creates no container.

Run with C{pytest -s} to see what was measured.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import test_nri_containerd
from crilib import RUNTIMES, Containerds, grpc_module, running_runtime
from criolib import STRICT_HANDLER, Crio, default_config, default_handler, running_crio
from test_nri_containerd import (
    NOTHING,
    NVIDIA_MAJOR,
    Adjustment,
    GpuNode,
    Kubelet,
    Plugin,
    adjusted,
    gpu_on,
    restricted_pod,
)
from test_runc import private_node

from hostpid.nri.decision import NVIDIA_DEVICE_LIST_DIR

pytestmark = pytest.mark.privileged

#: test_nri_containerd's fixtures, shared.
gpu_node = test_nri_containerd.gpu_node
kubelet = test_nri_containerd.kubelet
plugin = test_nri_containerd.plugin

DEVICES_ANNOTATION = "io.kubernetes.cri-o.Devices"


@pytest.fixture(scope="module", params=["crio"])
def daemon(request: pytest.FixtureRequest, containerds: Containerds) -> Crio | Any:
    return containerds.runtime(request.param)


def test_crio_default_configuration() -> None:
    """
    What a stock CRI-O does with no configuration file: NRI on at the
    socket a plugin's default finds, and a default handler that lets a pod's
    annotation add devices.
    """
    from crilib import built

    defaults = default_config(built("crio"))
    nri = defaults["crio"]["nri"]
    handler = default_handler(defaults)
    print(f"\n[crio] default: nri={nri} handler="
          f"{defaults['crio']['runtime']['default_runtime']} "
          f"allowed_annotations={handler.get('allowed_annotations')} "
          f"allowed_devices={defaults['crio']['runtime'].get('allowed_devices')}")
    assert nri["enable_nri"] is True
    assert nri["nri_listen"] == "/var/run/nri/nri.sock"
    assert nri["nri_disable_connections"] is False
    assert DEVICES_ANNOTATION in handler["allowed_annotations"]
    assert defaults["crio"]["runtime"]["allowed_devices"] == ["/dev/fuse", "/dev/net/tun"]


def forging_pod(name: str, annotation: str) -> dict[str, Any]:
    """A restricted non-GPU pod whose own annotation asks CRI-O for a device."""
    pod = restricted_pod(name, gpu=False)
    pod["metadata"].setdefault("annotations", {})[DEVICES_ANNOTATION] = annotation
    return pod


def created_spec(kubelet: Kubelet, pod: dict[str, Any], handler: str = "",
                 allocations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The OCI spec of the pod's container, created (never started) and removed."""
    sandbox_id, sandbox = kubelet.sandbox(pod) if not handler else _sandbox(kubelet, pod,
                                                                            handler)
    try:
        container_id, _ = kubelet.create(pod, sandbox_id, sandbox, allocations or [])
        try:
            return kubelet.spec(container_id)
        finally:
            kubelet.remove(container_id)
    finally:
        kubelet.remove_sandbox(sandbox_id)


def _sandbox(kubelet: Kubelet, pod: dict[str, Any], handler: str) -> tuple[str, Any]:
    import kubeletlib

    sandbox = kubeletlib.sandbox_config(
        kubelet.pb, pod, kubelet.daemon.log_dir,
        f"{kubelet.daemon.cgroup_parent}/pod{pod['metadata']['uid']}")
    Path(sandbox.log_directory).mkdir(mode=0o755, parents=True, exist_ok=True)
    response = kubelet.cri.runtime("RunPodSandbox", config=sandbox, runtime_handler=handler)
    return response.pod_sandbox_id, sandbox


def devices_at(spec: dict[str, Any], path: str) -> list[tuple[str, int, int]]:
    return [(d["type"], d["major"], d["minor"]) for d in spec["linux"].get("devices", ())
            if d["path"] == path]


def test_pod_annotation_device_is_not_a_gpu(kubelet: Kubelet, gpu_node: GpuNode,
                                            plugin: Plugin) -> None:
    """
    A restricted pod with no GPU annotates itself
    C{io.kubernetes.cri-o.Devices: /dev/fuse:/dev/nvidia0:rw}.  CRI-O's
    default handler lets it through: the spec NRI sees has a character
    device at C{/dev/nvidia0} (FUSE's 10:229).  The plugin gives it
    nothing: a GPU device node is NVIDIA's major 195, not its path alone.
    Under a handler that allows no annotation the device is not there at all.
    """
    forged = created_spec(kubelet, forging_pod("forge", "/dev/fuse:/dev/nvidia0:rw"))
    fuse = os.stat("/dev/fuse").st_rdev
    assert devices_at(forged, "/dev/nvidia0") == [("c", os.major(fuse), os.minor(fuse))]
    strict = created_spec(kubelet, forging_pod("forge-strict", "/dev/fuse:/dev/nvidia0:rw"),
                          handler=STRICT_HANDLER)
    assert devices_at(strict, "/dev/nvidia0") == []
    print(f"\n[crio] pod annotation {DEVICES_ANNOTATION}: default handler "
          f"{devices_at(forged, '/dev/nvidia0')}, strict handler none; plugin: "
          f"{Adjustment.of(forged)}")
    assert Adjustment.of(forged) == NOTHING
    assert Adjustment.of(strict) == NOTHING


#: What the operator lists in C{allowed_devices}: the GPU's node (195:0), or
#: NVIDIA's control node (C{/dev/nvidiactl}, 195:255), which shares the GPUs'
#: major and is no GPU.
ALLOWED_MINORS = {"gpu": 0, "nvidiactl": 255}


@pytest.fixture(params=sorted(ALLOWED_MINORS))
def gpu_allowed(request: pytest.FixtureRequest, cri_image: Path,
                cri_messages: ModuleType) -> Iterator[tuple[Crio, GpuNode, Path]]:
    """
    A CRI-O whose operator listed an NVIDIA device node in C{allowed_devices}
    (for a GPU's node, the misconfiguration docs/nri.md forbids), a broker on
    a private node; the node allowed.
    """
    with private_node() as node, gpu_on(node) as gpu:
        allowed = gpu.device
        if request.param != "gpu":
            allowed = gpu.device.parent / request.param
            os.mknod(allowed, 0o666 | stat.S_IFCHR,
                     os.makedev(NVIDIA_MAJOR, ALLOWED_MINORS[request.param]))
        with running_crio(cri_image, cri_messages, RUNTIMES["crio"].oci_binary(),
                          allowed_devices=(str(allowed),)) as crio:
            yield crio, gpu, allowed


def test_allowed_gpu_device_lets_any_pod_take_a_gpu(
        gpu_allowed: tuple[Crio, GpuNode, Path]) -> None:
    """
    The misconfiguration: a GPU device node in C{allowed_devices} while the
    default handler allows the annotation.  Then any pod's annotation gives
    it that GPU, with no allocation, and to NRI it is a GPU container like
    any other (the plugin adjusts it): nothing at the runtime tells it from
    a device plugin's.  docs/nri.md says an operator must not do this.
    NVIDIA's control node allowed instead (a pod annotating itself
    C{/dev/nvidiactl} at C{/dev/nvidia0}: 195:255 there) is no GPU: the
    plugin gives it nothing.
    """
    crio, node, allowed = gpu_allowed
    minor = os.minor(os.stat(allowed).st_rdev)
    kubelet = Kubelet(crio)
    from support import wait_for
    from test_nri_containerd import probe

    started = Plugin(crio, node.node, crio.workdir / "plugin.log")
    try:
        wait_for(lambda: probe(kubelet, node) == adjusted(node.node),
                 "the plugin to adjust a GPU container", 30.0)
        spec = created_spec(kubelet, forging_pod("taken", f"{allowed}:/dev/nvidia0:rw"))
    finally:
        started.stop()
    assert devices_at(spec, "/dev/nvidia0") == [("c", NVIDIA_MAJOR, minor)]
    assert Adjustment.of(spec) == (adjusted(node.node) if minor == 0 else NOTHING)


def cdi_spec(kubelet: Kubelet, device: Path | None, name: str) -> None:
    """A CDI spec of kind C{nvidia.com/gpu} in the runtime's CDI directory."""
    edits: dict[str, Any] = {"env": ["HOSTPID_E2E_CDI=1"]}
    if device is not None:
        edits["deviceNodes"] = [{"path": "/dev/nvidia0", "hostPath": str(device)}]
    spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": name, "containerEdits": edits}]}
    (kubelet.daemon.cdi_dir / f"e2e-{name}.json").write_text(json.dumps(spec))


@pytest.mark.parametrize("daemon", ["crio", "containerd24"], indirect=True)
@pytest.mark.parametrize("signal", ["kubelet-device", "cdi-device-node", "devnull-mount"])
def test_signals_the_plugin_sees(kubelet: Kubelet, gpu_node: GpuNode, plugin: Plugin,
                                 signal: str) -> None:
    """
    Each trusted signal alone, as the kubelet passes it: the runtime has
    applied it (devices, CDI edits, mounts) before NRI sees the container,
    so the plugin adjusts it.
    """
    spec = signalled_spec(kubelet, gpu_node, signal)
    if signal == "cdi-device-node":
        assert devices_at(spec, "/dev/nvidia0") == [("c", NVIDIA_MAJOR, 0)]
    assert Adjustment.of(spec) == adjusted(gpu_node.node)


@pytest.mark.parametrize("daemon", ["crio", "containerd24"], indirect=True)
def test_cdi_field_reaches_nri_on_containerd_only(daemon: Crio | Any, kubelet: Kubelet,
                                                  gpu_node: GpuNode, plugin: Plugin) -> None:
    """
    The difference: a CDI device (the kubelet's C{CDI_devices} field) whose
    edits add no device node.  containerd shows NRI the CDI devices
    (C{GetCDIDevices}), so the plugin's C{cdi} signal adjusts it; CRI-O 1.34
    shows none (its NRI container, C{server/nri-api.go} C{criContainer}, has
    no C{GetCDIDevices}), so there only what the CDI edits added counts: a
    GPU's CDI spec adds its C{/dev/nvidia*} nodes, which is the device
    signal (L{test_signals_the_plugin_sees}).
    """
    spec = signalled_spec(kubelet, gpu_node, "cdi-field")
    assert devices_at(spec, "/dev/nvidia0") == []
    want = NOTHING if isinstance(daemon, Crio) else adjusted(gpu_node.node)
    assert Adjustment.of(spec) == want


def signalled_spec(kubelet: Kubelet, gpu_node: GpuNode, signal: str) -> dict[str, Any]:
    """The spec of a restricted pod's container whose allocation carries C{signal} alone."""
    name = uuid.uuid4().hex[:8]
    allocation: dict[str, Any] = {"envs": {"NVIDIA_VISIBLE_DEVICES": "0"}}
    if signal == "kubelet-device":
        allocation = gpu_node.allocation()
    elif signal in ("cdi-field", "cdi-device-node"):
        cdi_spec(kubelet, gpu_node.device if signal == "cdi-device-node" else None, name)
        allocation["cdiDevices"] = [{"name": f"nvidia.com/gpu={name}"}]
    else:
        allocation["mounts"] = [{"containerPath": f"{NVIDIA_DEVICE_LIST_DIR}/GPU-{name}",
                                 "hostPath": "/dev/null", "readOnly": True}]
    spec = created_spec(kubelet, restricted_pod(f"sig-{signal}"), allocations=[allocation])
    print(f"\n[signals] {kubelet.daemon.__class__.__name__} {signal}: "
          f"devices={devices_at(spec, '/dev/nvidia0')} adjusted={Adjustment.of(spec)}")
    return spec


def test_crio_with_bookworms_crun_creates_no_container(
        cri_image: Path, cri_messages: ModuleType) -> None:
    """
    CRI-O 1.34 writes runtime-spec 1.2.1; bookworm's crun 1.8.1 refuses it,
    so the CRI-O cells run runc 1.5 (L{crilib.RUNTIMES}).
    """
    with running_runtime(RUNTIMES["criocrun"], cri_image, cri_messages, nri=False) as crio:
        kubelet = Kubelet(crio)
        with pytest.raises(grpc_module().RpcError) as refused:
            created_spec(kubelet, restricted_pod("crun", gpu=False))
    details = refused.value.details()  # type: ignore[attr-defined]
    print(f"\n[crio] with crun 1.8.1: {details!r}")
    assert "unknown version specified" in details
