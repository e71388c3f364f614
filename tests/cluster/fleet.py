"""
The chart's two DaemonSets on a fleet: the real node plus KWOK's simulated
GPU nodes (L{kwok}), one release of the chart (L{RELEASE} in L{NAMESPACE},
its own, so that the tier's other release is untouched), its rollouts
measured as an operator sees them: from C{helm upgrade} to what C{kubectl
rollout status} calls done (every wanted node's pod updated and available),
each DaemonSet's status read every L{POLL} seconds.

The simulated pods' time to Ready and to go comes from the real node
(L{measure_node}): the first upgrade is watched there, pod by pod, before
KWOK starts.  Shared by the tier's test (C{test_fleet.py}) and the bench
(C{bench/fleet.py}).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs
from cluster import NODE_NAME, Cluster
from kwok import TOLERATION, Delays
from release import Release

NAMESPACE = "hostpid-fleet"
RELEASE = "hostpid-fleet"
#: Each DaemonSet by its pods' component label.
DAEMONSETS = {"broker": "hostpid-broker", "nri-plugin": "hostpid-nri"}
#: Seconds between two reads of the DaemonSets' status.
POLL = 1.0

#: The release's values beside the tier's paths: both DaemonSets, the broker
#: serving (its readiness then is the real one: the handover's ready file and
#: a real transaction) in a broker directory of its own and without CDI (the
#: tier's other release keeps its own on the real node), the chart's default
#: tolerations plus KWOK's taint.
VALUES = ("nri.enabled=true", "hostPIDBroker.enabled=true", "broker.cdi.enabled=false",
          # One expression: a list is built by one --set, and replaced by the next.
          "tolerations[0].key=nvidia.com/gpu,tolerations[0].operator=Exists,"
          "tolerations[0].effect=NoSchedule,"
          f"tolerations[1].key={TOLERATION['key']},"
          f"tolerations[1].operator={TOLERATION['operator']},"
          f"tolerations[1].effect={TOLERATION['effect']}")


def surge(value: str | int) -> tuple[str, ...]:
    """The expressions that set both DaemonSets' surge."""
    return (f"updateStrategy.rollingUpdate.maxSurge={value}", f"nri.maxSurge={value}")


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _ready_at(pod: Mapping[str, Any]) -> float | None:
    for condition in pod.get("status", {}).get("conditions", []):
        if condition["type"] == "Ready" and condition["status"] == "True":
            return _stamp(condition["lastTransitionTime"])
    return None


def _of(pods: Mapping[str, Any], component: str) -> list[Any]:
    return [p for p in pods.values()
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == component]


def measure_node(kube: Cluster, release: Release, expressions: Sequence[str],
                 timeout: float = 240.0) -> dict[str, Delays]:
    """
    Upgrade the release with C{expressions} and watch its pods on the real
    node: per component, the new pod's creation to Ready (the API server's
    timestamps, whole seconds) and the old pod's deletion to gone (its
    deletion timestamp less its grace period, to the first read without it).
    """
    def on_node() -> dict[str, Any]:
        pods = kube.get("pods", "-n", release.namespace, "--field-selector",
                        f"spec.nodeName={NODE_NAME}")["items"]
        return {p["metadata"]["name"]: p for p in pods}

    before = on_node()
    release.upgrade(*expressions)
    seen = dict(before)
    gone: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while True:
        now_pods = on_node()
        now = time.time()
        seen.update(now_pods)
        for name in seen:
            if name not in now_pods and name not in gone:
                gone[name] = now
        found: dict[str, Delays] = {}
        for component in DAEMONSETS:
            new = [p for p in _of(seen, component) if p["metadata"]["name"] not in before]
            old = _of(before, component)
            ready = [_ready_at(now_pods.get(p["metadata"]["name"], p)) for p in new]
            if len(new) == 1 and len(old) == 1 and ready[0] is not None \
                    and old[0]["metadata"]["name"] in gone:
                # The deletion timestamp is the deadline: the request plus the grace period.
                meta = seen[old[0]["metadata"]["name"]]["metadata"]
                deleted = (_stamp(meta["deletionTimestamp"])
                           - meta.get("deletionGracePeriodSeconds", 0)
                           if "deletionTimestamp" in meta else None)
                found[component] = Delays(
                    ready=ready[0] - _stamp(new[0]["metadata"]["creationTimestamp"]),
                    gone=max(0.0, gone[old[0]["metadata"]["name"]] - deleted)
                    if deleted is not None else 0.0)
        if len(found) == len(DAEMONSETS):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"the real node's pods did not roll within {timeout} s: "
                                 f"{sorted(seen)}, gone {sorted(gone)}")
        time.sleep(0.5)


