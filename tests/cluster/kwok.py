"""
Simulated GPU nodes on the tier's own control plane: KWOK's controller
(C{kwok}, built once by L{components.kwok}) attached to the tier's API
server with the admin kubeconfig, managing only the nodes labelled
L{FAKE_LABEL}C{=fake}.  The API server, controller manager (its DaemonSet
controller) and scheduler are the tier's real ones; only the kubelet is
simulated, by KWOK's stages: the release's own default node and pod stages
(C{components.KWOK_STAGES}, as C{kwokctl} gives a cluster), with the time a
chart's pod takes to become Ready, and to go once deleted, set per component
(L{Delays}) from what the real node measured (L{stages}).

Each node is shaped like a GPU node: HAMi's label (C{gpu: "on"}) or NVIDIA's
feature discovery's (C{nvidia.com/gpu.present: "true"}), C{nvidia.com/gpu}
capacity, and two taints: NVIDIA's C{nvidia.com/gpu} NoSchedule (the chart
tolerates it by default) and KWOK's own, so that no pod of another test is
placed on a node nothing runs; the fleet's releases tolerate it
(L{TOLERATION}).
"""

from __future__ import annotations

import copy
import json
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import components
import yaml
from cluster import Cluster, Process, free_port

#: The label (and annotation) KWOK manages nodes by.
FAKE_LABEL = "kwok.x-k8s.io/node"
#: The taint that keeps every other pod off the simulated nodes.
FAKE_TAINT = {"key": FAKE_LABEL, "value": "fake", "effect": "NoSchedule"}
TOLERATION = {"key": FAKE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
#: NVIDIA's GPU taint, as GPU node pools commonly carry it (the chart tolerates it).
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
#: The GPU labels, alternately: HAMi's chart's and NVIDIA's feature discovery's.
GPU_LABELS = ({"gpu": "on"}, {"nvidia.com/gpu.present": "true"})
GPUS_PER_NODE = "8"
#: The pods' addresses KWOK hands out (only ever written into pod status).
POD_CIDR = "10.240.0.1/16"
#: KWOK renews each node's Lease every quarter of this (the kubelet's rule),
#: inside the node lifecycle controller's grace period (50 s).
LEASE_SECONDS = 160
#: The label by which the stages tell the chart's pods apart.
COMPONENT = "app.kubernetes.io/component"


@attrs.frozen
class Delays:
    """
    Seconds a component's pod takes on a real node: from its creation to
    Ready (C{ready}) and from its deletion to gone (C{gone}).
    """

    ready: float
    gone: float


def node(name: str, index: int) -> dict[str, Any]:
    """A simulated GPU node (its status is KWOK's node stages' to keep)."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110",
                 "nvidia.com/gpu": GPUS_PER_NODE}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {FAKE_LABEL: "fake", "kubernetes.io/hostname": name,
                       "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                       **GPU_LABELS[index % len(GPU_LABELS)]},
            "annotations": {FAKE_LABEL: "fake"},
        },
        "spec": {"taints": [FAKE_TAINT, GPU_TAINT]},
        "status": {"allocatable": resources, "capacity": resources},
    }


def _with(stage: dict[str, Any], name: str, expression: dict[str, Any],
          seconds: float | None) -> dict[str, Any]:
    out = copy.deepcopy(stage)
    out["metadata"]["name"] = name
    out["spec"]["selector"]["matchExpressions"].append(expression)
    if seconds:
        milliseconds = max(1, round(seconds * 1000))
        # KWOK waits a random time between the two (its jitter is the upper
        # bound): within a tenth of the measured time.
        out["spec"]["delay"] = {"durationMilliseconds": milliseconds,
                                "jitterDurationMilliseconds": milliseconds
                                + max(1, milliseconds // 10)}
    return out


def stages(defaults: Sequence[dict[str, Any]],
           delays: Mapping[str, Delays]) -> list[dict[str, Any]]:
    """
    KWOK's default stages, with the C{pod-ready} and C{pod-delete} stages
    split per component of C{delays} (each waiting that component's time)
    and left as they are, immediate, for every other pod.
    """
    key = f'.metadata.labels["{COMPONENT}"]'
    out = []
    for stage in defaults:
        name = stage["metadata"]["name"]
        if name not in ("pod-ready", "pod-delete"):
            out.append(stage)
            continue
        out.append(_with(stage, name, {"key": key, "operator": "NotIn",
                                       "values": sorted(delays)}, None))
        for component, delay in sorted(delays.items()):
            seconds = delay.ready if name == "pod-ready" else delay.gone
            out.append(_with(stage, f"{name}-{component}",
                             {"key": key, "operator": "In", "values": [component]}, seconds))
    return out


def default_stages(kwok_dir: Path) -> list[dict[str, Any]]:
    return [yaml.safe_load((kwok_dir / "stages" / Path(path).name).read_text())
            for path in components.KWOK_STAGES]


class Kwok:
    """KWOK's controller on the tier's API server, and the nodes it simulates."""

    def __init__(self, kube: Cluster) -> None:
        self.kube = kube
        self.dir = components.kwok()
        self.process: Process | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="kwok-", dir=kube.workdir))
        self.nodes: list[str] = []

    def version(self) -> str:
        return subprocess.run([str(self.dir / "bin" / "kwok"), "--version"],
                              capture_output=True, text=True, timeout=60,
                              check=False).stdout.strip()

    def start(self, delays: Mapping[str, Delays]) -> None:
        config = self.workdir / "stages.yaml"
        config.write_text(yaml.safe_dump_all(stages(default_stages(self.dir), delays)))
        self.process = Process("kwok", [
            str(self.dir / "bin" / "kwok"), "--kubeconfig", str(self.kube.kubeconfig),
            "--config", str(config),
            "--manage-nodes-with-label-selector", f"{FAKE_LABEL}=fake",
            "--node-lease-duration-seconds", str(LEASE_SECONDS),
            "--cidr", POD_CIDR, "--node-ip", "10.241.0.1",
            "--server-address", f"127.0.0.1:{free_port()}"],
            self.workdir / "kwok.log")
        self.process.start()

    def check(self) -> None:
        assert self.process is not None, "KWOK is not started"
        self.process.check()

    def add_nodes(self, count: int, prefix: str = "fleet", workers: int = 4) -> list[str]:
        """C{count} more simulated GPU nodes, created by C{workers} kubectl processes."""
        first = len(self.nodes)
        names = [f"{prefix}-{i:05d}" for i in range(first, first + count)]
        lists = [{"apiVersion": "v1", "kind": "List",
                  "items": [node(name, first + i) for i, name in enumerate(names)
                            if i % workers == w]} for w in range(workers)]

        def create(items: dict[str, Any]) -> None:
            if items["items"]:
                self.kube.kubectl("create", "-f", "-", "-o", "name",
                                  input=json.dumps(items), timeout=1800)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(create, lists))
        self.nodes.extend(names)
        return names

    def ready_nodes(self) -> int:
        """How many simulated nodes report Ready."""
        output = self.kube.kubectl(
            "get", "nodes", "-l", f"{FAKE_LABEL}=fake", "-o",
            'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}'
            '{"\\n"}{end}', timeout=600)
        return output.split().count("True")

    def remove_nodes(self) -> None:
        if self.nodes:
            self.kube.kubectl_run("delete", "nodes", "-l", f"{FAKE_LABEL}=fake",
                                  "--wait=false", timeout=1800)
            self.nodes = []

    def stop(self) -> None:
        """Delete the simulated nodes, then stop KWOK (once: a second call does nothing)."""
        if not self.kube.closed:
            self.remove_nodes()
        if self.process is not None:
            self.process.stop()
            self.process = None
