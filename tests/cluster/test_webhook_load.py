"""
The chart's webhook (default replicas, mode C{mounts}, gate on) in every
pod creation of the tier's real API server, at a steady rate
(L{webhookload}):

1. at L{RATES} pods a second (CI: one step of 50 a second for 10 s; half
   GPU pods, in four namespaces): the API server called the webhook for
   every pod, none failed open, every GPU pod got the broker's volume and no
   other pod did; the replicas' own review count agrees; control pods
   (L{CONTROL}, a share of the rate, in namespaces carrying the chart's
   opt-out label) were created beside them and never sent to the webhook;
   the latencies measured (the API server's, the webhook's own, and the
   create latency with the webhook less the control's) are printed;
2. beyond capacity, here the webhook at 0 replicas: the API server admits
   GPU pods unpatched (C{failurePolicy: Ignore}), and its own
   C{apiserver_admission_webhook_fail_open_count} counts each one: the
   signal docs/operations.md tells operators to alert on.

C{bench/webhook-scale} runs the same test with more and longer steps
(C{HOSTPID_WEBHOOK_RATES}, C{HOSTPID_WEBHOOK_SECONDS}) and writes its report
(C{HOSTPID_WEBHOOK_REPORT}); then step 1 records what it sees at each rate
instead of asserting it, since finding where it breaks is the point.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator
from typing import Any

import pytest
import webhookload
from cluster import Cluster
from release import NAMESPACE, Release
from support import revision, wait_for
from test_rollout import images as images  # noqa: F401  (the module's fixture, shared)

BENCH_RATES = os.environ.get("HOSTPID_WEBHOOK_RATES", "")
RATES = [float(r) for r in BENCH_RATES.replace(",", " ").split()] or [50.0]
SECONDS = float(os.environ.get("HOSTPID_WEBHOOK_SECONDS", "") or "10")
REPORT = os.environ.get("HOSTPID_WEBHOOK_REPORT", "")
#: Control pods created beside the webhooked ones, as a share of the rate.
CONTROL = float(os.environ.get("HOSTPID_WEBHOOK_CONTROL", "") or "0.2")
#: The webhook's replicas (empty: the chart's default, 2).
REPLICAS = os.environ.get("HOSTPID_WEBHOOK_REPLICAS", "")


@pytest.fixture(scope="module")
def release(kube: Cluster, images: dict[str, str]  # noqa: F811
            ) -> Iterator[Release]:
    chart = Release(kube, images["repository"], images["tag"])
    chart.uninstall()  # an earlier file's
    try:
        chart.install("hostPIDBroker.enabled=true", "webhook.enabled=true", "webhook.gate=true",
                      *([f"webhook.replicas={REPLICAS}"] if REPLICAS else []))
        print(chart.rollout("deployment", "hostpid-webhook"))
        yield chart
    finally:
        webhookload.clean(kube)
        chart.uninstall()
        chart.close()


def test_webhook_in_every_creation(kube: Cluster, release: Release) -> None:
    report: dict[str, Any] = {
        "revision": revision(),
        "versions": dict(kube.versions), "nproc": os.cpu_count(), "kernel": platform.release(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": []}
    for rate in RATES:
        step = webhookload.run_step(kube, rate, SECONDS, control_rate=rate * CONTROL)
        report["steps"].append(step)
        shown = {k: v for k, v in step.items() if k != "webhook_buckets"}
        print(f"\n[webhook load] {json.dumps(shown)}")
        webhookload.clean(kube)
        if BENCH_RATES:
            continue
        assert step["created"] == step["pods"], step["statuses"]
        assert step["webhook_calls"] == step["pods"], "the API server calls it for every pod"
        assert step["in_webhook_reviews"] == step["pods"], "and the replicas count each"
        assert step["control_created"] == step["control_pods"] > 0, step
        assert step["fail_open"] == 0, step
        assert step["gpu_pods"] == step["pods"] // 2 + step["pods"] % 2, step
        assert step["gpu_pods_unpatched"] == 0, step

    # Beyond capacity: nothing answers.  Pods are still admitted, and the API
    # server's fail-open counter says how many went by unpatched.
    kube.kubectl("-n", NAMESPACE, "scale", "deployment/hostpid-webhook", "--replicas=0")
    wait_for(lambda: not kube.get("pods", "-n", NAMESPACE, "-l",
                                  "app.kubernetes.io/component=webhook")["items"],
             "the webhook's pods to go", 120.0)
    down = webhookload.run_step(kube, 4.0, 1.0)
    report["down"] = down
    print(f"\n[webhook load] at 0 replicas: {down['pods']} pods, {down['gpu_pods']} GPU pods, "
          f"{down['gpu_pods_unpatched']} unpatched, fail-open count +{down['fail_open']:g}")
    if REPORT:
        with open(REPORT, "w") as out:
            json.dump(report, out, indent=1)
    assert down["created"] == down["pods"], down["statuses"]
    assert down["gpu_pods_unpatched"] == down["gpu_pods"] == 2, down
    assert down["fail_open"] == down["pods"], "every call failed open, and was counted"
