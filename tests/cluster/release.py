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
import json
from pathlib import Path
from typing import Any

import helm_python as helm
from cluster import Cluster
from support import REPO, wait_for

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


def upgrade(config: helm.Config, chart: helm.Chart, values: dict[str, Any], *, reuse: str,
            dry_run: str | None = None, name: str = RELEASE, namespace: str = NAMESPACE) -> Any:
    """
    Helm's upgrade of the release with C{values} and the value flag C{reuse}.
    helm-python-sdk 0.2.2 (the version C{setup.cfg} pins) binds Helm's upgrade
    with every value flag in its native options (C{reset_then_reuse_values}
    among them: an unknown key is refused by name), but its Python signature
    names only C{reuse_values} and C{reset_values}: this calls the same
    native function with the flag the docs give.
    """
    from helm_python import _native
    from helm_python.config import _loads_obj

    flags = {"--reuse-values": "reuse_values", "--reset-values": "reset_values",
             "--reset-then-reuse-values": "reset_then_reuse_values"}
    options: dict[str, Any] = {"namespace": namespace, "timeout_seconds": 300, flags[reuse]: True}
    if dry_run is not None:
        options["dry_run"] = dry_run
    handle, reference = helm.Config._chart_args(chart)
    payload = _native.call_string(
        "helm_upgrade", config._raw(), helm.Config._context_arg(None), handle, reference,
        name, json.dumps(values), json.dumps(options))
    return _loads_obj(payload)


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

    def install(self, *expressions: str, chart: Path = CHART) -> Any:
        """C{helm install} of C{chart} (this one, or the chart as it was at an earlier commit)."""
        self.kube.namespace(self.namespace,
                            {"pod-security.kubernetes.io/enforce": "privileged"})
        values = merge(copy.deepcopy(self.base), sets(*expressions)) if expressions else \
            copy.deepcopy(self.base)
        with helm.Chart.load(chart) as loaded:
            result = self.config.install(loaded, self.name, values, namespace=self.namespace,
                                         timeout=300)
        self.revisions.append(values)
        return result

    def upgrade(self, *expressions: str, reuse: str = "--reset-then-reuse-values",
                dry_run: str | None = None) -> Any:
        """
        C{helm upgrade --reset-then-reuse-values --set ...} to this chart, as the
        docs write it; C{reuse="--reuse-values"} is the flag they had before.
        """
        with helm.Chart.load(CHART) as chart:
            return upgrade(self.config, chart, sets(*expressions), reuse=reuse,
                           dry_run=dry_run, name=self.name, namespace=self.namespace)

    def rollback(self, version: int | None = None) -> None:
        self.config.rollback(self.name, version=version, timeout=300)

    def uninstall(self) -> None:
        self.config.uninstall(self.name, ignore_not_found=True, timeout=300, wait="watcher")
        # Helm deletes the DaemonSets with background propagation and waits for
        # them alone: their pods go later, by the garbage collector.  A test that
        # installs next and counts the release's pods must not count those.
        wait_for(lambda: not self.kube.get(
            "pods", "-n", self.namespace, "-l", "app.kubernetes.io/part-of=hostpid")["items"],
            "the uninstalled release's pods to be gone", 180.0)

    def values(self) -> Any:
        return self.config.get_values(self.name)

    def rollout(self, kind: str, name: str, timeout: str = "180s") -> str:
        """C{kubectl rollout status}, as the docs run it."""
        return self.kube.kubectl("-n", self.namespace, "rollout", "status", f"{kind}/{name}",
                                 f"--timeout={timeout}", timeout=400)

    def close(self) -> None:
        self.config.close()
