"""
GPUs from ResourceClaims (DRA, C{resource.k8s.io/v1}) on the real node: the
tier's DRA driver (L{draplugin.DraPlugin}, shaped like HAMi's) publishes
C{hami-gpu-N} devices, the scheduler allocates a pod's claim, the kubelet
asks the driver to prepare it and hands containerd the CDI names; the
driver's CDI edits bind the lock parent themselves (C{rw,nosuid,nodev}),
and the chart's NRI plugin, qualifying the container by its device node
(character major 195), adds the broker mount and the gate, and not a
second lock parent.

The steps share one release of the chart and run in this file's order:

1. disabled (every gate off): a claim pod gets HAMi's bind only, no
   broker, and its client falls back at the gate;
2. enabled: a C{restricted} pod with a claim template gets its own host PID
   (the C and the Python client, against the host's C{/proc}); the lock
   parent is mounted once, with the driver's options, the broker once;
3. two containers of one pod sharing its claim: one preparation, each
   container its own host PID;
4. two pods sharing one device through consumable capacity (50 of its 100
   C{cores} each): one device, two shares, each pod its own limits and host
   PID;
5. a pod without a GPU claim gets nothing;
5b. rolled forward (both DaemonSets to the next image) while two claim
   pods query in a loop: no query fails;
6. rolled back (gates off, then the broker): a new claim pod gets nothing
   again.

Beside steps 1 and 2, a burst of L{BURST} claim pods (each a tenth of a
device: the scheduler spreads them) created in one request, each
pod's creation to its client's first answer reported: with the feature off
every client falls back at its gate, with it on every one gets its own host
PID.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import workloads
from cluster import Cluster
from draplugin import DEVICE_CLASS, DRIVER, DraPlugin
from release import Release
from support import wait_for
from test_nri_containerd import GO_FILE, script_answer
from test_rollout import Loop, burst, failures, images, project_pod  # noqa: F401 (images: the module's fixture)

RESTRICTED = "dra-restricted"
#: The claim template every GPU pod here names but the sharing one.
WHOLE = "gpu-whole"
#: Half a device, on the device the sharing scenario pins (no other claim here lands there:
#: the whole-GPU claims take the lowest free devices).
HALF = "gpu-half"
SHARED_MINOR = 7
#: A tenth of a device, for the bursts: many claims at once on the 8 devices.
SLIVER = "gpu-sliver"
#: Claim pods per burst: as many as the devices.  Some pods of a burst wait
#: 60-90 s with the feature off as on: the kubelet's first read of a claim
#: made a moment before is refused by the node authorizer ("no relationship
#: found between node ... and this object": its graph has not caught up) and
#: the pod worker retries after its backoff.  A burst of 24 took 100 s either
#: way, so more pods cost CI time and show nothing of the broker.
BURST = 8
LOCK_PARENT = "/tmp/vgpulock"
BROKER_MOUNT = "/tmp/vgpulock/hostpid"


def claim_template(name: str, cores: int | None = None, memory: str | None = None,
                   minor: int | None = None, namespace: str = RESTRICTED,
                   device_class: str = DEVICE_CLASS) -> dict[str, Any]:
    """
    A template of one request of C{device_class} (the driver's); C{cores}
    and C{memory} are the capacity it consumes (unset, the device's request
    policy's default: all of it).
    """
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if cores is not None and memory is not None:
        exactly["capacity"] = {"requests": {"cores": str(cores), "memory": memory}}
    if minor is not None:
        exactly["selectors"] = [{"cel": {
            "expression": f"device.attributes['{DRIVER}'].minor == {minor}"}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}


def claim_pod(prefix: str, template: str = WHOLE, containers: int = 1,
              manifest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """
    A restricted pod (L{workloads.pod}, no device plugin GPU) whose GPU is
    its claim C{gpu}, made from C{template}, named by each of its
    C{containers}.
    """
    pod = copy.deepcopy(dict(manifest)) if manifest is not None else \
        workloads.pod(RESTRICTED, prefix, gpu=False)
    spec = pod["spec"]
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    (container,) = spec["containers"]
    container["resources"] = {"claims": [{"name": "gpu"}]}
    for index in range(1, containers):
        spec["containers"].append({**copy.deepcopy(container), "name": f"work{index}"})
    return pod


def sliver_pod(prefix: str, labels: Mapping[str, str], script: str) -> dict[str, Any]:
    """A claim pod of the C client (L{test_rollout.PodMaker}) taking a tenth of a device."""
    return claim_pod(prefix, template=SLIVER, manifest=workloads.pod(
        RESTRICTED, prefix, gpu=False, labels=labels, script=script))


def mounts_at(host_pid: int, mount_point: str) -> list[tuple[str, ...]]:
    """The per-mount options of every mount at C{mount_point} in the container, bottom first."""
    return [tuple(line.split()[5].split(","))
            for line in Path(f"/proc/{host_pid}/mountinfo").read_text().splitlines()
            if line.split()[4] == mount_point]


def environ(host_pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{host_pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in raw if entry)


def pod_claims(kube: Cluster, name: str, namespace: str = RESTRICTED) -> list[dict[str, Any]]:
    """The pod's generated ResourceClaims, as the API server has them."""
    status = kube.get("pod", "-n", namespace, name)["status"]
    names = [c["resourceClaimName"] for c in status.get("resourceClaimStatuses", [])]
    return [kube.get("resourceclaim", "-n", namespace, claim) for claim in names]


def results(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(claim["status"]["allocation"]["devices"]["results"])


def container_pids(kube: Cluster, name: str, count: int,
                   namespace: str = RESTRICTED) -> dict[str, int]:
    """Each running container's host PID (CRI C{ContainerStatus}), by container name."""
    client = kube.containerd.client

    def pids() -> dict[str, int] | None:
        status = kube.get("pod", "-n", namespace, name)["status"]
        states = status.get("containerStatuses") or []
        assert status.get("phase") in ("Pending", "Running"), status
        if len(states) != count or not all("running" in s["state"] for s in states):
            return None
        found = {}
        for state in states:
            response = client.runtime("ContainerStatus",
                                      container_id=state["containerID"].split("://", 1)[1],
                                      verbose=True)
            found[state["name"]] = int(json.loads(response.info["info"])["pid"])
        return found
    found = wait_for(pids, f"pod {namespace}/{name}'s {count} containers to run", 120.0)
    assert isinstance(found, dict)
    return found


def assert_brokered(run: workloads.Run) -> None:
    """A claim pod's C client given the broker: the gate, one mount, its own host PID."""
    assert run.facts() == {"ns-pid": "1", "gate": "1", "broker-mounts": "1",
                           "uid": "1000", "gpu": "present", "socket": "present"}, run.stdout
    assert run.exit_code == 0, run.stdout
    assert run.nspid == (run.host_pid, 1)
    assert run.answer() == (run.host_pid, 1)


def assert_fallback(run: workloads.Run) -> None:
    """A claim pod's C client given nothing but its GPU: it stops at its gate."""
    assert run.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0",
                           "uid": "1000", "gpu": "present", "socket": "absent"}, run.stdout
    assert run.exit_code == 1 and "hostpid_client: gate: " in run.stdout, run.stdout


@pytest.fixture(scope="module")
def release(kube: Cluster, dra_gpus: DraPlugin, images: dict[str, str]) -> Iterator[Release]:  # noqa: F811
    kube.namespace(RESTRICTED, {"pod-security.kubernetes.io/enforce": "restricted"})
    kube.apply(claim_template(WHOLE), claim_template(HALF, cores=50, memory="8Gi",
                                                      minor=SHARED_MINOR),
               claim_template(SLIVER, cores=10, memory="1Gi"))
    chart = Release(kube, images["repository"], images["tag"])
    try:
        yield chart
    finally:
        # The chart's own scenarios (test_rollout.py) install it afresh.
        chart.uninstall()
        chart.close()


def test_1_disabled(kube: Cluster, release: Release, dra_gpus: DraPlugin) -> None:
    """Every gate off: the claim's CDI edits alone; the client falls back at its gate."""
    release.install("nri.enabled=true")
    print(release.rollout("daemonset", "hostpid-broker"))
    print(release.rollout("daemonset", "hostpid-nri"))
    manifest = claim_pod("dra-disabled")
    workloads.start(kube, manifest)
    (host_pid,) = container_pids(kube, manifest["metadata"]["name"], 1).values()
    # Read while the pod runs: the controller deletes a generated claim once its pod is done.
    (claim,) = pod_claims(kube, manifest["metadata"]["name"])
    assert (RESTRICTED, claim["metadata"]["name"], claim["metadata"]["uid"]) in dra_gpus.prepared
    assert len(mounts_at(host_pid, LOCK_PARENT)) == 1
    assert mounts_at(host_pid, BROKER_MOUNT) == []
    run = workloads.finish(kube, manifest)
    assert_fallback(run)
    kube.kubectl("delete", "pod", "-n", RESTRICTED, run.name, "--wait=false")


def test_1b_burst_disabled(kube: Cluster, release: Release) -> None:
    for run in burst(kube, "dra-disabled", make=sliver_pod, count=BURST):
        assert run.exit_code == 1 and "hostpid_client: gate: " in run.stdout, run.stdout


def test_2_enabled(kube: Cluster, release: Release, images: dict[str, str]) -> None:  # noqa: F811
    """
    The broker and the NRI plugin's gate on: a restricted pod whose GPU came
    from a claim template gets the broker mount and the gate once, keeps the
    driver's own lock parent mount (the plugin adds none), and its C and
    Python clients get their own host PIDs.
    """
    release.upgrade("hostPIDBroker.enabled=true")
    print(release.rollout("daemonset", "hostpid-broker"))
    release.upgrade("nri.gate=true")
    print(release.rollout("daemonset", "hostpid-nri"))
    manifest = claim_pod("dra-enabled")
    workloads.start(kube, manifest)
    (host_pid,) = container_pids(kube, manifest["metadata"]["name"], 1).values()
    lock_mounts = mounts_at(host_pid, LOCK_PARENT)
    broker_mounts = mounts_at(host_pid, BROKER_MOUNT)
    print(f"\n[cluster] DRA pod mounts: {LOCK_PARENT} {lock_mounts}; "
          f"{BROKER_MOUNT} {broker_mounts}")
    # Once each: the driver's bind of the lock parent, kept as it is (HAMi's
    # options: no noexec), and the plugin's read-only broker directory.
    assert len(lock_mounts) == 1, lock_mounts
    assert {"rw", "nosuid", "nodev"} <= set(lock_mounts[0]), lock_mounts
    assert "noexec" not in lock_mounts[0], lock_mounts
    assert len(broker_mounts) == 1, broker_mounts
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(broker_mounts[0]), broker_mounts
    env = environ(host_pid)
    assert env["LIBVGPU_HOSTPID_BROKER"] == "1"
    assert env["CUDA_DEVICE_SM_LIMIT_0"] == "100", env
    run = workloads.finish(kube, manifest)
    assert_brokered(run)

    python = workloads.run(kube, claim_pod(
        "dra-python", manifest=project_pod(RESTRICTED, "dra-python", images, gpu=False)))
    assert python.exit_code == 0, python.stdout
    assert python.nspid == (python.host_pid, 1)
    assert python.answer() == (python.host_pid,)
    kube.kubectl("delete", "pod", "-n", RESTRICTED, run.name, python.name, "--wait=false")


def test_2b_burst_enabled(kube: Cluster, release: Release) -> None:
    for run in burst(kube, "dra-enabled", make=sliver_pod, count=BURST):
        assert run.exit_code == 0, run.stdout
        assert run.answer() == (run.host_pid, 1), (run.name, run.host_pid, run.stdout)


def test_3_two_containers_one_claim(kube: Cluster, release: Release,
                                    dra_gpus: DraPlugin) -> None:
    """Two containers naming the pod's one claim: one preparation, two host PIDs."""
    manifest = claim_pod("dra-two", containers=2)
    name = manifest["metadata"]["name"]
    workloads.start(kube, manifest)
    pids = container_pids(kube, name, 2)
    (claim,) = pod_claims(kube, name)
    for pid in pids.values():
        assert workloads.nspid(pid)[1:] == (1,)
        assert len(mounts_at(pid, LOCK_PARENT)) == 1
        assert len(mounts_at(pid, BROKER_MOUNT)) == 1
        Path(f"/proc/{pid}/root{GO_FILE}").touch()
    wait_for(lambda: kube.get("pod", "-n", RESTRICTED, name)["status"].get("phase")
             in ("Succeeded", "Failed"), f"pod {name} to finish", 120.0)
    uid = claim["metadata"]["uid"]
    assert [p for p in dra_gpus.prepared if p[2] == uid] == [
        (RESTRICTED, claim["metadata"]["name"], uid)]
    for container, pid in pids.items():
        stdout = kube.kubectl("logs", "-n", RESTRICTED, name, "-c", container)
        print(f"\n[cluster] {name}/{container}: host_pid={pid} "
              f"answer={script_answer(stdout)}")
        assert script_answer(stdout) == (pid, 1), stdout
    assert len(set(pids.values())) == 2
    kube.kubectl("delete", "pod", "-n", RESTRICTED, name, "--wait=false")


def test_4_two_pods_share_a_device(kube: Cluster, release: Release) -> None:
    """
    Two pods, each claiming 50 of one device's 100 C{cores}: the scheduler
    gives both claims the same device (two shares), the driver each its own
    limit, and each pod its own host PID.
    """
    manifests = [claim_pod(f"dra-share{n}", template=HALF) for n in range(2)]
    for manifest in manifests:
        workloads.start(kube, manifest)
    pids = {}
    for manifest in manifests:
        (pid,) = container_pids(kube, manifest["metadata"]["name"], 1).values()
        pids[manifest["metadata"]["name"]] = pid
        env = environ(pid)
        assert (env["CUDA_DEVICE_SM_LIMIT_0"], env["CUDA_DEVICE_MEMORY_LIMIT_0"]) == \
            ("50", "8192m"), env
    allocated = []
    for name in pids:
        (claim,) = pod_claims(kube, name)
        (result,) = results(claim)
        allocated.append(result)
    print(f"\n[cluster] shared device allocations: {allocated}")
    assert {r["device"] for r in allocated} == {f"hami-gpu-{SHARED_MINOR}"}
    assert len({r["shareID"] for r in allocated}) == 2
    assert all(r["consumedCapacity"]["cores"] == "50" for r in allocated)
    runs = [workloads.finish(kube, manifest) for manifest in manifests]
    for run in runs:
        assert run.exit_code == 0, run.stdout
        assert run.answer() == (run.host_pid, 1)
    assert runs[0].host_pid != runs[1].host_pid
    kube.kubectl("delete", "pod", "-n", RESTRICTED, *pids, "--wait=false")


def test_5_no_claim(kube: Cluster, release: Release) -> None:
    """A pod without a GPU claim in the same namespace gets nothing."""
    run = workloads.run(kube, workloads.pod(RESTRICTED, "dra-none", gpu=False))
    assert run.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0",
                           "uid": "1000", "gpu": "absent", "socket": "absent"}, run.stdout
    assert run.exit_code == 1 and "hostpid_client: gate: " in run.stdout
    kube.kubectl("delete", "pod", "-n", RESTRICTED, run.name, "--wait=false")


def test_5b_rolled_forward(kube: Cluster, release: Release,
                           images: dict[str, str]) -> None:  # noqa: F811
    """
    Both DaemonSets to the next image (the broker surge-first with its
    handover) while two claim pods query every 50 ms: no query fails (each
    client checks its answer by its trust rules).
    """
    loop = Loop(kube, "dra-forward", make=sliver_pod)
    try:
        wait_for(lambda: all(len(v) >= 5 for v in loop.lines().values()),
                 "the claim loop pods' first answers", 60.0)
        release.upgrade(f"image.tag={images['next']}")
        print(release.rollout("daemonset", "hostpid-broker"))
        print(release.rollout("daemonset", "hostpid-nri"))
    finally:
        lines = loop.stop()
    total, failed = failures(lines)
    print(f"\n[cluster] DRA roll forward: {total} queries, {failed} failed")
    assert total > 0
    assert failed == 0, [line for v in lines.values() for line in v if not line.startswith("ok")]
    for name, pid in loop.pids.items():
        # Each query is a new client process; the loop's own shell is PID 1 in the pod.
        assert all(line == f"ok {pid} 1" or line.split()[2] != "1"
                   for line in lines[name] if line.startswith("ok ")), lines[name][:3]
    images_now = {c["image"] for p in kube.get("pods", "-n", release.namespace)["items"]
                  if "deletionTimestamp" not in p["metadata"] for c in p["spec"]["containers"]}
    assert images_now == {f"{images['repository']}:{images['next']}"}, images_now
    kube.kubectl("delete", "pod", "-n", RESTRICTED, *loop.pids, "--wait=false")


def test_6_rolled_back(kube: Cluster, release: Release) -> None:
    """The NRI gate off, then the broker: a new claim pod gets the driver's edits alone."""
    release.upgrade("nri.gate=false")
    print(release.rollout("daemonset", "hostpid-nri"))
    release.upgrade("hostPIDBroker.enabled=false")
    print(release.rollout("daemonset", "hostpid-broker"))
    run = workloads.run(kube, claim_pod("dra-rolled-back"))
    assert_fallback(run)
    kube.kubectl("delete", "pod", "-n", RESTRICTED, run.name, "--wait=false")