@attrs.define
class Rollout:
    """One rollout of both DaemonSets, as measured."""

    label: str
    desired: dict[str, int]
    #: Seconds from the upgrade to each DaemonSet's done (None: not done in the window).
    seconds: dict[str, float | None]
    #: Nodes updated when the window ended, per DaemonSet.
    updated: dict[str, int]
    #: The fewest nodes with an available pod seen at any read, per DaemonSet.
    fewest_available: dict[str, int]
    #: The most nodes whose DaemonSet pod was surged at once (pods beyond one
    #: per node), at any read, per DaemonSet (only when pods were counted).
    most_surged: dict[str, int]
    window: float
    #: Each read that saw fewer nodes available than wanted (at most
    #: L{MAX_DIPS}): when, and the nodes whose pods then were none Ready,
    #: listed at once after (L{unready_nodes}): a node listed lost its pod's
    #: readiness; none listed, the DaemonSet's status lagged its pods.
    dips: list[dict[str, Any]] = attrs.Factory(list)

    def estimate(self, name: str) -> float:
        """The time the whole fleet takes: measured, or extrapolated from the window's rate."""
        done = self.seconds[name]
        if done is not None:
            return done
        rate = self.updated[name] / self.window
        return math.inf if rate == 0 else self.desired[name] / rate

    def report(self) -> dict[str, Any]:
        return {"label": self.label, "desired": self.desired, "seconds": self.seconds,
                "updated": self.updated, "fewest_available": self.fewest_available,
                "most_surged": self.most_surged, "window": self.window, "dips": self.dips,
                "estimate_seconds": {name: self.estimate(name) for name in self.desired}}


def daemonsets(kube: Cluster) -> dict[str, Any]:
    items = kube.get("daemonsets", "-n", NAMESPACE)["items"]
    return {d["metadata"]["name"]: d for d in items}


def pods_per_daemonset(kube: Cluster) -> dict[str, int]:
    """Each DaemonSet's pods not being deleted (an old pod going is no longer surged)."""
    output = kube.kubectl("get", "pods", "-n", NAMESPACE, "-o",
                          'jsonpath={range .items[*]}{.metadata.labels.app\\.kubernetes\\.io/'
                          'component} {.metadata.deletionTimestamp}{"\\n"}{end}', timeout=600)
    live = [line.split()[0] for line in output.splitlines() if len(line.split()) == 1]
    return {ds: live.count(component) for component, ds in DAEMONSETS.items()}


#: Dips recorded per rollout, at most (each lists a DaemonSet's pods once).
MAX_DIPS = 5


def unready_nodes(kube: Cluster, component: str, limit: int = 5) -> list[dict[str, Any]]:
    """
    The nodes where C{component}'s pods are none Ready (first C{limit}),
    each with its pods: name, phase, Ready, whether being deleted.
    """
    pods = kube.get("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/component={component}")
    by_node: dict[str, list[dict[str, Any]]] = {}
    for pod in pods["items"]:
        by_node.setdefault(pod["spec"].get("nodeName", "?"), []).append({
            "name": pod["metadata"]["name"], "phase": pod["status"].get("phase"),
            "ready": _ready_at(pod) is not None,
            "deleting": "deletionTimestamp" in pod["metadata"]})
    return [{"node": node, "pods": found} for node, found in sorted(by_node.items())
            if not any(p["ready"] for p in found)][:limit]


