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
    as achieved, with the client's create latency;
  - each replica's own C{hostpid_webhook_review_seconds} (buckets from
    0.1 ms, one at 10 ms): the time a review spends in the webhook, which
    the API server's coarse buckets cannot resolve below 25 ms.

With C{control_rate}, pods are also created at that rate, interleaved over
the same connections, in L{CONTROL_NAMESPACES}, which carry the chart's
opt-out label: the API server never calls the webhook for them.  Their
create latency is the same API server's at the same moment without the
webhook, and the difference from the webhooked pods' is what the webhook
adds as a client sees it, TLS and network included, at a client's
resolution.

Shared by the tier's test (C{test_webhook_load.py}, one modest step) and
C{bench/webhook-scale} (several rates, longer).
"""

from __future__ import annotations

import base64
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
from release import NAMESPACE
from support import cpu_seconds as support_cpu_seconds

#: The chart's webhook, as the API server names it in its metrics.
WEBHOOK = "pods.hostpid.hami.io"
#: Namespaces the step's pods are spread over.
NAMESPACES = tuple(f"webhook-load-{i}" for i in range(4))
#: Namespaces of the control pods: opted out, never sent to the webhook.
CONTROL_NAMESPACES = tuple(f"webhook-load-control-{i}" for i in range(2))
#: The chart's C{webhook.optOutLabel} (its default) and the value that opts out.
OPT_OUT = {"hostpid.hami.io/webhook": "disabled"}
#: The webhook's own review latency histogram.
REVIEW_SECONDS = "hostpid_webhook_review_seconds"
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


def histogram(text: str, name: str) -> Histogram:
    """The histogram C{name} of one exposition (its buckets summed over labels)."""
    buckets: dict[float, float] = {}
    count = 0.0
    for family in text_string_to_metric_families(text):
        for sample, labels, value, *_ in family.samples:
            if sample == f"{name}_bucket":
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + value
            elif sample == f"{name}_count":
                count += value
    return Histogram(tuple(sorted(buckets.items())), count)


def added(histograms: Iterable[Histogram]) -> Histogram:
    """Several replicas' histograms of the same buckets, as one."""
    buckets: dict[float, float] = {}
    count = 0.0
    for one in histograms:
        for le, n in one.buckets:
            buckets[le] = buckets.get(le, 0.0) + n
        count += one.count
    return Histogram(tuple(sorted(buckets.items())), count)


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


def webhook_reviews(kube: Cluster) -> dict[str, Histogram]:
    """
    Each running webhook replica's own L{REVIEW_SECONDS}, by pod name, read
    from its C{/metrics} over HTTPS at its pod address (the tier's pods are
    reachable from the host), the chain verified against the CA bundle the
    API server itself trusts for the webhook.
    """
    bundle = None
    for config in kube.get("mutatingwebhookconfigurations")["items"]:
        for hook in config.get("webhooks", []):
            if hook.get("name") == WEBHOOK:
                bundle = hook["clientConfig"]["caBundle"]
    assert bundle, f"no webhook {WEBHOOK} configured"
    context = ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
    # The certificate names the Service, not the pod's address; the chain is
    # still verified, so the bytes are the webhook's.
    context.check_hostname = False
    found = {}
    pods = kube.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=webhook")
    for pod in pods["items"]:
        ip = pod["status"].get("podIP")
        if not ip or pod["status"].get("phase") != "Running" \
                or "deletionTimestamp" in pod["metadata"]:
            continue
        [port] = [p["containerPort"] for c in pod["spec"]["containers"]
                  for p in c.get("ports", []) if p.get("name") == "https"]
        conn = http.client.HTTPSConnection(ip, port, context=context, timeout=10)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        assert response.status == 200, body[:200]
        found[pod["metadata"]["name"]] = histogram(body.decode(), REVIEW_SECONDS)
    return found


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


