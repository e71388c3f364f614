"""
The design's rollout and rollback on the real node, in the order
C{docs/rollout.md} and C{docs/paths.md} give them, each step by Helm's
engine against the API server and waited for with C{kubectl rollout
status}, as the docs run them:

1. install with every gate off: GPU pods run, get nothing, and HAMi-core's
   client falls back (C{gate});
2. enable the broker, wait for its DaemonSet (Ready through its real exec
   probes), turn the NRI plugin's gate on: a GPU pod in a namespace that
   enforces Pod Security C{restricted} gets the mounts and the gate, and the
   C and Python clients in it get their own host PID, checked against the
   host's C{/proc}; a pod without a GPU gets nothing; a C{hostPath} pod there
   is refused by the API server;
3. a burst of GPU pods, disabled and enabled: creation to first answer;
4. roll forward to a second image tag while GPU pods query in a loop;
   then an ordinary pod floods the NRI pod's metrics ports while GPU pods
   are created: no probe fails, no restart, every pod adjusted;
5. the webhook path: the API server calls the webhook over TLS through its
   Service; with the webhook scaled to 0, GPU pods are still admitted;
   user-namespaced GPU pods get their host PID through the NRI plugin's
   plain mount and through the webhook's volumes, which the kubelet idmaps;
6. a node restart (containerd and the kubelet);
7. the rollback, gates off then the broker: new pods get nothing, pods
   created while it was on keep running and fall back once the socket is
   gone.

The steps share one release and run in this file's order (each test
starts from the state the one before it left); a failed step fails the
ones after it with the reason.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

import pytest
import workloads
from attackers import TCP_CONNECT_FLOOD
from cluster import Cluster
from deviceplugin import DevicePlugin
from kernelfeatures import kernel_feature
from nrilib import http_probe
from release import NAMESPACE, Release
from support import wait_for
from test_userns_cri import OVERFLOW_UID, PROLOGUE
from test_userns_cri import facts as userns_facts

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = kernel_feature("immutable_tmp")


RESTRICTED = "gpu-restricted"
PRIVILEGED = "gpu-privileged"
BURST = 24


@pytest.fixture(scope="module")
def images(kube: Cluster) -> dict[str, str]:
    """The project's image, two tags, imported into containerd's CRI namespace."""
    import imagelib

    for tag in (imagelib.DEFAULT_TAG, imagelib.ROLL_FORWARD_TAG):
        kube.import_image(imagelib.project_image(tag))
    return {"repository": imagelib.REPOSITORY, "tag": imagelib.DEFAULT_TAG,
            "next": imagelib.ROLL_FORWARD_TAG}


@pytest.fixture(scope="module")
def release(kube: Cluster, gpus: DevicePlugin, images: dict[str, str]) -> Iterator[Release]:
    kube.namespace(RESTRICTED, {"pod-security.kubernetes.io/enforce": "restricted"})
    kube.namespace(PRIVILEGED, {"pod-security.kubernetes.io/enforce": "privileged"})
    chart = Release(kube, images["repository"], images["tag"])
    try:
        yield chart
    finally:
        chart.close()


def project_pod(namespace: str, prefix: str, images: dict[str, str], **kwargs: Any) -> Any:
    return workloads.pod(namespace, prefix, image=f"{images['repository']}:{images['tag']}",
                         script=workloads.PYTHON_SCRIPT, **kwargs)


def test_1_disabled(kube: Cluster, release: Release, images: dict[str, str]) -> None:
    """docs/rollout.md step 1: every gate off; GPU pods get nothing and fall back."""
    release.install("nri.enabled=true")
    print(release.rollout("daemonset", "hostpid-broker"))
    print(release.rollout("daemonset", "hostpid-nri"))
    run = workloads.run(kube, workloads.pod(RESTRICTED, "disabled"))
    assert run.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0",
                           "uid": "1000", "gpu": "present", "socket": "absent"}, run.stdout
    assert run.exit_code == 1 and "hostpid_client: gate: " in run.stdout, run.stdout
    assert run.answer() is None


def test_1b_burst_disabled(kube: Cluster, release: Release) -> None:
    """The burst with the feature off: every client falls back at its gate."""
    runs = burst(kube, "disabled")
    for run in runs:
        assert run.exit_code == 1 and "hostpid_client: gate: " in run.stdout, run.stdout


def test_2_enabled_nri_restricted(kube: Cluster, release: Release,
                                  images: dict[str, str]) -> None:
    """
    docs/rollout.md step 2 then the NRI plugin's gate (docs/paths.md, its
    first row): the restricted GPU pod's clients get their own host PIDs.
    """
    release.upgrade("hostPIDBroker.enabled=true")
    print(release.rollout("daemonset", "hostpid-broker"))
    broker = kube.get("pods", "-n", NAMESPACE, "-l",
                      "app.kubernetes.io/name=hostpid-broker,app.kubernetes.io/component=broker")
    # The old pod may still be terminating (it drains after the handover).
    (pod,) = [p for p in broker["items"] if "deletionTimestamp" not in p["metadata"]]
    assert pod["spec"]["containers"][0]["env"] == [
        {"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"}]
    probe = kube.kubectl("-n", NAMESPACE, "exec", pod["metadata"]["name"], "--",
                         "hostpid", "probe", "--socket",
                         f"{release.paths.broker_dir}/broker.sock")
    print(probe)
    assert ": ok: answered PID" in probe
    release.upgrade("nri.gate=true")
    print(release.rollout("daemonset", "hostpid-nri"))

    run = workloads.run(kube, workloads.pod(RESTRICTED, "enabled"))
    assert run.facts() == {"ns-pid": "1", "gate": "1", "broker-mounts": "1",
                           "uid": "1000", "gpu": "present", "socket": "present"}, run.stdout
    assert run.exit_code == 0, run.stdout
    assert run.nspid == (run.host_pid, 1)
    assert run.answer() == (run.host_pid, 1)

    python = workloads.run(kube, project_pod(RESTRICTED, "enabled-python", images))
    assert python.exit_code == 0, python.stdout
    assert python.nspid == (python.host_pid, 1)
    assert python.answer() == (python.host_pid,)

    nothing = workloads.run(kube, workloads.pod(RESTRICTED, "no-gpu", gpu=False))
    assert nothing.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0",
                               "uid": "1000", "gpu": "absent", "socket": "absent"}
    assert nothing.exit_code == 1 and "hostpid_client: gate: " in nothing.stdout

    host_path = workloads.pod(RESTRICTED, "host-path")
    host_path["spec"]["volumes"] = [{"name": "broker", "hostPath": {
        "path": str(release.paths.broker_dir)}}]
    host_path["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "broker", "mountPath": "/tmp/vgpulock/hostpid", "readOnly": True}]
    refused = kube.create(host_path)
    print(refused.stderr)
    assert refused.returncode != 0
    assert "violates PodSecurity \"restricted:" in refused.stderr
    assert 'uses restricted volume type "hostPath"' in refused.stderr


BROKER_PATH = "/tmp/vgpulock/hostpid"
LOCK_PARENT = "/tmp/vgpulock"


def userns_run(kube: Cluster, manifest: dict[str, Any]) -> tuple[workloads.Run, dict[str, Any]]:
    """
    A C{hostUsers: false} workload: its script first prints its C{uid_map}
    and the owner the broker directory shows inside; read from the host
    while it waits, its mapping and the per-mount options of its broker
    mount and lock parent (C{idmapped} or not), then its run.
    """
    manifest["spec"]["hostUsers"] = False
    (container,) = manifest["spec"]["containers"]
    container["command"][2] = PROLOGUE + container["command"][2]
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    workloads.start(kube, manifest)
    try:
        host_pid = workloads.container_pid(kube, namespace, name)
    except AssertionError as error:
        # Why the kubelet did not run it (a runtime without user-namespace
        # support: "runtime does not support user namespaces").
        events = kube.kubectl("-n", namespace, "get", "events", "--field-selector",
                              f"involvedObject.name={name}", "-o",
                              "custom-columns=REASON:.reason,MESSAGE:.message")
        raise AssertionError(f"{error}\n{events}") from error
    seen: dict[str, Any] = {"uid_map": workloads.uid_map(host_pid)}
    for path in (BROKER_PATH, LOCK_PARENT):
        try:
            seen[path] = workloads.mount_options(host_pid, path)
        except AssertionError:
            seen[path] = None
    run = workloads.finish(kube, manifest)
    seen.update(userns_facts(run.stdout))
    print(f"\n[cluster] hostUsers: false {namespace}/{name}: {seen}")
    return run, seen


#: Makes a GPU pod of the tier's C client: C{make(prefix, labels, script)}
#: (a device plugin GPU here; test_dra.py's claim pods there).
PodMaker = Callable[[str, Mapping[str, str], str], dict[str, Any]]


def gpu_pod(prefix: str, labels: Mapping[str, str], script: str = workloads.C_SCRIPT
            ) -> dict[str, Any]:
    """A C{restricted} pod with a device plugin GPU in L{RESTRICTED}."""
    return workloads.pod(RESTRICTED, prefix, labels=labels, script=script)


def burst(kube: Cluster, label: str, make: PodMaker = gpu_pod,
          count: int = BURST) -> list[workloads.Run]:
    """
    C{count} GPU pods (of C{make}) created in one request.  Each workload is
    given its go-ahead as soon as the host's C{/proc} shows it (so its host
    PID is read from the host while it lives); creation to first answer is
    from the create request to the client's line in the pod's log (the CRI
    log's own timestamp).
    """
    manifests = [make(f"burst-{label}", {"burst": label}, workloads.C_SCRIPT)
                 for _ in range(count)]
    namespace = manifests[0]["metadata"]["namespace"]
    started = time.time()
    created = kube.kubectl_run("create", "-o", "json", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": manifests}))
    assert created.returncode == 0, created.stderr
    # kubectl prints each created object as a JSON document of its own.
    items, text, decoder = [], created.stdout.strip(), json.JSONDecoder()
    while text:
        item, end = decoder.raw_decode(text)
        items.append(item)
        text = text[end:].strip()
    uids = {item["metadata"]["uid"]: item["metadata"]["name"] for item in items}
    host_pids = workloads.release_each(uids)

    def finished() -> bool:
        pods = kube.get("pods", "-n", namespace, "-l", f"burst={label}")["items"]
        return len(pods) == count and all(
            p["status"].get("phase") in ("Succeeded", "Failed") for p in pods)
    wait_for(finished, f"the {label} burst to finish", 300.0)
    seconds = []
    runs = []
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        current = kube.get("pod", "-n", namespace, name)
        (state,) = current["status"]["containerStatuses"]
        lines = kube.kubectl("logs", "--timestamps", "-n", namespace, name).splitlines()
        stamp = lines[-1].split(" ", 1)[0]
        seconds.append(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
                       - started)
        stdout = "".join(line.split(" ", 1)[1] + "\n" for line in lines)
        runs.append(workloads.Run(name, host_pids[name], (), current["status"]["phase"],
                                  state["state"]["terminated"]["exitCode"], stdout, current))
    kube.kubectl("delete", "pods", "-n", namespace, "-l", f"burst={label}", "--wait=false")
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    print(f"\n[cluster] burst {label}: {count} pods, creation to first answer "
          f"p50 {statistics.median(seconds):.2f} s, p99 {p99:.2f} s, max {max(seconds):.2f} s")
    return runs


def test_3_burst_enabled(kube: Cluster, release: Release) -> None:
    runs = burst(kube, "enabled")
    for run in runs:
        assert run.exit_code == 0, run.stdout
        assert run.answer() == (run.host_pid, 1), (run.name, run.host_pid, run.stdout)


#: A workload that queries the broker in a loop until told to stop (the file
#: C{/tmp/stop} in its own root, written by the test through /proc): one line
#: per query, C{ok HOSTPID NSPID} or C{FAIL CHECK: ...} (the client's stderr).
LOOP_SCRIPT = (
    "while [ ! -e /tmp/stop ]; do "
    "if out=$(/bin/hostpid_client 2>&1); then echo \"ok $out\"; "
    "else echo \"FAIL $out\"; fi; sleep 0.05; done"
)


class Loop:
    """GPU pods (of C{make}) querying in a loop, started now, stopped and read by L{stop}."""

    def __init__(self, kube: Cluster, label: str, count: int = 2,
                 make: PodMaker = gpu_pod) -> None:
        self.kube = kube
        self.manifests = [make(f"loop-{label}", {"loop": label}, LOOP_SCRIPT)
                          for _ in range(count)]
        self.namespace = self.manifests[0]["metadata"]["namespace"]
        self.pids = {}
        for manifest in self.manifests:
            workloads.start(kube, manifest)
        for manifest in self.manifests:
            name = manifest["metadata"]["name"]
            self.pids[name] = workloads.container_pid(kube, self.namespace, name)

    def lines(self) -> dict[str, list[str]]:
        return {name: self.kube.kubectl("logs", "-n", self.namespace, name).splitlines()
                for name in self.pids}

    def stop(self) -> dict[str, list[str]]:
        from pathlib import Path

        for pid in self.pids.values():
            Path(f"/proc/{pid}/root/tmp/stop").touch()
        wait_for(lambda: all(
            self.kube.get("pod", "-n", self.namespace, name)["status"].get("phase")
            == "Succeeded" for name in self.pids), "the loop pods to stop", 60.0)
        return self.lines()


class Stream:
    """GPU pods created one after another in a thread, until stopped."""

    def __init__(self, kube: Cluster, label: str, interval: float = 0.5) -> None:
        self.kube, self.label, self.interval = kube, label, interval
        self.names: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            manifest = workloads.pod(RESTRICTED, f"stream-{self.label}", labels={
                "stream": self.label}, script=STREAM_SCRIPT)
            if self.kube.create(manifest).returncode == 0:
                self.names.append(manifest["metadata"]["name"])
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, str]:
        """Each pod's gate as its container saw it (C{1} when adjusted)."""
        self._stop.set()
        self._thread.join(30)

        def finished() -> bool:
            pods = self.kube.get("pods", "-n", RESTRICTED, "-l", f"stream={self.label}")
            return all(p["status"].get("phase") in ("Succeeded", "Failed")
                       for p in pods["items"])
        wait_for(finished, f"the {self.label} stream's pods to finish", 300.0)
        gates = {}
        for name in self.names:
            output = self.kube.kubectl("logs", "-n", RESTRICTED, name)
            gates[name] = output.split("gate ", 1)[1].split()[0] if "gate " in output else "?"
        self.kube.kubectl("delete", "pods", "-n", RESTRICTED, "-l", f"stream={self.label}",
                          "--wait=false")
        return gates


STREAM_SCRIPT = 'echo "gate ${LIBVGPU_HOSTPID_BROKER-unset}"'


def failures(lines: dict[str, list[str]]) -> tuple[int, int]:
    total = sum(len(v) for v in lines.values())
    failed = sum(1 for v in lines.values() for line in v if not line.startswith("ok "))
    return total, failed


def test_4_rolled_forward(kube: Cluster, release: Release, images: dict[str, str]) -> None:
    """
    helm upgrade to the second image tag: the broker DaemonSet's surge-first
    rollout with the handover loses no query; the NRI DaemonSet's rollout
    under a stream of GPU pod creations, counted.
    """
    loop = Loop(kube, "forward")
    wait_for(lambda: all(len(v) >= 5 for v in loop.lines().values()),
             "the loop pods' first answers", 60.0)
    stream = Stream(kube, "forward")
    before = kube.get("pods", "-n", NAMESPACE)["items"]
    release.upgrade(f"image.tag={images['next']}")
    print(release.rollout("daemonset", "hostpid-broker"))
    print(release.rollout("daemonset", "hostpid-nri"))
    gates = stream.stop()
    lines = loop.stop()
    after = kube.get("pods", "-n", NAMESPACE)["items"]
    assert {p["metadata"]["name"] for p in before}.isdisjoint(
        p["metadata"]["name"] for p in after), "every broker and NRI pod was replaced"
    assert all(p["spec"]["containers"][0]["image"].endswith(f":{images['next']}")
               for p in after)
    total, failed = failures(lines)
    unadjusted = sorted(name for name, gate in gates.items() if gate != "1")
    print(f"\n[cluster] roll forward: {total} queries, {failed} failed; "
          f"{len(gates)} GPU pods created during the two rollouts, "
          f"{len(unadjusted)} without the adjustment")
    assert failed == 0, [line for v in lines.values() for line in v if not line.startswith("ok")]
    for name, pid in loop.pids.items():
        assert all(line == f"ok {pid} 1" or line.split()[2] != "1"
                   for line in lines[name] if line.startswith("ok "))
    strategy = kube.get("daemonset", "-n", NAMESPACE, "hostpid-nri")["spec"]["updateStrategy"]
    # Surge-first on every node: the chart's default surge, 10% of the nodes
    # (one on this node), and never a node without its plugin.
    assert strategy["rollingUpdate"] == {"maxSurge": "10%", "maxUnavailable": 0}, strategy
    assert unadjusted == []


#: How long the flood pod floods the NRI pod's two metrics ports.  30 s
#: holds at least one liveness (every 20 s) and two readiness probes (every
#: 10 s) of each of the pod's containers, each counted by the kubelet, and
#: one failed probe is already the weakness (an C{Unhealthy} event; three
#: failed liveness probes in a row restart the container).  60 s, a
#: restart's worth of liveness probes, costs 30 s more of CI for no probe
#: of a kind the shorter run lacks.
FLOOD_SECONDS = 30
#: Connections each flooding process keeps in flight (as the integration test's).
FLOOD_IN_FLIGHT = 512
#: The chart's probe timeout: the control (the old C{httpGet} probe, from the
#: node as the kubelet made it) is reported beside the kubelet's own counts.
#: From one pod on this tier the flood failed it only about 2 times in 55
#: (3,500 connects/s over both ports), so the control is a figure, not a
#: verdict; the attack itself, an old probe failed by a flood, is reproduced
#: against the real plugin in tests/integration/test_nri_probes.py.
PROBE_TIMEOUT = 3.0
#: Each flood must at least have reached its port this often, or the test
#: proved nothing about a flooded port.
LEAST_CONNECTS = 1000
#: The control's pause between two of its probes of a port (it must not
#: flood the port itself when the flood does not bite).
CONTROL_INTERVAL = 0.5
NRI_SELECTOR = "app.kubernetes.io/component=nri-plugin"

#: Two flooding processes (L{attackers.TCP_CONNECT_FLOOD}, its source in the
#: container's C{FLOOD}), one per port, stopped by the pod itself after
#: L{FLOOD_SECONDS}: each prints C{ready} then C{connects N}.
FLOOD_SCRIPT = (
    'python -c "$FLOOD" {ip} {plugin} {n} & a=$!; '
    'python -c "$FLOOD" {ip} {standby} {n} & b=$!; '
    "sleep {seconds}; kill -TERM $a $b; wait $a && wait $b"
)


def probe_counts(kube: Cluster, pod: str) -> dict[tuple[str, str, str], int]:
    """
    The kubelet's own count of the probes it ran for C{pod}'s containers
    (C{prober_probe_total} on its C{/metrics/probes}, through the API
    server): by container, probe type and result.
    """
    from cluster import NODE_NAME
    from prometheus_client.parser import text_string_to_metric_families

    text = kube.kubectl("get", "--raw", f"/api/v1/nodes/{NODE_NAME}/proxy/metrics/probes")
    counts: dict[tuple[str, str, str], int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name == "prober_probe_total" and labels.get("pod") == pod
                    and labels.get("namespace") == NAMESPACE):
                key = (labels["container"], labels["probe_type"], labels["result"])
                counts[key] = counts.get(key, 0) + int(sample.value)
    return counts


def unhealthy_events(kube: Cluster, pod: str) -> int:
    """C{Unhealthy} events (a failed probe) the kubelet recorded for C{pod}."""
    events = kube.get("events", "-n", NAMESPACE, "--field-selector",
                      f"reason=Unhealthy,involvedObject.name={pod}")["items"]
    return sum(int(e.get("count") or 1) for e in events)


def nri_pod(kube: Cluster) -> dict[str, Any]:
    (pod,) = [p for p in kube.get("pods", "-n", NAMESPACE, "-l", NRI_SELECTOR)["items"]
              if "deletionTimestamp" not in p["metadata"]]
    return dict(pod)


def test_4b_flooded_metrics_ports_fail_no_probe(kube: Cluster, release: Release,
                                                images: dict[str, str]) -> None:
    """
    An ordinary pod (Pod Security C{restricted}, UID 1000, another
    namespace) floods both of the NRI pod's metrics ports for
    L{FLOOD_SECONDS} while GPU pods are created: the kubelet's probes of
    both containers (exec, on the pod's loopback) all succeed, no
    C{Unhealthy} event, no restart, and every GPU pod created meanwhile
    gets the NRI adjustment.  This node's CNI (bridge) enforces no
    NetworkPolicy, so the flood reaches the ports; the control shows it
    reached both ports (each flood's connects counted); the old probe
    (C{httpGet} on the metrics port, from the node) is run beside it and its
    failures reported.
    """
    before = nri_pod(kube)
    name, ip = before["metadata"]["name"], before["status"]["podIP"]
    ports = {c["name"]: c["ports"][0]["containerPort"] for c in before["spec"]["containers"]}
    restarts = {c["name"]: c["restartCount"] for c in before["status"]["containerStatuses"]}
    for port in ports.values():
        assert http_probe(ip, port, "/healthz", PROBE_TIMEOUT), f"{ip}:{port} before the flood"
    events = unhealthy_events(kube, name)
    probes = probe_counts(kube, name)

    flood = workloads.pod(
        RESTRICTED, "flood", gpu=False, image=f"{images['repository']}:{images['tag']}",
        script=FLOOD_SCRIPT.format(ip=ip, plugin=ports["nri-plugin"],
                                   standby=ports["nri-standby"], n=FLOOD_IN_FLIGHT,
                                   seconds=FLOOD_SECONDS))
    flood["spec"]["containers"][0]["env"] = [{"name": "FLOOD", "value": TCP_CONNECT_FLOOD}]
    flood_name = flood["metadata"]["name"]
    workloads.start(kube, flood)

    def flood_output() -> str:
        result = kube.kubectl_run("logs", "-n", RESTRICTED, flood_name)
        return result.stdout if result.returncode == 0 else ""
    wait_for(lambda: flood_output().count("ready") == 2, "both floods in flight", 120.0)
    stream = Stream(kube, "flood")
    old: dict[int, list[bool]] = {port: [] for port in ports.values()}
    stop = threading.Event()

    def control(port: int) -> None:
        while not stop.wait(CONTROL_INTERVAL):
            old[port].append(http_probe(ip, port, "/healthz", PROBE_TIMEOUT))
    controls = [threading.Thread(target=control, args=(port,), daemon=True) for port in old]
    for thread in controls:
        thread.start()
    try:
        wait_for(lambda: kube.get("pod", "-n", RESTRICTED, flood_name)["status"].get("phase")
                 in ("Succeeded", "Failed"), "the flood pod to stop itself",
                 FLOOD_SECONDS + 120.0)
    finally:
        stop.set()
        for thread in controls:
            thread.join(PROBE_TIMEOUT + 5)
        gates = stream.stop()
    after = nri_pod(kube)
    probed = {key: count - probes.get(key, 0)
              for key, count in probe_counts(kube, name).items()}
    output = flood_output()
    phase = kube.get("pod", "-n", RESTRICTED, flood_name)["status"]["phase"]
    kube.kubectl("delete", "pod", "-n", RESTRICTED, flood_name, "--wait=false")
    # The two floods share the pod's output, so their last lines may meet.
    connects = [int(n) for n in re.findall(r"connects (\d+)", output)]
    unadjusted = sorted(n for n, gate in gates.items() if gate != "1")
    restarted = {c["name"]: c["restartCount"] for c in after["status"]["containerStatuses"]}
    unhealthy = unhealthy_events(kube, name) - events
    print(f"\n[cluster] flood of {ip} ports {sorted(ports.values())} for {FLOOD_SECONDS} s: "
          f"connects {connects} ({sum(connects) / FLOOD_SECONDS:.0f}/s); old httpGet probe "
          + ", ".join(f"{port}: {o.count(False)} of {len(o)} failed" for port, o in old.items())
          + f"; kubelet probes {dict(sorted(probed.items()))}; {unhealthy} Unhealthy events; "
          f"restarts {restarted}; {len(gates)} GPU pods created during the flood, "
          f"{len(unadjusted)} without the adjustment")

    assert phase == "Succeeded" and len(connects) == 2, (phase, output)
    assert min(connects) >= LEAST_CONNECTS, connects
    assert after["metadata"]["name"] == name, "the NRI pod was not replaced"
    assert restarted == restarts == {container: 0 for container in ports}
    for container in ports:
        for kind, least in (("Liveness", 1), ("Readiness", 2)):
            assert probed.get((container, kind, "successful"), 0) >= least, (container, probed)
    assert {key: n for key, n in probed.items() if key[2] != "successful" and n} == {}
    assert unhealthy == 0
    assert gates and unadjusted == [], gates


def test_6_webhook(kube: Cluster, release: Release) -> None:
    """
    docs/paths.md's webhook rollout (mode mounts, a privileged namespace):
    the API server calls the webhook through its Service over TLS and the
    pod gets its host PID; with the webhook at 0 replicas, GPU pods are
    still admitted, unpatched (failurePolicy Ignore).
    """
    release.upgrade("webhook.enabled=true", "webhook.mode=mounts",
                    "webhook.extendedResources={nvidia.com/gpu}")
    print(release.rollout("deployment", "hostpid-webhook"))
    release.upgrade("webhook.gate=true")
    print(release.rollout("deployment", "hostpid-webhook"))
    manifest = workloads.pod(PRIVILEGED, "webhook", labels={"hostpid.hami.io/nri": "disabled"})
    workloads.start(kube, manifest)
    stored = kube.get("pod", "-n", PRIVILEGED, manifest["metadata"]["name"])
    paths = {v["hostPath"]["path"] for v in stored["spec"].get("volumes", [])
             if "hostPath" in v}
    assert str(release.paths.broker_dir) in paths, stored["spec"].get("volumes")
    run = workloads.finish(kube, manifest)
    assert run.exit_code == 0, run.stdout
    assert run.answer() == (run.host_pid, 1)

    # docs/userns.md: a user-namespaced pod that adds SYS_ADMIN gets no
    # broker volume (its kubelet would idmap it, and its root could remount
    # it writable); the API server admits it with the webhook's warning.
    userns = workloads.pod(PRIVILEGED, "userns-sys-admin", restricted=False, host_users=False,
                           labels={"hostpid.hami.io/nri": "disabled"})
    userns["spec"]["containers"][0]["securityContext"] = {
        "capabilities": {"add": ["SYS_ADMIN"]}}
    created = kube.create(userns)
    assert created.returncode == 0, created.stderr
    print(f"\n[cluster] hostUsers: false with SYS_ADMIN: {created.stderr.strip()}")
    assert "SYS_ADMIN" in created.stderr, created.stderr
    stored = kube.get("pod", "-n", PRIVILEGED, userns["metadata"]["name"])
    assert not any("hostPath" in v for v in stored["spec"].get("volumes", [])), stored["spec"]
    kube.kubectl("-n", PRIVILEGED, "delete", "pod", userns["metadata"]["name"], "--wait=false")

    kube.kubectl("-n", NAMESPACE, "scale", "deployment/hostpid-webhook", "--replicas=0")
    wait_for(lambda: not kube.get("pods", "-n", NAMESPACE, "-l",
                                  "app.kubernetes.io/component=webhook")["items"],
             "the webhook's pods to go", 120.0)
    down = workloads.pod(PRIVILEGED, "webhook-down", labels={"hostpid.hami.io/nri": "disabled"})
    started = time.monotonic()
    workloads.start(kube, down)
    admitted = time.monotonic() - started
    stored = kube.get("pod", "-n", PRIVILEGED, down["metadata"]["name"])
    assert not any("hostPath" in v for v in stored["spec"].get("volumes", [])), stored["spec"]
    run = workloads.finish(kube, down)
    print(f"\n[cluster] webhook at 0 replicas: admitted unpatched in {admitted:.2f} s")
    assert run.exit_code == 1 and "hostpid_client: gate: " in run.stdout, run.stdout
    kube.kubectl("-n", NAMESPACE, "scale", "deployment/hostpid-webhook", "--replicas=2")
    print(release.rollout("deployment", "hostpid-webhook"))


def test_6b_user_namespaces(kube: Cluster, release: Release, gpus: DevicePlugin,
                            deviceplugin_messages: object, images: dict[str, str]) -> None:
    """
    C{hostUsers: false} GPU pods on the real kubelet (docs/userns.md, "What
    each path gives"), each given 65536 IDs from a multiple of 65536:

    - NRI path, the C{restricted} namespace: the plugin's read-only bind is
      plain (no C{idmapped} in the container's mountinfo, read from the
      host) and both of its mounts carry C{nosuid,nodev,noexec} (the
      image's plugin is the tree's: C{test_image}), so the broker directory
      shows as the overflow UID; the C and
      the Python client each get their own host PID;
    - webhook path (mode C{mounts}, a C{privileged} namespace, no
      capability added): the kubelet puts the pod's mapping on every mount,
      so runc 1.5 makes the broker volume and the lock parent idmapped; the
      directory shows as 0 and the C client gets its host PID.

    The session's GPUs are private nodes, not at C{/dev/nvidiaN} on the host,
    so for these pods a plugin hands out GPUs at their own host paths (the
    NRI plugin is told that path as a device signal), then the session's
    plugin registers again, as the CDI test does.
    """
    from types import ModuleType

    assert isinstance(deviceplugin_messages, ModuleType)
    plugin = DevicePlugin(deviceplugin_messages, release.paths.userns_gpu_dir, 3, "devices",
                          name="hostpid-test-gpu-userns", at_host_path=True)
    plugin.start()
    try:
        wait_for(lambda: kube.get("node", "hostpid-node")["status"]["allocatable"]
                 .get("nvidia.com/gpu") == "3", "the user-namespace plugin's GPUs", 60.0)
        for manifest, answer in (
                (workloads.pod(RESTRICTED, "userns-nri"), (1,)),
                (project_pod(RESTRICTED, "userns-nri-python", images), ())):
            run, seen = userns_run(kube, manifest)
            name = manifest["metadata"]["name"]
            inside, outside, length = seen["uid_map"]
            assert (inside, length) == (0, 65536), (name, seen)
            assert outside >= 65536 and outside % 65536 == 0, (name, seen)
            assert seen["uidmap"] == f"0 {outside} 65536", (name, seen)
            assert seen[BROKER_PATH] is not None and "ro" in seen[BROKER_PATH], (name, seen)
            assert "idmapped" not in seen[BROKER_PATH], (name, seen)
            for path, access in ((BROKER_PATH, "ro"), (LOCK_PARENT, "rw")):
                assert {access, "nosuid", "nodev", "noexec"} <= set(seen[path] or ()), (
                    name, path, seen)
            assert seen["owner"] == str(OVERFLOW_UID), (name, seen)
            assert run.facts()["gate"] == "1" and run.facts()["uid"] == "1000", run.stdout
            assert run.exit_code == 0, run.stdout
            assert run.nspid == (run.host_pid, 1)
            assert run.answer() == (run.host_pid, *answer), run.stdout

        manifest = workloads.pod(PRIVILEGED, "userns-webhook",
                                 labels={"hostpid.hami.io/nri": "disabled"})
        run, seen = userns_run(kube, manifest)
        stored = run.pod["spec"]
        assert stored["hostUsers"] is False
        paths = {v["hostPath"]["path"] for v in stored.get("volumes", []) if "hostPath" in v}
        assert str(release.paths.broker_dir) in paths, stored.get("volumes")
        assert seen[BROKER_PATH] is not None and "ro" in seen[BROKER_PATH], seen
        assert "idmapped" in seen[BROKER_PATH], seen
        assert seen[LOCK_PARENT] is not None and "idmapped" in seen[LOCK_PARENT], seen
        assert seen["owner"] == "0", seen
        assert run.facts()["gate"] == "1" and run.facts()["broker-mounts"] == "1", run.stdout
        assert run.exit_code == 0, run.stdout
        assert run.answer() == (run.host_pid, 1), run.stdout
        assert len(plugin.allocations) == 3
    finally:
        plugin.stop()
        workloads.restore_session_gpus(kube, gpus)


def nri_ready(kube: Cluster) -> bool:
    """The NRI plugin's C{/readyz} (ready once the runtime configured it), on its pod IP."""
    import urllib.error
    import urllib.request

    pods = kube.get("pods", "-n", NAMESPACE, "-l",
                    "app.kubernetes.io/component=nri-plugin")["items"]
    ips = [p["status"].get("podIP") for p in pods if "deletionTimestamp" not in p["metadata"]]
    if len(ips) != 1 or not ips[0]:
        return False
    try:
        with urllib.request.urlopen(f"http://{ips[0]}:9396/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def test_8_node_restart(kube: Cluster, release: Release) -> None:
    """
    containerd and the kubelet stopped and started again: the chart's pods
    come back Ready; GPU pods created from the restart on, until the NRI
    plugin is ready again and 10 more have been created, are counted with
    or without the NRI adjustment.
    """
    assert nri_ready(kube)
    kube.processes["kubelet"].stop()
    kube.containerd.restart()
    kube.processes["kubelet"].start()
    stream = Stream(kube, "restart", interval=0.2)
    wait_for(lambda: nri_ready(kube), "the NRI plugin to be ready again", 120.0)
    count = len(stream.names)
    wait_for(lambda: len(stream.names) >= count + 10, "10 more GPU pods", 120.0)
    gates = stream.stop()
    kube.wait_node_ready()
    for kind, name in (("daemonset", "hostpid-broker"), ("daemonset", "hostpid-nri"),
                       ("deployment", "hostpid-webhook")):
        if kube.kubectl_run("-n", NAMESPACE, "get", kind, name).returncode == 0:
            print(release.rollout(kind, name))
    unadjusted = [name for name, gate in gates.items() if gate != "1"]
    print(f"\n[cluster] node restart: {len(gates)} GPU pods created from the restart on "
          f"({count} before the NRI plugin was ready again), {len(unadjusted)} without "
          "the adjustment")
    run = workloads.run(kube, workloads.pod(RESTRICTED, "after-restart"))
    assert run.exit_code == 0 and run.answer() == (run.host_pid, 1), run.stdout


def test_5_rolled_back(kube: Cluster, release: Release) -> None:
    """
    docs/paths.md's rollback: gates off, then the broker.  The NOTES' one
    command (the broker off) is refused while a gate is on; in the
    documented order every step is accepted; new pods get nothing; a pod
    created while it was on keeps running and falls back once the socket is
    gone.
    """
    import helm_python as helm

    loop = Loop(kube, "back", count=1)
    (name,) = loop.pids
    wait_for(lambda: len(loop.lines()[name]) >= 5, "the loop pod's first answers", 60.0)
    with pytest.raises(helm.HelmError) as refused:
        release.upgrade("hostPIDBroker.enabled=false")
    print(f"\n[cluster] the broker off while a gate is on: {refused.value}")
    release.upgrade("webhook.gate=false", "nri.gate=false")
    print(release.rollout("daemonset", "hostpid-nri"))
    print(release.rollout("deployment", "hostpid-webhook"))
    off = workloads.run(kube, workloads.pod(RESTRICTED, "gates-off"))
    assert off.facts()["gate"] == "unset" and off.facts()["broker-mounts"] == "0"
    release.upgrade("hostPIDBroker.enabled=false")
    print(release.rollout("daemonset", "hostpid-broker"))
    assert not (release.paths.broker_dir / "broker.sock").exists()
    count = len(loop.lines()[name])
    wait_for(lambda: len(loop.lines()[name]) >= count + 5, "answers after the rollback", 60.0)
    lines = loop.stop()[name]
    assert lines[0].startswith("ok "), lines[:3]
    assert lines[-1].startswith("FAIL hostpid_client: socket: "), lines[-3:]
    assert kube.get("pod", "-n", RESTRICTED, name)["status"]["phase"] == "Succeeded"
    after = workloads.run(kube, workloads.pod(RESTRICTED, "rolled-back"))
    assert after.exit_code == 1 and "hostpid_client: gate: " in after.stdout, after.stdout
