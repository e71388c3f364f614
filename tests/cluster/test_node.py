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
