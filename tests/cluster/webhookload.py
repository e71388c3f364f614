"""
Pod creation at a fixed rate through the tier's real API server, with the
chart's webhook in every creation: what the webhook adds, as the API server
measures it, and what it lets through when it cannot keep up.

A step creates pods open-loop (each at its own time, C{i / rate} after the
start, whether or not the earlier ones were answered: the API server's
callers do not wait for each other) over L{CONNECTIONS} kept-alive HTTPS
connections with the tier's admin identity.  Half the pods ask for a GPU
(C{nvidia.com/gpu: 1}), half do not, spread over L{NAMESPACES} namespaces
of their own.  None is ever scheduled (C{schedulerName} names no scheduler):
the step measures admission, not the node.

Read around each step, from the API server's C{/metrics} and the stored pods:

  - C{apiserver_admission_webhook_admission_duration_seconds} of the chart's
    webhook (C{pods.hostpid.hami.io}, CREATE, admit): the latency the webhook
    adds, as operators see it.  Its buckets are 5 ms, 25 ms, 100 ms...: the
    share of calls within 5 ms and 25 ms is exact, a percentile between them
    is Prometheus's linear interpolation (L{quantile});
  - C{apiserver_admission_webhook_fail_open_count}: calls that failed or
    timed out and were admitted anyway (C{failurePolicy: Ignore}), the
    signal docs/operations.md alerts on;
  - the stored GPU pods without the broker's volume: admitted unpatched;
  - each webhook process's CPU (C{/proc}), and the pods created per second
    as achieved, with the client's create latency.

Shared by the tier's test (C{test_webhook_load.py}, one modest step) and
C{bench/webhook-scale} (several rates, longer).
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import yaml
from cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families
from support import cpu_seconds as support_cpu_seconds

#: The chart's webhook, as the API server names it in its metrics.
WEBHOOK = "pods.hostpid.hami.io"
#: Namespaces the step's pods are spread over.
NAMESPACES = tuple(f"webhook-load-{i}" for i in range(4))
#: Kept-alive connections creating pods at once (an API server's clients are many).
CONNECTIONS = 16
#: A scheduler no one runs: the pods stay Pending, never reach the node.
SCHEDULER = "hostpid-load-no-scheduler"
LABEL = "hostpid.test/webhook-load"


@attrs.frozen
class Histogram:
    """One Prometheus histogram's cumulative buckets (C{le} to count) and count."""

    buckets: tuple[tuple[float, float], ...]
    count: float

    def minus(self, earlier: Histogram) -> Histogram:
        before = dict(earlier.buckets)
        return Histogram(tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets),
                         self.count - earlier.count)

    def share_within(self, le: float) -> float | None:
        if not self.count:
            return None
        return dict(self.buckets).get(le, 0.0) / self.count


def quantile(q: float, histogram: Histogram) -> float | None:
    """
    Prometheus's C{histogram_quantile}: linear within the bucket the rank
    falls in (the first bucket from 0), the highest finite bound when the
    rank falls in C{+Inf}.
    """
    if not histogram.count:
        return None
    rank = q * histogram.count
    lower, below = 0.0, 0.0
    for le, cumulative in histogram.buckets:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = le, cumulative
    return lower


