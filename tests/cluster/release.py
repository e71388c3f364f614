"""
The chart installed, upgraded and rolled back by Helm's own engine
(C{helm_python}: Helm 4's Go SDK through ctypes, the engine C{tests/test_chart.py}
renders with) against the cluster's real API server, with the values
C{docs/rollout.md} and C{docs/paths.md} tell a user to set, plus the node's
paths: this node's broker directory, lock parent, CDI directory and NRI
socket are private to the run (never the host's C{/tmp/vgpulock} or
C{/var/run/hami}), and the image is the one imported into containerd.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
from cluster import Cluster
from support import REPO

CHART = REPO / "deploy" / "helm" / "hostpid-broker"
RELEASE = "hostpid-broker"
NAMESPACE = "hostpid"


def sets(*expressions: str) -> dict[str, Any]:
    """Values as C{helm --set EXPR ...} gives them (Helm's own parser)."""
    from test_chart import sets as helm_sets

    return helm_sets(*expressions)


def merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    from test_chart import merge as helm_merge

    return helm_merge(base, more)


class Paths:
    """The node's private paths, as host paths the chart mounts."""

    def __init__(self, kube: Cluster) -> None:
        root = kube.node_root
        self.broker_dir = root / "hami" / "hostpid"
        #: The lock parent's parent (the chart mounts it, type Directory).
        self.lock_root = root / "tmp"
        self.lock_parent = self.lock_root / "vgpulock"
        self.lock_root.mkdir(parents=True, exist_ok=True)
        self.lock_root.chmod(0o1777)
        self.cdi_dir: Path = kube.containerd.cdi_dir
        self.nri_socket: Path = kube.containerd.nri_socket
        #: The GPUs user-namespaced pods get, at their own host paths
        #: (L{deviceplugin.DevicePlugin.at_host_path}): the NRI plugin is
        #: told them as a device signal beside the default C{nvidia.com/gpu}.
        self.userns_gpu_dir = kube.workdir / "dev-userns"

    def userns_gpu_signal(self) -> str:
        directory = str(self.userns_gpu_dir)
        assert all(c.isalnum() or c in "/_-." for c in directory), directory
        return f"device:re:{directory.replace('.', chr(92) + '.')}/nvidia[0-9]+"

    def values(self) -> dict[str, Any]:
        return {
            "broker": {"directory": str(self.broker_dir), "lockParent": str(self.lock_parent),
                       "cdi": {"enabled": True, "directory": str(self.cdi_dir)}},
            # The lock parent is in this run's node root, not directly in /tmp: its
            # directories are root's (tempfile's 0700 run directory, a 01777 tmp).
            "nri": {"socket": str(self.nri_socket), "allowLockParentOutsideTmp": True,
                    "resources": ["nvidia.com/gpu", self.userns_gpu_signal()]},
        }


class Release:
    """One Helm release of the chart, C{name} in C{namespace} (L{RELEASE} in L{NAMESPACE})."""

    def __init__(self, kube: Cluster, repository: str, tag: str, name: str = RELEASE,
                 namespace: str = NAMESPACE) -> None:
        self.kube = kube
        self.name, self.namespace = name, namespace
        self.paths = Paths(kube)
        self.config = helm.Config(kubeconfig_path=kube.kubeconfig, namespace=namespace)
        #: The values given at install, as docs/rollout.md step 1 gives them.
        self.base = merge(sets(f"image.repository={repository}", f"image.tag={tag}",
                               "hostPIDBroker.enabled=false"), self.paths.values())
        self.revisions: list[dict[str, Any]] = []

    def install(self, *expressions: str) -> Any:
        self.kube.namespace(self.namespace,
                            {"pod-security.kubernetes.io/enforce": "privileged"})
        values = merge(copy.deepcopy(self.base), sets(*expressions)) if expressions else \
            copy.deepcopy(self.base)
        with helm.Chart.load(CHART) as chart:
            result = self.config.install(chart, self.name, values, namespace=self.namespace,
                                         timeout=300)
        self.revisions.append(values)
        return result

    def upgrade(self, *expressions: str) -> Any:
        """C{helm upgrade --reuse-values --set ...}, as the docs write it."""
        with helm.Chart.load(CHART) as chart:
            result = self.config.upgrade(chart, self.name, sets(*expressions),
                                         namespace=self.namespace, reuse_values=True,
                                         timeout=300)
        return result

    def rollback(self, version: int | None = None) -> None:
        self.config.rollback(self.name, version=version, timeout=300)

    def uninstall(self) -> None:
        self.config.uninstall(self.name, ignore_not_found=True, timeout=300, wait="watcher")

    def values(self) -> Any:
        return self.config.get_values(self.name)

    def rollout(self, kind: str, name: str, timeout: str = "180s") -> str:
        """C{kubectl rollout status}, as the docs run it."""
        return self.kube.kubectl("-n", self.namespace, "rollout", "status", f"{kind}/{name}",
                                 f"--timeout={timeout}", timeout=400)

    def close(self) -> None:
        self.config.close()
