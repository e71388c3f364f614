"""
The chart's NRI plugin (C{nri.enabled}), rendered by Helm's own engine as
C{tests/test_chart.py} renders the rest.

Why each check exists:

- Off by default: a default install renders no plugin.
- On, every object validates (strict) for the supported Kubernetes versions
  and C{helm lint --strict} stays clean.
- Its own DaemonSet, rolled out surge-first (C{maxSurge: 1, maxUnavailable:
  0}: the old pod stops only once the new one is ready, so no container is
  created while no plugin is registered; two registered plugins never both
  adjust a container, C{tests/e2e/test_nri_upgrade.py}), with a standby
  container at the next index (a crashed plugin leaves the other), with no
  host PID namespace, no capability, root only for the runtime's socket,
  the runtime's socket directory and the broker directory read-only, and
  nothing of the host writable but the lock parent itself (the plugin
  repairs the broker mountpoint there, as C{hostpid allocate} does).  It was
  the lock parent's parent, the host's C{/tmp} with other services'
  C{systemd-private-*} directories, and a schema-valid C{/var/vgpulock} gave
  it the host's C{/var}.  A lock parent deeper than a name directly in
  C{/tmp} is refused at render with the plugin on: the plugin no longer sees
  the directories above it.
- Its gate is its own (C{nri.gate}, on after the broker and off before it:
  the chart refuses it without the broker's), its options the values; no
  broker selector selects its pods.
- Probes no other pod can fail: exec probes (C{hostpid nri-probe}) on the
  plugin's C{--health} listener on the pod's loopback, no C{httpGet} (one
  flooding pod failed 8 of 9 on the metrics port); the metrics ports admit
  the monitoring namespace alone (a NetworkPolicy like the broker's).
- The schema refuses a malformed index or signal before rendering, and
  C{nri.resources} is validated as the plugin validates them
  (L{hostpid.nri.decision.parse_resource}): a value the plugin would refuse
  at start (C{nvidia.com/gpumem}, C{amd.com/gpu}, a regular expression
  that does not compile) is refused at render, the message naming the
  value's path; what it accepts renders.
- The runtime's socket directory is mounted read-only (the plugin connects
  through it: tests/e2e/test_nri_socket_mount.py).
- The NOTES' rollback is one the chart accepts with the gates on (each
  gate off before the broker) and names the webhook.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate.utils as kubernetes_validate
import pytest
from test_chart import CHART, RELEASE_NAMESPACE, by_kind, merge, notes, refusal, render, sets
from test_deploy import KUBERNETES_VERSIONS

from hostpid.nri.decision import parse_resource

ON = sets("nri.enabled=true")


def plugin_daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"
             and d["metadata"]["name"] == "hostpid-nri"]
    return ds


def test_off_by_default() -> None:
    assert not [d for d in render() if "nri" in d["metadata"]["name"]]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_objects_validate_and_lint(version: str) -> None:
    for doc in render(ON):
        if doc["kind"] in ("PodMonitor", "ServiceMonitor"):
            continue
        assert kubernetes_validate.validate(doc, version, strict=True)
    report = helm.lint(CHART, ON, strict=True, namespace=RELEASE_NAMESPACE,
                       kube_version=f"v{version}")
    assert report["errors"] == [], report
    assert report["messages"] == [
        {"severity": 1, "path": "Chart.yaml", "error": "icon is recommended"}], report


def test_plugin_daemonset_shape() -> None:
    docs = render(merge(ON, sets("hostPIDBroker.enabled=true", "nri.gate=true",
                                        "nri.resources[0]=device:/dev/dri/renderD*",
                                        "nri.pluginIndex=95")))
    ds = plugin_daemonset(docs)
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": "10%"}
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is False and spec["hostNetwork"] is False
    container, standby = spec["containers"]
    assert (container["name"], standby["name"]) == ("nri-plugin", "nri-standby")
    assert standby["args"][standby["args"].index("--plugin-index") + 1] == "96"
    assert standby["args"][standby["args"].index("--metrics") + 1] == "tcp:9397:interface=0.0.0.0"
    assert standby["args"][standby["args"].index("--health") + 1] == \
        "tcp:9399:interface=127.0.0.1"
    differs = {k for k in container if container[k] != standby[k]}
    assert differs == {"name", "args", "ports", "readinessProbe", "livenessProbe"}, differs
    assert container["command"] == ["twistd", "--nodaemon", "--pidfile=", "hostpid-nri"]
    args = container["args"]
    assert args[args.index("--nri-socket") + 1] == "/var/run/nri/nri.sock"
    assert args[args.index("--plugin-index") + 1] == "95"
    assert args[args.index("--resource") + 1] == "device:/dev/dri/renderD*"
    assert args[args.index("--broker-dir") + 1] == "/var/run/hami/hostpid"
    assert {"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"} in container["env"]
    security = container["securityContext"]
    # One capability: the broker mountpoint is made immutable (docs/security.md).
    assert security["runAsUser"] == 0 and security["capabilities"] == {
        "drop": ["ALL"], "add": ["LINUX_IMMUTABLE"]}
    assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(mounts) == {"/var/run/nri", "/var/run/hami/hostpid", "/tmp/vgpulock"}
    # Read-only but the lock parent itself, which the plugin writes to repair the
    # broker mountpoint a tenant replaced.
    assert mounts["/var/run/nri"]["readOnly"] is True, mounts
    assert mounts["/var/run/hami/hostpid"]["readOnly"] is True, mounts
    assert not mounts["/tmp/vgpulock"].get("readOnly", False), mounts
    broker = by_kind([d for d in docs if d["metadata"]["name"] == "hostpid-broker"],
                     "DaemonSet")
    selector = broker["spec"]["selector"]["matchLabels"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= labels.items()


def test_notes_name_the_plugin_when_enabled() -> None:
    from test_chart import notes

    assert "daemonset/hostpid-nri" in notes(ON) and "nri.gate=false" in notes(ON)
    assert "hostpid-nri" not in notes()


@pytest.mark.parametrize(("value", "indexes"), [
    (sets("nri.enabled=true", "nri.pluginIndex=7"), ["07", "08"]),
    ({"nri": {"enabled": True, "pluginIndex": "08"}}, ["08", "09"]),
    ({"nri": {"enabled": True, "pluginIndex": "09"}}, ["09", "10"]),
    ({"nri": {"enabled": True}}, ["90", "91"]),
])
def test_an_index_is_two_digits_and_the_standby_the_next(value: dict[str, Any],
                                                         indexes: list[str]) -> None:
    containers = plugin_daemonset(render(value))["spec"]["template"]["spec"]["containers"]
    assert [c["args"][c["args"].index("--plugin-index") + 1] for c in containers] == indexes


def test_index_99_leaves_none_for_the_standby() -> None:
    assert "leaves no index for the plugin's standby" in str(
        refusal({"nri": {"enabled": True, "pluginIndex": "99"}}))


def gate(values: dict[str, Any]) -> str:
    containers = plugin_daemonset(render(values))["spec"]["template"]["spec"]["containers"]
    values_ = {str(e["value"]) for c in containers for e in c["env"]
               if e["name"] == "LIBVGPU_HOSTPID_BROKER"}
    (value,) = values_
    return value


def test_the_plugins_gate_is_its_own_and_never_without_the_brokers() -> None:
    assert gate(ON) == "0"
    assert gate(merge(ON, sets("hostPIDBroker.enabled=true"))) == "0"
    assert gate(merge(ON, sets("devicePlugin.hostPIDBroker.enabled=true", "nri.gate=true"))) \
        == "1"
    assert str(refusal(merge(ON, sets("nri.gate=true")))).count(
        "nri.gate=true requires hostPIDBroker.enabled=true") == 1


@pytest.mark.parametrize("values", [
    sets("nri.enabled=true", "nri.pluginIndex=100"),
    {"nri": {"enabled": True, "pluginIndex": "9"}},
    sets("nri.enabled=true", "nri.resources[0]=env:NVIDIA_VISIBLE_DEVICES"),
    sets("nri.enabled=true", "nri.socket=relative.sock"),
])
def test_schema_refuses(values: dict[str, Any]) -> None:
    assert "nri" in str(refusal(values))


#: Values the plugin refuses at start (twistd hostpid-nri --resource), each
#: with what the chart's refusal must say besides the value's path.
PLUGIN_REFUSES = [
    "nvidia.com/gpumem", "nvidia.com/gpucores", "amd.com/gpu", "env:NVIDIA_VISIBLE_DEVICES",
    "device:dev/nvidia0", "devnull-mount:var/run", "cdi:", "gpu",
    "device:re:/dev/nvidia[", "device:re:(a", "device:re:*a", "device:re:a)|(b",
]
#: Values it accepts, which render.
PLUGIN_ACCEPTS = [
    "nvidia.com/gpu", "device:/dev/dri/renderD*", "device:re:/dev/nvidia[0-9]+",
    "device:re:(?i)/dev/NVIDIA.*", "cdi:amd.com/gpu",
    "devnull-mount:/var/run/nvidia-container-devices",
]


@pytest.mark.parametrize("value", PLUGIN_REFUSES)
def test_a_resource_the_plugin_refuses_is_refused_at_render_by_its_path(value: str) -> None:
    with pytest.raises(ValueError):
        parse_resource(value)
    message = str(refusal({"nri": {"enabled": True, "resources": ["nvidia.com/gpu", value]}}))
    assert "/nri/resources/1" in message or "nri.resources[1]" in message, message
    assert value in message, message


@pytest.mark.parametrize("value", PLUGIN_ACCEPTS)
def test_a_resource_the_plugin_accepts_renders(value: str) -> None:
    assert parse_resource(value)
    containers = plugin_daemonset(render({"nri": {"enabled": True, "resources": [value]}}))[
        "spec"]["template"]["spec"]["containers"]
    for container in containers:  # the plugin and its standby
        assert container["args"][container["args"].index("--resource") + 1] == value


@pytest.mark.parametrize("gates", [
    ("webhook.gate=true",), ("nri.gate=true",), ("webhook.gate=true", "nri.gate=true"), ()])
def test_the_notes_rollback_is_accepted_step_by_step(gates: tuple[str, ...]) -> None:
    """
    With the broker and any gate on, each C{helm upgrade --reset-then-reuse-values}
    the NOTES give renders in its turn (the chart refuses the broker off
    while a gate is on: a single "broker off" was refused), the last turns
    the broker off, and the webhook is named where it runs.
    """
    values = sets("hostPIDBroker.enabled=true", "webhook.enabled=true", "nri.enabled=true",
                  *gates)
    text = notes(values)
    rollback = text.split("Roll back", 1)[1]  # before it, the NOTES name a gate still off
    commands = [line.split("--reset-then-reuse-values", 1)[1].split()
                for line in rollback.splitlines() if line.strip().startswith("helm upgrade")]
    assert commands and all(c[::2] == ["--set"] * (len(c) // 2) for c in commands), commands
    for command in commands:
        values = merge(values, sets(*command[1::2]))
        render(values)
    assert gate(values) == "0"
    assert "The gate is OFF (hostPIDBroker.enabled=false)" in notes(values)
    assert commands[-1] == ["--set", "hostPIDBroker.enabled=false"]
    assert "hostpid-webhook" in text.split("Roll back", 1)[1]
    if "webhook.gate=true" in gates:
        assert "MutatingWebhookConfiguration hostpid-webhook-hostpid" in text


@pytest.mark.parametrize("parts", [("nri.enabled=true",),
                                   ("nri.enabled=true", "webhook.enabled=true")])
def test_the_notes_lead_the_nri_path_to_its_gate(parts: tuple[str, ...]) -> None:
    """
    Installed with the NRI plugin and every gate off, an operator who runs
    each command the NOTES give, in turn, ends with the broker and
    C{nri.gate} on (the NOTES once stopped at the broker and never named the
    plugin's gate); and on the NRI path neither the rollout nor the rollback
    sends them to a device plugin's allocation side, which is not in use.
    """
    values = sets(*parts)
    walked = []
    while True:
        text = notes(values)
        assert "device plugin" not in text, text
        forward = [line.split("--reset-then-reuse-values", 1)[1].split()
                   for line in text.splitlines()
                   if line.strip().startswith("helm upgrade") and "=true" in line]
        if not forward:
            break
        command = forward[0]
        assert command[::2] == ["--set"] * (len(command) // 2), command
        walked.append(command[1::2])
        values = merge(values, sets(*command[1::2]))
        render(values)
        assert len(walked) <= 3, walked
    assert walked[0] == ["hostPIDBroker.enabled=true"], walked
    assert "nri.gate=true" in walked[1], walked
    assert gate(values) == "1" and values["nri"]["gate"] is True
    rollback = notes(values).split("Roll back", 1)[1]
    assert "--set nri.gate=false" in rollback


def test_probes_are_exec_probes_on_the_pods_loopback() -> None:
    """
    No httpGet, tcpSocket or grpc probe (the kubelet connects to the pod IP,
    which every pod reaches): each container's probes run `hostpid
    nri-probe` against its own --health listener on 127.0.0.1, and the ports
    the pod declares are the metrics ports only.
    """
    spec = plugin_daemonset(render(merge(ON, sets("nri.probePort=9500"))))[
        "spec"]["template"]["spec"]
    for container, port in zip(spec["containers"], (9500, 9501), strict=True):
        args = container["args"]
        assert args[args.index("--health") + 1] == f"tcp:{port}:interface=127.0.0.1"
        ready, live = container["readinessProbe"], container["livenessProbe"]
        assert set(ready) - {"periodSeconds", "timeoutSeconds", "failureThreshold"} == {"exec"}
        assert set(live) - {"periodSeconds", "timeoutSeconds", "failureThreshold"} == {"exec"}
        assert ready["exec"]["command"] == [
            "hostpid", "nri-probe", "--address", f"127.0.0.1:{port}", "--ready"]
        assert live["exec"]["command"] == [
            "hostpid", "nri-probe", "--address", f"127.0.0.1:{port}"]
        assert [p["containerPort"] for p in container["ports"]] != [port]
    assert "overlap" in str(refusal(merge(ON, sets("nri.probePort=9397"))))


def test_a_networkpolicy_admits_the_monitoring_namespace_to_the_metrics_ports() -> None:
    docs = render(merge(ON, sets("networkPolicy.additionalFrom[0].ipBlock.cidr=192.0.2.0/24")))
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"
                 and d["metadata"]["name"] == "hostpid-nri-metrics"]
    labels = plugin_daemonset(docs)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"ipBlock": {"cidr": "192.0.2.0/24"}}]
    names = {p["name"] for c in plugin_daemonset(docs)["spec"]["template"]["spec"]["containers"]
             for p in c["ports"]}
    assert {p["port"] for p in rule["ports"]} == names == {"nri-metrics", "nri-standby"}
    assert not [d for d in render(merge(ON, sets("networkPolicy.enabled=false")))
                if d["kind"] == "NetworkPolicy" and "nri" in d["metadata"]["name"]]
    assert not [d for d in render() if d["kind"] == "NetworkPolicy"
                and "nri" in d["metadata"]["name"]]


@pytest.mark.parametrize("lock_parent", ["/tmp/vgpulock", "/tmp/gpu-locks.2"])
def test_the_plugin_mounts_the_lock_parent_itself(lock_parent: str) -> None:
    """
    The lock parent at its host path, writable, created by kubelet as root's
    on a fresh node; no host path above it, nothing in it but what the
    plugin is told.
    """
    spec = plugin_daemonset(render(merge(ON, sets(f"broker.lockParent={lock_parent}"))))[
        "spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in spec["containers"]:
        args = container["args"]
        assert args[args.index("--lock-parent") + 1] == lock_parent
        writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
        (mount,) = writable
        assert mount["mountPath"] == lock_parent
        assert volumes[mount["name"]]["hostPath"] == {"path": lock_parent,
                                                     "type": "DirectoryOrCreate"}
    host_paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert "/tmp" not in host_paths and all(
        not lock_parent.startswith(path.rstrip("/") + "/") for path in host_paths), host_paths


@pytest.mark.parametrize("lock_parent", [
    "/var/vgpulock", "/tmp/a/vgpulock", "/tmp/..", "/tmp/.", "/tmp", "/tmp/", "/vgpulock",
    "/var/tmp/vgpulock", "/tmp/../etc",
])
def test_a_lock_parent_the_plugin_could_not_check_is_refused(lock_parent: str) -> None:
    message = str(refusal(merge(ON, sets(f"broker.lockParent={lock_parent}"))))
    assert f"broker.lockParent=\"{lock_parent}\" with nri.enabled=true" in message or (
        "broker.lockParent must not be /" in message), message  # the broker's own rule
    # The broker alone still takes it (its preparation walks the host's directories).
    if lock_parent not in ("/tmp", "/tmp/", "/tmp/..", "/tmp/.", "/tmp/../etc"):
        render(sets(f"broker.lockParent={lock_parent}"))


def test_a_lock_parent_outside_tmp_on_the_operators_word() -> None:
    """
    nri.allowLockParentOutsideTmp admits a deeper lock parent (the cluster
    tier's is in its own node root), never one with a "." or ".." component.
    """
    allow = merge(ON, sets("nri.allowLockParentOutsideTmp=true"))
    spec = plugin_daemonset(render(merge(allow, sets("broker.lockParent=/var/lib/gpu/vgpulock"))))[
        "spec"]["template"]["spec"]
    assert {"path": "/var/lib/gpu/vgpulock", "type": "DirectoryOrCreate"} in [
        v["hostPath"] for v in spec["volumes"] if "hostPath" in v]
    for lock_parent in ("/tmp/a/../vgpulock", "/var/./vgpulock", "/var/vgpulock/", "/"):
        message = str(refusal(merge(allow, sets(f"broker.lockParent={lock_parent}"))))
        assert "no \".\" or \"..\" component" in message or "lockParent" in message, message