@attrs.frozen
class ApiMetrics:
    """What the API server said about the webhook, at one moment."""

    latency: Histogram
    fail_open: float
    requests: Mapping[str, float]

    @classmethod
    def parse(cls, text: str) -> ApiMetrics:
        buckets: dict[float, float] = {}
        count = fail_open = 0.0
        requests: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for name, labels, value, *_ in family.samples:
                if labels.get("name") != WEBHOOK:
                    continue
                if name == "apiserver_admission_webhook_admission_duration_seconds_bucket" \
                        and labels.get("operation") == "CREATE":
                    le = float(labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + value
                elif name == "apiserver_admission_webhook_admission_duration_seconds_count" \
                        and labels.get("operation") == "CREATE":
                    count += value
                elif family.name == "apiserver_admission_webhook_fail_open_count":
                    # The parser names a counter's sample C{..._total} whatever
                    # the exposition calls it; the family keeps the name.
                    fail_open += value
                elif name == "apiserver_admission_webhook_request_total" \
                        and labels.get("operation") == "CREATE":
                    requests[labels.get("code", "?")] = requests.get(labels.get("code", "?"), 0) \
                        + value
        return cls(Histogram(tuple(sorted(buckets.items())), count), fail_open, requests)


class Api:
    """The tier's API server over HTTPS with the admin identity of its kubeconfig."""

    def __init__(self, kubeconfig: Path) -> None:
        config = yaml.safe_load(kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        user = config["users"][0]["user"]
        server = urlsplit(cluster["server"])
        self.host, self.port = server.hostname or "127.0.0.1", server.port or 443
        self.context = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.context.load_cert_chain(user["client-certificate"], user["client-key"])

    def connection(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.context,
                                           timeout=60)

    def request(self, method: str, path: str, body: Any = None,
                connection: http.client.HTTPSConnection | None = None) -> tuple[int, bytes]:
        own = connection is None
        conn = connection or self.connection()
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload else {}
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            if own:
                conn.close()

    def metrics(self) -> ApiMetrics:
        status, body = self.request("GET", "/metrics")
        assert status == 200, body[:200]
        return ApiMetrics.parse(body.decode())


def load_pod(namespace: str, gpu: bool, run: str) -> dict[str, Any]:
    """A pod that asks for a GPU or not, never scheduled."""
    resources = {"limits": {"nvidia.com/gpu": "1"}} if gpu else {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{'gpu' if gpu else 'cpu'}-{uuid.uuid4().hex[:12]}",
                     "namespace": namespace, "labels": {LABEL: run}},
        "spec": {"schedulerName": SCHEDULER, "restartPolicy": "Never",
                 "containers": [{"name": "main", "image": "registry.example.com/load:1",
                                 "resources": resources}]},
    }


def webhook_pids() -> list[int]:
    """The webhook's server processes on this host (the tier's pods run here)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hostpid-webhook" in argv and any(a.endswith(b"twistd") for a in argv):
            found.append(int(entry))
    return found


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """L{support.cpu_seconds} of each of C{pids} still running."""
    seconds = {}
    for pid in pids:
        try:
            seconds[pid] = support_cpu_seconds(pid)
        except OSError:
            continue
    return seconds


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_step(kube: Cluster, rate: float, seconds: float) -> dict[str, Any]:
    """
    Create C{rate * seconds} pods at C{rate} a second, then read what the API
    server and the stored pods say (module docstring).  The pods are deleted
    with their namespaces afterwards (L{clean}).
    """
    api = Api(kube.kubeconfig)
    for namespace in NAMESPACES:
        kube.namespace(namespace)
    run = uuid.uuid4().hex[:8]
    total = max(1, int(rate * seconds))
    before = api.metrics()
    pids = webhook_pids()
    cpu_before = cpu_seconds(pids)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    start = time.monotonic() + 0.2

    def worker(first: int) -> None:
        conn = api.connection()
        try:
            for i in range(first, total, CONNECTIONS):
                due = start + i / rate
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pod = load_pod(NAMESPACES[i % len(NAMESPACES)], gpu=i % 2 == 0, run=run)
                sent = time.monotonic()
                try:
                    status, _ = api.request(
                        "POST", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods",
                        pod, connection=conn)
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn = api.connection()
                    status = 0
                with lock:
                    latencies.append(time.monotonic() - sent)
                    statuses[status] = statuses.get(status, 0) + 1
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True)
               for n in range(CONNECTIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds * 4 + 120)
    elapsed = time.monotonic() - start
    cpu_after = cpu_seconds(pids)
    after = api.metrics()
    latency = after.latency.minus(before.latency)
    gpu = unpatched = 0
    for namespace in NAMESPACES:
        stored = kube.get("pods", "-n", namespace, "-l", f"{LABEL}={run}")["items"]
        for pod in stored:
            if not pod["metadata"]["name"].startswith("gpu-"):
                continue
            gpu += 1
            if not any("hostPath" in v for v in pod["spec"].get("volumes", [])):
                unpatched += 1
    requests = {code: n - before.requests.get(code, 0.0) for code, n in after.requests.items()}
    return {
        "rate": rate, "seconds": seconds, "pods": total, "elapsed": round(elapsed, 2),
        "achieved_rate": round(total / elapsed, 1) if elapsed else None,
        "created": statuses.get(201, 0), "statuses": {str(k): v for k, v in statuses.items()},
        "create_p50_ms": _ms(_percentile(latencies, 0.5)),
        "create_p99_ms": _ms(_percentile(latencies, 0.99)),
        "webhook_calls": latency.count,
        "webhook_within_5ms": latency.share_within(0.005),
        "webhook_within_25ms": latency.share_within(0.025),
        "webhook_p50_ms": _ms(quantile(0.5, latency)),
        "webhook_p99_ms": _ms(quantile(0.99, latency)),
        "webhook_buckets": [[le, n] for le, n in latency.buckets],
        "webhook_requests_by_code": {k: v for k, v in requests.items() if v},
        "fail_open": after.fail_open - before.fail_open,
        "gpu_pods": gpu, "gpu_pods_unpatched": unpatched,
        "replicas": len(pids),
        "webhook_cpu_seconds": {str(p): round(cpu_after.get(p, 0.0) - s, 3)
                                for p, s in cpu_before.items()},
        "load": os.getloadavg(),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def clean(kube: Cluster) -> None:
    """Delete the steps' namespaces (their pods were never scheduled: gone at once)."""
    for namespace in NAMESPACES:
        kube.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=true",
                     timeout=600)
