"""
The node itself, before any chart: every component at the release the tier
names, the device plugin's GPUs allocatable, and a GPU pod created through
the API server, scheduled, allocated by the device plugin and run by the
kubelet on containerd.
"""

from __future__ import annotations

import components
import workloads
from cluster import Cluster
from deviceplugin import DevicePlugin
from support import wait_for


def test_components_report_the_release(kube: Cluster) -> None:
    print(dict(kube.versions))
    for command in components.COMMANDS:
        assert components.KUBERNETES_VERSION in kube.versions[command], kube.versions
    assert kube.versions["etcd"].startswith("etcd Version: 3."), kube.versions


def test_gpu_pod_runs_with_its_device(kube: Cluster, gpus: DevicePlugin) -> None:
    """No chart at all: the device plugin's node reaches the container, nothing else does."""
    kube.namespace("node-smoke")
    before = len(gpus.allocations)
    run = workloads.run(kube, workloads.pod("node-smoke", "gpu"))
    assert len(gpus.allocations) == before + 1
    assert run.nspid == (run.host_pid, 1)
    assert run.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0",
                           "uid": "1000", "gpu": "present", "socket": "absent"}, run.stdout
    assert run.exit_code == 1 and "hostpid_client: gate: " in run.stdout, run.stdout


def test_gpu_pod_runs_with_its_cdi_device(kube: Cluster, gpus: DevicePlugin,
                                          deviceplugin_messages: object) -> None:
    """
    The device plugin's other mode: CDI names in C{cdiDevices} and a spec in
    containerd's CDI directory; the kubelet passes the names to the runtime,
    which makes the device node from the spec.  Then the session's plugin
    (device nodes) registers again.
    """
    from types import ModuleType

    assert isinstance(deviceplugin_messages, ModuleType)
    kube.namespace("node-smoke")
    cdi = DevicePlugin(deviceplugin_messages, kube.workdir / "dev-cdi", 4, "cdi",
                       cdi_dir=kube.containerd.cdi_dir, name="hostpid-test-gpu-cdi")
    cdi.start()
    try:
        wait_for(lambda: kube.get("node", "hostpid-node")["status"]["allocatable"]
                 .get("nvidia.com/gpu") == "4", "the CDI plugin's GPUs", 60.0)
        run = workloads.run(kube, workloads.pod("node-smoke", "gpu-cdi"))
        assert len(cdi.allocations) == 1
        assert run.facts()["gpu"] == "present", run.stdout
        assert run.facts()["gate"] == "unset"
    finally:
        cdi.stop()
        workloads.restore_session_gpus(kube, gpus)
