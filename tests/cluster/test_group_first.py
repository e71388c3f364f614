"""
docs/rollout.md, "A group of nodes first", on the real node, command by
command: a group of nodes moved from the main release of the chart to a
canary release in its own namespace and back, by the two documented node
labels, while GPU pods query and GPU pods are created.

1. The main release (the first image tag, broker, plugin and gate on) with
   the documented affinity (it leaves the nodes labelled C{canary-only}),
   and the canary release (the second tag) selecting the nodes labelled
   C{canary}: it wants no pod yet.
2. The node labelled C{canary}: the canary's broker takes the listener over
   from the main release's (the handover, across the two releases), the
   canary's plugin registers beside the main's; then C{canary-only}: the
   main release's pods on the node go.  A GPU pod created now gets its own
   host PID through the canary's plugin and broker.
3. The main release upgraded to the second tag (it rolls on every other
   node: none here), then the move back in the documented order:
   C{canary-only} removed (the main release's pods start and take the
   listener back), then C{canary} (the canary's pods go).

Throughout, no query fails and every GPU pod created is adjusted: the
node never had an instant without a broker or a plugin.  The labels in the
other order (the doc's warning) are not run: they remove one release's pod
before the other's is Ready, which is the fallback the procedure avoids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import workloads
from cluster import NODE_NAME, Cluster
from deviceplugin import DevicePlugin
from release import NAMESPACE, Release
from support import wait_for
from test_rollout import RESTRICTED, Loop, Stream, failures
from test_rollout import images as images  # noqa: F401  (the module's fixture, shared)

#: The documented labels (docs/rollout.md) and the canary's namespace.
CANARY = "hostpid.hami.io/canary"
CANARY_ONLY = "hostpid.hami.io/canary-only"
CANARY_NAMESPACE = "hostpid-canary"

#: The main release's affinity, as the doc's C{--set-json} gives it.
MAIN_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [
        {"key": CANARY_ONLY, "operator": "DoesNotExist"}]}]}}}


@pytest.fixture(scope="module")
def releases(kube: Cluster, gpus: DevicePlugin, images: dict[str, str]  # noqa: F811
             ) -> Iterator[tuple[Release, Release]]:
    kube.namespace(RESTRICTED, {"pod-security.kubernetes.io/enforce": "restricted"})
    main = Release(kube, images["repository"], images["tag"])
    canary = Release(kube, images["repository"], images["next"], name="hostpid-canary",
                     namespace=CANARY_NAMESPACE)
    main.uninstall()  # an earlier file's
    try:
        yield main, canary
    finally:
        # What a failed step may leave: its GPU pods would hold GPUs from the files after.
        for left in ("stream=group", "loop=group"):
            kube.kubectl_run("delete", "pods", "-n", RESTRICTED, "-l", left, "--wait=true",
                             timeout=300)
        kube.kubectl("label", "node", NODE_NAME, f"{CANARY}-", f"{CANARY_ONLY}-")
        canary.uninstall()
        main.uninstall()
        canary.close()
        main.close()


def label(kube: Cluster, *labels: str) -> None:
    kube.kubectl("label", "node", NODE_NAME, "--overwrite", *labels)


def broker_pod(kube: Cluster, namespace: str) -> dict[str, Any] | None:
    """The release's broker pod on the node (none, or one not being deleted)."""
    pods = [p for p in kube.get("pods", "-n", namespace, "-l",
                                "app.kubernetes.io/component=broker")["items"]
            if "deletionTimestamp" not in p["metadata"]]
    assert len(pods) <= 1, [p["metadata"]["name"] for p in pods]
    return pods[0] if pods else None


def ready(pod: dict[str, Any] | None) -> bool:
    return pod is not None and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod["status"].get("conditions", []))


def gone(kube: Cluster, namespace: str) -> bool:
    return not kube.get("pods", "-n", namespace, "-l", "app.kubernetes.io/part-of=hostpid")[
        "items"]


def test_a_group_moves_to_the_canary_and_back(
        kube: Cluster, releases: tuple[Release, Release], images: dict[str, str]) -> None:
    main, canary = releases
    on = ("hostPIDBroker.enabled=true", "nri.enabled=true", "nri.gate=true")
    main.install(*on, more={"affinity": MAIN_AFFINITY})
    print(main.rollout("daemonset", "hostpid-broker"))
    print(main.rollout("daemonset", "hostpid-nri"))
    canary.install(*on, more={"nodeSelector": {CANARY: "true"}})
    wanted = kube.get("daemonset", "-n", CANARY_NAMESPACE, "hostpid-broker")
    assert wanted["status"]["desiredNumberScheduled"] == 0, "no node labelled canary yet"

    loop = Loop(kube, "group")
    wait_for(lambda: all(len(v) >= 5 for v in loop.lines().values()),
             "the loop pods' first answers", 60.0)
    # A GPU pod a second: several in each move, few enough for a loaded machine.
    stream = Stream(kube, "group", interval=1.0)
    try:
        # Move the group: the canary's pods start beside the main ones and take over ...
        label(kube, f"{CANARY}=true")
        print(canary.rollout("daemonset", "hostpid-broker"))
        print(canary.rollout("daemonset", "hostpid-nri"))
        assert ready(broker_pod(kube, CANARY_NAMESPACE))
        wait_for(lambda: not ready(broker_pod(kube, NAMESPACE)),
                 "the main release's broker to have handed its listener over", 120.0)
        # ... then the main release's pods there go.
        label(kube, f"{CANARY_ONLY}=true")
        wait_for(lambda: gone(kube, NAMESPACE), "the main release's pods to leave the node",
                 120.0)
        run = workloads.run(kube, workloads.pod(RESTRICTED, "canary"))
        assert run.exit_code == 0, run.stdout
        assert run.answer() == (run.host_pid, 1), run.stdout

        # The main release upgraded (every other node), then the group moved back.
        main.upgrade(f"image.tag={images['next']}")
        label(kube, f"{CANARY_ONLY}-")
        print(main.rollout("daemonset", "hostpid-broker"))
        print(main.rollout("daemonset", "hostpid-nri"))
        wait_for(lambda: ready(broker_pod(kube, NAMESPACE))
                 and not ready(broker_pod(kube, CANARY_NAMESPACE)),
                 "the main release's broker to hold the listener again", 120.0)
        label(kube, f"{CANARY}-")
        wait_for(lambda: gone(kube, CANARY_NAMESPACE), "the canary's pods to leave the node",
                 120.0)
    finally:
        try:
            gates = stream.stop()
        finally:
            lines = loop.stop()
    total, failed = failures(lines)
    unadjusted = sorted(name for name, gate in gates.items() if gate != "1")
    print(f"\n[cluster] group first, there and back: {total} queries, {failed} failed; "
          f"{len(gates)} GPU pods created during the moves, {len(unadjusted)} without the "
          "adjustment")
    assert total > 0 and gates
    assert failed == 0, [line for v in lines.values() for line in v if not line.startswith("ok")]
    for name, pid in loop.pids.items():
        assert all(line == f"ok {pid} 1" or line.split()[2] != "1"
                   for line in lines[name]), "each its own host PID"
    assert unadjusted == []
    pod = broker_pod(kube, NAMESPACE)
    assert pod is not None and pod["spec"]["containers"][0]["image"].endswith(
        f":{images['next']}"), "the main release's new version serves the node"
