"""
The webhook path for pods whose GPUs come from ResourceClaims, on the real
node: the chart's webhook alone (no NRI plugin), told the tier's DRA
driver's DeviceClass (C{webhook.deviceClasses}), reads each pod's
ResourceClaimTemplate from the real API server with its own service
account's token (in-cluster: the mounted token and CA, C{KUBERNETES_SERVICE_HOST},
over TLS, with only the ClusterRole the chart grants), and the API server
calls it over TLS through its Service.

- a pod (C{restricted}'s security context: non-root, no privilege, every
  capability dropped) whose claim template asks for the driver's class gets
  the broker's mounts and gate through the webhook and its own host PID,
  while the driver's CDI edits bind the lock parent too;
- a pod whose claim template asks for another class, whose devices are the
  same driver's, gets nothing.

The namespace is Pod Security C{privileged}: mode C{mounts} gives
C{hostPath} volumes, which C{baseline} and C{restricted} refuse (the chart
skips such namespaces; C{docs/admission.md}).  Harnesses and the claim pods'
shapes are C{test_dra}'s, imported.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import workloads
from cluster import Cluster
from draplugin import DEVICE_CLASS, DRIVER, DraPlugin
from release import NAMESPACE, Release
from test_dra import (
    BROKER_MOUNT,
    LOCK_PARENT,
    assert_brokered,
    assert_fallback,
    claim_pod,
    claim_template,
    container_pids,
    environ,
    mounts_at,
    pod_claims,
)
from test_rollout import images  # noqa: F401 (the module's image fixture)

WEBHOOK_NS = "dra-webhook"
GPU_TEMPLATE = "gpu"
#: A DeviceClass of the same driver's devices that the operator did not list.
OTHER_CLASS = "dra-webhook-other.example.com"
OTHER_TEMPLATE = "other"


def in_namespace(prefix: str, template: str) -> dict[str, object]:
    """A restricted-shaped claim pod in L{WEBHOOK_NS}, NRI opted out (it is off anyway)."""
    return claim_pod(prefix, template, manifest=workloads.pod(
        WEBHOOK_NS, prefix, gpu=False, labels={"hostpid.hami.io/nri": "disabled"}))


@pytest.fixture(scope="module")
def webhook_release(kube: Cluster, dra_gpus: DraPlugin,
                    images: dict[str, str]) -> Iterator[Release]:  # noqa: F811
    kube.namespace(WEBHOOK_NS, {"pod-security.kubernetes.io/enforce": "privileged"})
    kube.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
         "metadata": {"name": OTHER_CLASS},
         "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}},
        claim_template(GPU_TEMPLATE, namespace=WEBHOOK_NS),
        claim_template(OTHER_TEMPLATE, namespace=WEBHOOK_NS, device_class=OTHER_CLASS))
    chart = Release(kube, images["repository"], images["tag"])
    try:
        chart.install("hostPIDBroker.enabled=true", "webhook.enabled=true",
                      "webhook.mode=mounts", "webhook.gate=true",
                      f"webhook.deviceClasses={{{DEVICE_CLASS}}}")
        print(chart.rollout("daemonset", "hostpid-broker"))
        print(chart.rollout("deployment", "hostpid-webhook"))
        yield chart
    finally:
        chart.uninstall()
        chart.close()
        kube.kubectl("delete", "deviceclass", OTHER_CLASS, "--wait=false")


def webhook_log(kube: Cluster) -> str:
    return kube.kubectl("-n", NAMESPACE, "logs", "-l", "app.kubernetes.io/component=webhook",
                        "--tail=40", "--prefix")


def test_claim_pods_through_the_webhook(kube: Cluster, webhook_release: Release,
                                        dra_gpus: DraPlugin) -> None:
    """
    A pod whose claim template asks for the listed class gets the broker
    and its own host PID through the webhook alone; one whose template asks
    for another class of the same devices gets nothing.
    """
    gpu = in_namespace("dra-webhook-gpu", GPU_TEMPLATE)
    workloads.start(kube, gpu)
    name = gpu["metadata"]["name"]  # type: ignore[index]
    stored = kube.get("pod", "-n", WEBHOOK_NS, name)
    paths = {v["hostPath"]["path"] for v in stored["spec"].get("volumes", []) if "hostPath" in v}
    print(f"\n[cluster] webhook log:\n{webhook_log(kube)}")
    assert str(webhook_release.paths.broker_dir) in paths, stored["spec"]
    (host_pid,) = container_pids(kube, name, 1, namespace=WEBHOOK_NS).values()
    (claim,) = pod_claims(kube, name, namespace=WEBHOOK_NS)
    assert (WEBHOOK_NS, claim["metadata"]["name"], claim["metadata"]["uid"]) in dra_gpus.prepared
    lock_mounts, broker_mounts = mounts_at(host_pid, LOCK_PARENT), mounts_at(host_pid,
                                                                           BROKER_MOUNT)
    print(f"\n[cluster] DRA pod through the webhook: {LOCK_PARENT} {lock_mounts}; "
          f"{BROKER_MOUNT} {broker_mounts}")
    # The driver's CDI bind of the lock parent and the webhook's hostPath of
    # the same directory; the broker directory once, read-only, on top.
    assert lock_mounts and len(broker_mounts) == 1, (lock_mounts, broker_mounts)
    assert "ro" in broker_mounts[0]
    assert environ(host_pid)["LIBVGPU_HOSTPID_BROKER"] == "1"
    assert_brokered(workloads.finish(kube, gpu))

    other = in_namespace("dra-webhook-other", OTHER_TEMPLATE)
    workloads.start(kube, other)
    other_name = other["metadata"]["name"]  # type: ignore[index]
    stored = kube.get("pod", "-n", WEBHOOK_NS, other_name)
    assert not any("hostPath" in v for v in stored["spec"].get("volumes", [])), stored["spec"]
    container_pids(kube, other_name, 1, namespace=WEBHOOK_NS)
    (other_claim,) = pod_claims(kube, other_name, namespace=WEBHOOK_NS)
    assert other_claim["status"]["allocation"]["devices"]["results"][0]["driver"] == DRIVER
    assert_fallback(workloads.finish(kube, other))
    log = webhook_log(kube)
    assert "not read" not in log, log
    kube.kubectl("delete", "pod", "-n", WEBHOOK_NS, name, other_name, "--wait=false")