def run_step(kube: Cluster, rate: float, seconds: float,
             control_rate: float = 0.0) -> dict[str, Any]:
    """
    Create C{rate * seconds} pods at C{rate} a second (and, with
    C{control_rate}, control pods at that rate beside them), then read what
    the API server, the webhook's replicas and the stored pods say (module
    docstring).  The pods are deleted with their namespaces afterwards
    (L{clean}).
    """
    api = Api(kube.kubeconfig)
    for namespace in NAMESPACES:
        kube.namespace(namespace)
    if control_rate:
        for namespace in CONTROL_NAMESPACES:
            kube.namespace(namespace, OPT_OUT)
    run = uuid.uuid4().hex[:8]
    total = max(1, int(rate * seconds))
    controls = int(control_rate * seconds)
    # Every creation, webhooked and control, by when it is due: one schedule
    # the connections take turns at, so that both kinds meet the same load.
    due = sorted([(i / rate, NAMESPACES[i % len(NAMESPACES)], i % 2 == 0) for i in range(total)]
                 + [(j / control_rate, CONTROL_NAMESPACES[j % len(CONTROL_NAMESPACES)],
                     j % 2 == 0) for j in range(controls)])
    before = api.metrics()
    reviews_before = webhook_reviews(kube)
    pids = webhook_pids()
    cpu_before = cpu_seconds(pids)
    latencies: dict[bool, list[float]] = {False: [], True: []}
    statuses: dict[bool, dict[int, int]] = {False: {}, True: {}}
    lock = threading.Lock()
    start = time.monotonic() + 0.2

    def worker(first: int) -> None:
        conn = api.connection()
        try:
            for at, namespace, gpu in due[first::CONNECTIONS]:
                delay = start + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pod = load_pod(namespace, gpu=gpu, run=run)
                sent = time.monotonic()
                try:
                    status, _ = api.request(
                        "POST", f"/api/v1/namespaces/{namespace}/pods", pod, connection=conn)
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn = api.connection()
                    status = 0
                kind = namespace in CONTROL_NAMESPACES
                with lock:
                    latencies[kind].append(time.monotonic() - sent)
                    statuses[kind][status] = statuses[kind].get(status, 0) + 1
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
    empty = Histogram((), 0.0)
    inside = added(now.minus(reviews_before.get(name, empty))
                   for name, now in webhook_reviews(kube).items())
    webhooked, control = latencies[False], latencies[True]
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
        "created": statuses[False].get(201, 0),
        "statuses": {str(k): v for k, v in statuses[False].items()},
        "create_p50_ms": _ms(_percentile(webhooked, 0.5)),
        "create_p99_ms": _ms(_percentile(webhooked, 0.99)),
        "control_pods": controls, "control_rate": control_rate,
        "control_created": statuses[True].get(201, 0),
        "control_create_p50_ms": _ms(_percentile(control, 0.5)),
        "control_create_p99_ms": _ms(_percentile(control, 0.99)),
        "added_p50_ms": _ms(_difference(webhooked, control, 0.5)),
        "added_p99_ms": _ms(_difference(webhooked, control, 0.99)),
        "in_webhook_reviews": inside.count,
        "in_webhook_within_5ms": inside.share_within(0.005),
        "in_webhook_within_10ms": inside.share_within(0.01),
        "in_webhook_p50_ms": _ms(quantile(0.5, inside)),
        "in_webhook_p99_ms": _ms(quantile(0.99, inside)),
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


def _difference(values: list[float], control: list[float], q: float) -> float | None:
    """The C{q} quantile of C{values} less that of C{control} (C{None} without both)."""
    ours, theirs = _percentile(values, q), _percentile(control, q)
    return None if ours is None or theirs is None else ours - theirs


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def clean(kube: Cluster) -> None:
    """Delete the steps' namespaces (their pods were never scheduled: gone at once)."""
    for namespace in NAMESPACES + CONTROL_NAMESPACES:
        kube.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=true",
                     timeout=600)