def done(ds: Mapping[str, Any]) -> bool:
    """C{kubectl rollout status}'s rule for a DaemonSet (its DaemonSetStatusViewer)."""
    status = ds.get("status", {})
    return bool(ds["metadata"]["generation"] <= status.get("observedGeneration", 0)
            and status.get("updatedNumberScheduled", 0) >= status.get("desiredNumberScheduled", 0)
            and status.get("numberAvailable", 0) >= status.get("desiredNumberScheduled", 0))


def roll(kube: Cluster, release: Release, label: str, expressions: Sequence[str],
         window: float | None = None, count_pods: bool = False,
         timeout: float = 1800.0) -> Rollout:
    """
    C{helm upgrade --reuse-values --set EXPRESSIONS}, then both
    DaemonSets read every L{POLL} s until done, or for C{window} seconds
    (the rate then gives L{Rollout.estimate}); not done within C{timeout}
    fails.
    """
    if window is None:
        window = math.inf
    started = time.monotonic()
    release.upgrade(*expressions)
    seconds: dict[str, float | None] = dict.fromkeys(DAEMONSETS.values())
    fewest: dict[str, int] = {}
    most_surged = dict.fromkeys(DAEMONSETS.values(), 0)
    dips: list[dict[str, Any]] = []
    while True:
        current = daemonsets(kube)
        elapsed = time.monotonic() - started
        for component, name in DAEMONSETS.items():
            status = current[name].get("status", {})
            available = int(status.get("numberAvailable", 0))
            fewest[name] = min(fewest.get(name, available), available)
            wanted = int(status.get("desiredNumberScheduled", 0))
            if available < wanted and len(dips) < MAX_DIPS:
                dips.append({"daemonset": name, "elapsed": round(elapsed, 1),
                             "available": available, "desired": wanted,
                             "unready_nodes": unready_nodes(kube, component)})
            if seconds[name] is None and done(current[name]):
                seconds[name] = elapsed
        if count_pods:
            for name, pods in pods_per_daemonset(kube).items():
                desired = current[name]["status"].get("desiredNumberScheduled", 0)
                most_surged[name] = max(most_surged[name], pods - desired)
        if all(s is not None for s in seconds.values()) or elapsed >= window:
            break
        if elapsed > timeout:
            raise AssertionError(f"{label}: not rolled out within {timeout} s: "
                                 f"{ {n: current[n].get('status') for n in DAEMONSETS.values()} }")
        time.sleep(POLL)
    desired = {name: current[name]["status"]["desiredNumberScheduled"]
               for name in DAEMONSETS.values()}
    updated = {name: current[name]["status"].get("updatedNumberScheduled", 0)
               for name in DAEMONSETS.values()}
    rollout = Rollout(label, desired, seconds, updated, fewest, most_surged,
                      min(window, time.monotonic() - started), dips)
    print(f"\n[fleet] {json.dumps(rollout.report())}")
    return rollout


def wait_rolled(kube: Cluster, timeout: float, nodes: int | None = None) -> None:
    """
    Both DaemonSets done (after a window that ended early), and with
    C{nodes}, wanting that many nodes (a new node is not wanted until it is
    Ready: until then its not-ready taint keeps the DaemonSet's pod off).
    """
    deadline = time.monotonic() + timeout

    def finished() -> bool:
        current = daemonsets(kube).values()
        return all(done(ds) and (nodes is None or
                                 ds["status"].get("desiredNumberScheduled") == nodes)
                   for ds in current)
    while not finished():
        if time.monotonic() > deadline:
            raise AssertionError(f"the fleet's DaemonSets did not finish within {timeout} s: "
                                 f"{[ds.get('status') for ds in daemonsets(kube).values()]}")
        time.sleep(POLL)
