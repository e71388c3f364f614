"""
The deployment recipes under C{deploy/}, checked with the real tools and the
real broker.

Why each check exists:

- Kubernetes manifests are validated OFFLINE against the schemas that the
  C{kubernetes-validate} package ships (strict: an unknown field such as a
  mistyped C{hostPid} fails), for pinned Kubernetes versions.  A manifest the
  API server would reject is found here, not during a rollout.
- Schemas cannot express the design's rules (the broker is never enabled
  without the host PID namespace; the workload's broker mount is read-only; the
  broker runs as root; the kubelet's probes are exec C{hostpid probe} on the
  broker socket, never a TCP port a tenant can flood).  L{pod_rule_violations}
  states them, and negative tests prove that it
  flags each broken rule, so a passing check means something.
- The commands the recipes run (the Containerfile's entry point, the
  DaemonSet's container, the systemd unit's C{ExecStart}) are run for real
  from the working tree, with the restrictions their recipes impose (root with
  no capability, C{no_new_privs}, no writable+executable memory), and must serve.
- The systemd unit passes C{systemd-analyze verify} and its offline security
  review.
"""

from __future__ import annotations

import configparser
import copy
import ctypes
import json
import os
import posixpath
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import kubernetes_validate.utils as kubernetes_validate
import pytest
import yaml
from imagelib import containerfile_instructions, copied_sources
from support import (
    REPO,
    TWISTD,
    WAIT_SECONDS,
    DefaultLayout,
    ask_pid,
    require_root,
    require_tool,
    subprocess_env,
    wait_for,
)

from hostpid import defaults
from hostpid.node import cdi

DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DAEMONSET = KUBERNETES / "20-daemonset.yaml"
DAEMONSET_WITHOUT_METRICS = KUBERNETES / "variants" / "20-daemonset-without-metrics.yaml"
WORKLOAD_EXAMPLE = KUBERNETES / "examples" / "workload-pod.yaml"
UNIT = DEPLOY / "systemd" / "hostpid-broker.service"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"

#: Kubernetes versions the manifests must be valid for: the oldest and the
#: newest minor release we claim (both ship with kubernetes-validate 1.37).
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")

GATE = "LIBVGPU_HOSTPID_BROKER"
BROKER_DIRECTORY = defaults.BROKER_DIRECTORY
LOCK_PARENT = "/tmp/vgpulock"
WORKLOAD_BROKER_MOUNT = "/tmp/vgpulock/hostpid"
BROKER_COMMAND = ["twistd", "--nodaemon", "--pidfile=", "hostpid-broker"]
#: Both probes of both DaemonSets (no tenant flood may restart the broker):
#: C{hostpid probe} on the broker socket, skipped while the broker's gate is
#: off (the broker's own rule: only "1" enables), with the probe's own
#: deadline.  No TCP port decides them.
EXEC_PROBE = re.compile(
    r'\[ "\$LIBVGPU_HOSTPID_BROKER" != 1 \] \|\| '
    r"exec hostpid probe --socket (?P<socket>/\S+) --timeout (?P<deadline>[0-9.]+)"
)
#: The readiness probe: the same, and only while this pod's broker holds the
#: listener (its --ready-file exists): during a surge-first update's handover
#: the old broker answers on the same socket.
READY_PROBE = re.compile(
    r'\[ "\$LIBVGPU_HOSTPID_BROKER" != 1 \] \|\| \{ \[ -e (?P<ready>/\S+) \] && '
    r"exec hostpid probe --socket (?P<socket>/\S+) --timeout (?P<deadline>[0-9.]+); \}"
)
#: The smallest CPU request the rules accept: 10m is the smallest CFS weight there
#: is (what the DaemonSet once requested, starved under a flood), and 100m a small pod's.
MIN_CPU_REQUEST_MILLICORES = 100


def exec_probe_deadline(
    probe: Mapping[str, Any] | None, ready_file: str | None = None
) -> float | None:
    """
    The C{--timeout} of an exec C{hostpid probe} on the broker socket (gated
    on C{ready_file} when given), else C{None}.
    """
    if probe is None or set(probe) & {"httpGet", "tcpSocket", "grpc"}:
        return None
    command = probe.get("exec", {}).get("command", [])
    if len(command) != 3 or command[:2] != ["sh", "-c"]:
        return None
    found = (EXEC_PROBE if ready_file is None else READY_PROBE).fullmatch(command[2])
    if found is None or found["socket"] != f"{BROKER_DIRECTORY}/broker.sock":
        return None
    if ready_file is not None and found["ready"] != ready_file:
        return None
    return float(found["deadline"])


def millicores(quantity: object) -> float:
    """A Kubernetes CPU quantity (C{100m}, C{0.5}, C{2}) in millicores."""
    text = str(quantity)
    return float(text[:-1]) if text.endswith("m") else float(text) * 1000


# --- reading the recipes -------------------------------------------------------------


def manifest_files() -> list[Path]:
    """Every Kubernetes manifest we ship, examples included."""
    return sorted(KUBERNETES.rglob("*.yaml"))


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in manifest_files() for doc in load_documents(path)]


def pod_spec(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod spec inside a workload object, or C{None} for other kinds."""
    kind = doc.get("kind")
    spec = doc.get("spec", {})
    if kind == "Pod":
        return spec
    if kind in ("DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"):
        return spec["template"]["spec"]
    if kind == "CronJob":
        return spec["jobTemplate"]["spec"]["template"]["spec"]
    return None


def clean_path(path: str) -> str:
    """
    A container path as the runtime compares it: absolute and normalized.
    (C{posixpath.normpath} keeps a leading C{//}; strip it.)
    """
    return "/" + posixpath.normpath("/" + path).lstrip("/")


def container_argv(container: Mapping[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def is_broker_container(container: Mapping[str, Any]) -> bool:
    """
    Runs the broker: its command line names the twistd plugin, or it keeps the
    image's entry point and the image is the broker's.
    """
    if "hostpid-broker" in container_argv(container):
        return True
    return "command" not in container and "hostpid-broker" in container.get("image", "")


def gate_value(container: Mapping[str, Any]) -> str | None:
    """The literal gate value, C{None} when unset; C{valueFrom} cannot be judged."""
    for var in container.get("env", []):
        if var["name"] == GATE:
            if "value" not in var:
                raise ValueError(f"{GATE} must be a literal value so the rules can be checked")
            return str(var["value"])
    return None


def metrics_port(argv: Sequence[str]) -> int | None:
    """The TCP port of C{--metrics ENDPOINT} (C{tcp:PORT:...} or C{port=PORT})."""
    for option, value in zip(argv, argv[1:], strict=False):
        if option == "--metrics":
            fields = re.split(r"(?<!\\):", value)
            if fields[0] in ("tcp", "tcp6"):
                for field in fields[1:]:
                    if field.isdigit():
                        return int(field)
                    if field.startswith("port="):
                        return int(field.split("=", 1)[1])
    return None


# --- the design's rules ----------------------------------------------------------------


def pod_rule_violations(spec: Mapping[str, Any], where: str) -> list[str]:
    """
    Every way C{spec} breaks the design's deployment rules, as readable lines
    (empty when it keeps them all).

    Broker containers: enabled only with C{hostPID: true} (and given it even
    while the gate is off, so that enabling is a one-variable change); root;
    no capability; the gate set literally; C{--nodaemon --pidfile=}; the broker
    directory from a C{DirectoryOrCreate} hostPath at the same path, writable;
    liveness and readiness exec C{hostpid probe} on the broker socket (no TCP
    port a tenant could flood decides them), each with a kubelet timeout that
    outlasts its deadline; CPU and memory requests, the CPU request a real CFS
    weight, no CPU limit under one core (a quota stalls bursts), a memory
    limit.

    Any container with the broker mount (a workload): read-only, from the
    broker directory, below a writable lock parent listed first.
    """
    problems: list[str] = []
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    host_pid = spec.get("hostPID") is True
    pod_security = spec.get("securityContext", {})

    for container in spec.get("containers", []) + spec.get("initContainers", []):
        name = f"{where}: container {container['name']}"
        mounts = container.get("volumeMounts", [])

        if is_broker_container(container):
            try:
                gate = gate_value(container)
            except ValueError as e:
                problems.append(f"{name}: {e}")
                gate = None
            if gate is None:
                problems.append(f"{name}: the broker container must set {GATE} explicitly")
            if gate == "1" and not host_pid:
                problems.append(
                    f"{name}: the broker is ENABLED without hostPID: true "
                    "(it would report PIDs of the wrong PID namespace, or refuse to start)"
                )
            elif not host_pid:
                problems.append(f"{name}: a broker pod must have hostPID: true")

            security = container.get("securityContext", {})
            user = security.get("runAsUser", pod_security.get("runAsUser"))
            if user != 0:
                problems.append(f"{name}: the broker must run as root (runAsUser: 0), not {user}")
            if security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is True:
                problems.append(f"{name}: runAsNonRoot contradicts the broker's root requirement")
            if security.get("privileged") is True:
                problems.append(f"{name}: the broker needs no privileged mode")
            if security.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{name}: allowPrivilegeEscalation must be false")
            capabilities = security.get("capabilities", {})
            if "ALL" not in capabilities.get("drop", []) or capabilities.get("add"):
                problems.append(f"{name}: the broker needs no capability: drop ALL, add none")

            argv = container_argv(container)
            if argv and ("--nodaemon" not in argv or "--pidfile=" not in argv):
                problems.append(f"{name}: run twistd with --nodaemon --pidfile=")

            broker_mounts = [m for m in mounts if clean_path(m["mountPath"]) == BROKER_DIRECTORY]
            if len(broker_mounts) != 1:
                problems.append(f"{name}: mount the broker directory at {BROKER_DIRECTORY}")
            for mount in broker_mounts:
                if mount.get("readOnly"):
                    problems.append(f"{name}: the broker's own directory mount must be writable")
                host_path = volumes.get(mount["name"], {}).get("hostPath")
                if host_path is None or clean_path(host_path["path"]) != BROKER_DIRECTORY:
                    problems.append(f"{name}: {BROKER_DIRECTORY} must be the host's directory")
                elif host_path.get("type") != "DirectoryOrCreate":
                    problems.append(
                        f"{name}: the broker directory hostPath type must be DirectoryOrCreate, "
                        f"not {host_path.get('type')}"
                    )

            port = metrics_port(argv)
            declared = {p.get("containerPort") for p in container.get("ports", [])}
            if "--metrics" in argv and (port is None or port not in declared):
                problems.append(f"{name}: --metrics must listen on a declared containerPort")
            for kind in ("livenessProbe", "readinessProbe"):
                probe = container.get(kind)
                # Readiness: only while this pod's broker holds the listener.
                ready_file = None
                pattern = EXEC_PROBE
                if kind == "readinessProbe":
                    ready_file = option_value(argv, "--ready-file") or "(no --ready-file)"
                    pattern = READY_PROBE
                deadline = exec_probe_deadline(probe, ready_file)
                if probe is None or deadline is None:
                    problems.append(
                        f"{name}: {kind} must be exec sh -c '{pattern.pattern}' on "
                        f"{BROKER_DIRECTORY}/broker.sock"
                    )
                elif probe.get("timeoutSeconds", 1) < deadline + 1:
                    problems.append(
                        f"{name}: {kind} timeoutSeconds must outlast the probe's --timeout "
                        f"{deadline:g} by 1 s"
                    )

            resources = container.get("resources", {})
            requests, limits = resources.get("requests", {}), resources.get("limits", {})
            if not {"cpu", "memory"} <= set(requests):
                problems.append(f"{name}: set resources.requests for cpu and memory")
            elif millicores(requests["cpu"]) < MIN_CPU_REQUEST_MILLICORES:
                problems.append(
                    f"{name}: resources.requests.cpu {requests['cpu']} is below "
                    f"{MIN_CPU_REQUEST_MILLICORES}m: no real CFS weight on a busy node"
                )
            if "memory" not in limits:
                problems.append(f"{name}: set resources.limits.memory")
            if "cpu" in limits and millicores(limits["cpu"]) < 1000:
                problems.append(
                    f"{name}: resources.limits.cpu {limits['cpu']} is a CFS quota that stalls a "
                    "burst for the rest of its period: none, or at least 1"
                )

            problems += cdi_rule_violations(name, argv, mounts, volumes)

        paths = [clean_path(m["mountPath"]) for m in mounts]
        for index, mount in enumerate(mounts):
            if paths[index] != WORKLOAD_BROKER_MOUNT:
                continue
            if mount.get("readOnly") is not True:
                problems.append(
                    f"{name}: the workload's broker mount {WORKLOAD_BROKER_MOUNT} must be "
                    "readOnly: true"
                )
            host_path = volumes.get(mount["name"], {}).get("hostPath")
            if host_path is None or clean_path(host_path["path"]) != BROKER_DIRECTORY:
                problems.append(
                    f"{name}: {WORKLOAD_BROKER_MOUNT} must come from {BROKER_DIRECTORY}"
                )
            parents = [i for i, path in enumerate(paths) if path == LOCK_PARENT]
            if not parents or parents[0] > index or mounts[parents[0]].get("readOnly"):
                problems.append(
                    f"{name}: a writable {LOCK_PARENT} mount must be listed before the broker mount"
                )
    return problems


def option_value(argv: Sequence[str], option: str) -> str | None:
    """The value of C{option VALUE} or C{option=VALUE} in C{argv}, if given."""
    for index, word in enumerate(argv):
        if word == option and index + 1 < len(argv):
            return argv[index + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def host_mount(mounts: Sequence[Mapping[str, Any]], volumes: Mapping[str, Any], path: str
               ) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """The container's mount at C{path} and its hostPath, if it is one."""
    for mount in mounts:
        if clean_path(mount["mountPath"]) == clean_path(path):
            host_path = volumes.get(mount["name"], {}).get("hostPath")
            if host_path is not None:
                return mount, host_path
    return None


def cdi_rule_violations(name: str, argv: Sequence[str], mounts: Sequence[Mapping[str, Any]],
                        volumes: Mapping[str, Any]) -> list[str]:
    """
    With C{--cdi-dir}: the spec directory is the host's, at the same path and
    writable (the runtime reads the host's); the lock parent's parent is the
    host's too, at the same path and writable, so that the lock parent the
    broker prepares, and that the spec names, is a host path; and it is not
    a hostPath of the lock parent itself (kubelet would follow a symlink
    planted there, where the broker's descriptor walk refuses it).
    """
    cdi_dir = option_value(argv, "--cdi-dir")
    if cdi_dir is None:
        return []
    problems = []
    lock_parent = option_value(argv, "--lock-parent") or LOCK_PARENT
    for what, path in (("--cdi-dir", cdi_dir), ("the lock parent's parent",
                                                 posixpath.dirname(clean_path(lock_parent)))):
        found = host_mount(mounts, volumes, path)
        if found is None:
            problems.append(f"{name}: {what} {path} must be mounted from the host's {path}")
            continue
        mount, host_path = found
        if clean_path(host_path["path"]) != clean_path(path):
            problems.append(f"{name}: {what} {path} must be the host's {path}, not "
                            f"{host_path['path']}")
        if mount.get("readOnly"):
            problems.append(f"{name}: {what} {path} must be writable")
        if mount.get("mountPropagation", "None") != "None":
            # The host's whole /tmp (or spec directory): no mount made under it on
            # the host may reach the broker, and none of the broker's may reach the
            # host (docs/security.md, "The broker's mounts").
            problems.append(f"{name}: {what} {path} must have mountPropagation None, not "
                            f"{mount['mountPropagation']}")
    if host_mount(mounts, volumes, lock_parent) is not None:
        problems.append(f"{name}: do not mount the lock parent {lock_parent} itself; mount "
                        "its parent")
    return problems


def all_violations(documents: Sequence[tuple[Path, Mapping[str, Any]]]) -> list[str]:
    problems: list[str] = []
    for path, doc in documents:
        spec = pod_spec(doc)
        if spec is not None:
            where = f"{path.relative_to(REPO)}: {doc['kind']}/{doc['metadata']['name']}"
            problems += pod_rule_violations(spec, where)
    return problems


def daemonset(path: Path = DAEMONSET) -> dict[str, Any]:
    (doc,) = load_documents(path)
    assert doc["kind"] == "DaemonSet"
    return doc


def broker_container(doc: Mapping[str, Any]) -> dict[str, Any]:
    spec = pod_spec(doc)
    assert spec is not None
    (container,) = [c for c in spec["containers"] if is_broker_container(c)]
    return container


def set_gate(doc: dict[str, Any], value: str) -> dict[str, Any]:
    """A copy of C{doc} with the broker's gate set, as C{kubectl set env} would."""
    doc = copy.deepcopy(doc)
    for var in broker_container(doc)["env"]:
        if var["name"] == GATE:
            var["value"] = value
    return doc


# --- Kubernetes: schemas ---------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    documents = all_documents()
    kinds = sorted(doc["kind"] for _, doc in documents)
    assert kinds == [
        "DaemonSet", "DaemonSet", "Namespace", "NetworkPolicy", "Pod", "ServiceAccount"
    ]
    for path, doc in documents:
        validated = kubernetes_validate.validate(doc, version, strict=True)
        assert validated == version.rsplit(".", 1)[0], (path, "validated against another version")


def network_policy() -> dict[str, Any]:
    (doc,) = load_documents(KUBERNETES / "30-networkpolicy.yaml")
    assert doc["kind"] == "NetworkPolicy"
    return doc


def test_metrics_port_is_admitted_only_from_the_monitoring_namespace() -> None:
    """
    The metrics server shares the broker's process (docs/operations.md): the
    NetworkPolicy selects the broker's pods, restricts ingress, and admits
    only the monitoring namespace, only on the --metrics port.
    """
    policy = network_policy()
    ds = daemonset()
    container = broker_container(ds)
    assert policy["metadata"]["namespace"] == ds["metadata"]["namespace"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items(), "it selects the broker's pods"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    assert source == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    (port,) = rule["ports"]
    declared = {p["name"]: p["containerPort"] for p in container["ports"]}
    number = declared.get(port["port"], port["port"])
    assert port["protocol"] == "TCP"
    assert number == metrics_port(container_argv(container)), "the --metrics port, and only it"


def test_schema_validation_rejects_an_unknown_field() -> None:
    """Strict mode is on: a mistyped field fails instead of being ignored."""
    doc = daemonset()
    spec = pod_spec(doc)
    assert spec is not None
    spec["hostPid"] = spec.pop("hostPID")
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)


# --- Kubernetes: the design's rules ----------------------------------------------------


def test_shipped_manifests_keep_the_rules() -> None:
    documents = all_documents()
    assert all_violations(documents) == []
    containers = [c for _, doc in documents if (s := pod_spec(doc)) for c in s["containers"]]
    assert sum(map(is_broker_container, containers)) == 2, "the checker found both brokers"
    workload_mounts = [
        m for c in containers for m in c.get("volumeMounts", [])
        if clean_path(m["mountPath"]) == WORKLOAD_BROKER_MOUNT
    ]
    assert len(workload_mounts) == 1, "the checker found the workload's broker mount"


def test_daemonset_ships_with_the_gate_off_and_keeps_the_rules_when_enabled() -> None:
    """Installed everywhere with the gate off, then enabled (docs/rollout.md)."""
    doc = daemonset()
    assert gate_value(broker_container(doc)) == "0"
    assert all_violations([(DAEMONSET, set_gate(doc, "1"))]) == []


def test_daemonset_keeps_the_cdi_spec_in_the_hosts_runtime_directory() -> None:
    """The broker rewrites /var/run/cdi/hami.io-hostpid.json at every start."""
    argv = container_argv(broker_container(daemonset()))
    assert option_value(argv, "--cdi-dir") == "/var/run/cdi"
    assert option_value(argv, "--lock-parent") == LOCK_PARENT


def _mutate(doc: dict[str, Any], change: Callable[[dict[str, Any], dict[str, Any]], None]) -> dict:
    doc = copy.deepcopy(doc)
    spec = pod_spec(doc)
    assert spec is not None
    change(spec, spec["containers"][0])
    return doc


def _set(container: dict[str, Any], dotted: str, value: object) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        container = container.setdefault(key, {})
    container[last] = value


BROKEN_DAEMONSETS: dict[str, tuple[Callable[[dict, dict], None], str]] = {
    "enabled without hostPID": (
        lambda spec, c: spec.update(hostPID=False), "ENABLED without hostPID"),
    "hostPID missing": (
        lambda spec, c: spec.pop("hostPID"), "ENABLED without hostPID"),
    "not root": (
        lambda spec, c: _set(c, "securityContext.runAsUser", 1000), "must run as root"),
    "runAsNonRoot": (
        lambda spec, c: _set(c, "securityContext.runAsNonRoot", True), "runAsNonRoot"),
    "a capability added": (
        lambda spec, c: _set(c, "securityContext.capabilities.add", ["DAC_OVERRIDE"]),
        "needs no capability"),
    "hostPath type Directory": (
        lambda spec, c: spec["volumes"][0]["hostPath"].update(type="Directory"),
        "must be DirectoryOrCreate"),
    "broker directory read-only": (
        lambda spec, c: c["volumeMounts"][0].update(readOnly=True), "must be writable"),
    "liveness over the metrics port (the old probe)": (
        lambda spec, c: c.update(livenessProbe={"httpGet": {"path": "/healthz",
                                                            "port": "metrics"}}),
        "livenessProbe must be exec"),
    "readiness over the metrics port": (
        lambda spec, c: c.update(readinessProbe={"httpGet": {"path": "/readyz",
                                                             "port": "metrics"}}),
        "readinessProbe must be exec"),
    "liveness missing": (
        lambda spec, c: c.pop("livenessProbe"), "livenessProbe must be exec"),
    "probe on another socket": (
        lambda spec, c: c["livenessProbe"]["exec"]["command"].__setitem__(
            2, c["livenessProbe"]["exec"]["command"][2].replace(
                "hostpid/broker.sock", "other/broker.sock")),
        "livenessProbe must be exec"),
    "probe timeout shorter than its deadline": (
        lambda spec, c: _set(c, "livenessProbe.timeoutSeconds", 3),
        "livenessProbe timeoutSeconds must outlast the probe's --timeout 3"),
    "the smallest CFS weight": (
        lambda spec, c: _set(c, "resources.requests.cpu", "10m"), "no real CFS weight"),
    "a tight CPU limit": (
        lambda spec, c: _set(c, "resources.limits.cpu", "500m"), "stalls a burst"),
    "gate unset": (
        lambda spec, c: c.pop("env"), "must set LIBVGPU_HOSTPID_BROKER explicitly"),
    "stale pidfile possible": (
        lambda spec, c: c["command"].remove("--pidfile="), "--nodaemon --pidfile="),
    "no memory limit": (
        lambda spec, c: c["resources"].pop("limits"), "resources.limits.memory"),
    "cdi dir not mounted": (
        lambda spec, c: _drop_mount(c, "/var/run/cdi"), "--cdi-dir /var/run/cdi must be mounted"),
    "cdi dir from another host path": (
        lambda spec, c: _volume(spec, c, "/var/run/cdi").update(path="/etc/cdi"),
        "must be the host's /var/run/cdi, not /etc/cdi"),
    "cdi dir read-only": (
        lambda spec, c: _mount(c, "/var/run/cdi").update(readOnly=True),
        "--cdi-dir /var/run/cdi must be writable"),
    "lock parent's parent not mounted": (
        lambda spec, c: _drop_mount(c, "/tmp"), "the lock parent's parent /tmp must be mounted"),
    "lock parent's parent propagating host mounts": (
        lambda spec, c: _mount(c, "/tmp").update(mountPropagation="HostToContainer"),
        "the lock parent's parent /tmp must have mountPropagation None"),
    "lock parent mounted itself": (
        lambda spec, c: _mount(c, "/tmp").update(mountPath="/tmp/vgpulock"),
        "do not mount the lock parent"),
}


def _mount(container: dict[str, Any], path: str) -> dict[str, Any]:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    return mount


def _drop_mount(container: dict[str, Any], path: str) -> None:
    container["volumeMounts"].remove(_mount(container, path))


def _volume(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    name = _mount(container, path)["name"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == name]
    host_path: dict[str, Any] = volume["hostPath"]
    return host_path


def without_metrics(doc: Mapping[str, Any]) -> dict[str, Any]:
    """
    What C{variants/20-daemonset-without-metrics.yaml} must be: the DaemonSet
    with no C{--metrics}, no port, no scrape annotations (the probes are the
    same exec probes).
    """
    doc = copy.deepcopy(dict(doc))
    template = doc["spec"]["template"]
    template["metadata"].pop("annotations")
    container = broker_container(doc)
    container.pop("ports")
    args = container["args"]
    index = args.index("--metrics")
    del args[index : index + 2]
    if not args:
        container.pop("args")
    return doc


def test_the_variant_without_metrics_is_the_daemonset_without_its_port() -> None:
    """Two files, one DaemonSet: the variant cannot drift from the shipped one."""
    assert daemonset(DAEMONSET_WITHOUT_METRICS) == without_metrics(daemonset())
    variant = set_gate(daemonset(DAEMONSET_WITHOUT_METRICS), "1")
    assert all_violations([(DAEMONSET_WITHOUT_METRICS, variant)]) == []


def test_rule_checker_flags_a_variant_probe_that_is_not_hostpid_probe() -> None:
    variant = set_gate(daemonset(DAEMONSET_WITHOUT_METRICS), "1")
    broker_container(variant)["livenessProbe"]["exec"]["command"] = ["true"]
    problems = all_violations([(DAEMONSET_WITHOUT_METRICS, variant)])
    assert any("livenessProbe must be exec" in problem for problem in problems), problems


@pytest.mark.parametrize("case", sorted(BROKEN_DAEMONSETS))
def test_rule_checker_flags_a_broken_daemonset(case: str) -> None:
    """Each rule can fail: a copy of the enabled DaemonSet broken one way is flagged."""
    change, expected = BROKEN_DAEMONSETS[case]
    broken = _mutate(set_gate(daemonset(), "1"), change)
    problems = all_violations([(DAEMONSET, broken)])
    assert any(expected in problem for problem in problems), problems


def test_rule_checker_flags_a_writable_workload_broker_mount() -> None:
    (doc,) = load_documents(WORKLOAD_EXAMPLE)
    for mount in doc["spec"]["containers"][0]["volumeMounts"]:
        if clean_path(mount["mountPath"]) == WORKLOAD_BROKER_MOUNT:
            mount["readOnly"] = False
            mount["mountPath"] = "/tmp/vgpulock/hostpid/"  # an equivalent spelling
    problems = all_violations([(WORKLOAD_EXAMPLE, doc)])
    assert any("must be readOnly: true" in problem for problem in problems), problems


def test_workload_example_is_what_hostpid_allocate_produces(tmp_path: Path) -> None:
    """
    The example Pod spells out the allocation response: run the real
    C{hostpid allocate} (gate on) and compare mount by mount, in order.
    """
    require_root()  # the lock parent it prepares must be root's
    host_tmp = tmp_path / "host-tmp"
    host_tmp.mkdir(mode=0o755)
    host_tmp.chmod(0o755)
    lock_parent = host_tmp / "vgpulock"
    result = subprocess.run(
        [sys.executable, "-m", "hostpid.cli", "allocate", "--lock-parent", str(lock_parent)],
        input=json.dumps({"envs": {}, "mounts": [], "devices": []}),
        env=subprocess_env({GATE: "1"}),
        capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir(),
    )
    assert result.returncode == 0, result.stderr
    response = json.loads(result.stdout)

    (pod,) = load_documents(WORKLOAD_EXAMPLE)
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"]}
    example = [
        (m["mountPath"], volumes[m["name"]], bool(m.get("readOnly")))
        for m in container["volumeMounts"]
    ]
    allocated = [
        (m["containerPath"], m["hostPath"], m["readOnly"]) for m in response["mounts"]
    ]
    # The test prepared its own lock parent; the default is /tmp/vgpulock.
    allocated = [
        (path, LOCK_PARENT if host == str(lock_parent) else host, ro)
        for path, host, ro in allocated
    ]
    assert example == allocated
    assert {v["name"]: v["value"] for v in container["env"]} == response["envs"]


# --- running the recipes' commands -----------------------------------------------------

#: Runs its arguments with no writable+executable memory (the kernel's
#: PR_SET_MDWE, what systemd's MemoryDenyWriteExecute= enforces with seccomp)
#: and umask 077 (the unit's UMask=), both kept across exec.
_LAUNCHER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    sys.exit("PR_SET_MDWE: " + os.strerror(ctypes.get_errno()))
os.umask(0o077)
os.execvp(sys.argv[1], sys.argv[1:])
"""


def mdwe_supported() -> bool:
    """PR_SET_MDWE exists from Linux 6.3."""
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(66, 0, 0, 0, 0) >= 0)  # PR_GET_MDWE


def restricted_prefix() -> list[str]:
    """
    Root with what the recipes leave it: no capability in any set, and
    no_new_privs (the pod's C{capabilities: drop: [ALL]} and
    C{allowPrivilegeEscalation: false}; the unit's C{CapabilityBoundingSet=}
    and C{NoNewPrivileges=yes}); plus no W+X memory where the kernel can
    enforce it (the unit's C{MemoryDenyWriteExecute=yes}).
    """
    require_root()
    setpriv = require_tool("setpriv")
    prefix = [setpriv, "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all",
              "--ambient-caps=-all", "--"]
    if mdwe_supported():
        prefix = [sys.executable, "-c", _LAUNCHER, *prefix]
    return prefix


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http_get(port: int, path: str) -> tuple[int, str]:
    """One real HTTP GET on loopback: the status and body, 503 included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def http_up(port: int, path: str = "/healthz") -> bool:
    try:
        return http_get(port, path)[0] == 200
    except OSError:
        return False


class Command:
    """A recipe's command line in its own process; output kept in a file."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
        )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"exited {self.process.returncode}:\n{self.output()}")
        return True

    def status_field(self, field: str) -> str:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
        raise AssertionError(f"no {field} in /proc/{self.process.pid}/status")

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"did not stop on SIGTERM:\n{self.output()}") from None


@contextmanager
def running(argv: Sequence[str], env: Mapping[str, str]) -> Iterator[Command]:
    command = Command(argv, env)
    try:
        yield command
    finally:
        if command.process.poll() is None:
            command.process.kill()
            command.process.wait()
        command.log.close()


def from_working_tree(argv: Sequence[str]) -> list[str]:
    """C{argv} with C{twistd} run by this interpreter from the working tree."""
    assert argv[0].rsplit("/", 1)[-1] == "twistd", argv
    return [*TWISTD, *argv[1:]]


def with_option(argv: Sequence[str], option: str, value: str) -> list[str]:
    """C{argv} with C{option}'s value replaced (it must be given once)."""
    out = list(argv)
    assert out.count(option) == 1, (option, out)
    out[out.index(option) + 1] = value
    return out


def with_metrics_port(argv: Sequence[str], port: int) -> list[str]:
    """C{argv} with its C{--metrics} endpoint moved to C{port} on loopback."""
    out = list(argv)
    index = out.index("--metrics") + 1
    out[index] = f"tcp:{port}:interface=127.0.0.1"
    return out


def assert_broker_files(directory: Path) -> None:
    """The modes workloads' clients require, whatever umask the recipe sets."""
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o711
    assert stat.S_IMODE(os.lstat(directory / "broker.sock").st_mode) == 0o666
    assert stat.S_IMODE(os.lstat(directory / "broker.lock").st_mode) == 0o600
    for name in ("", "broker.sock", "broker.lock"):
        assert os.lstat(directory / name).st_uid == 0


# --- the container image ---------------------------------------------------------------


def exec_form(arguments: str) -> list[str]:
    """An ENTRYPOINT/CMD in JSON exec form (the shell form would wrap signals)."""
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def containerfile_command() -> tuple[list[str], dict[str, str]]:
    """The argv the image runs (ENTRYPOINT + CMD) and the environment it sets."""
    entrypoint: list[str] = []
    cmd: list[str] = []
    env: dict[str, str] = {}
    for keyword, arguments in containerfile_instructions(CONTAINERFILE):
        if keyword == "ENTRYPOINT":
            entrypoint = exec_form(arguments)
        elif keyword == "CMD":
            cmd = exec_form(arguments)
        elif keyword == "ENV":
            for pair in shlex.split(arguments):
                name, _, value = pair.partition("=")
                env[name] = value
    return [*entrypoint, *cmd], env


def test_containerfile_runs_the_broker_from_a_base_named_by_build_arguments() -> None:
    """
    The image runs the broker as the DaemonSet states it, as root; its two
    bases are build arguments whose defaults are the public Python image
    (an air-gapped build names its own: docs/image.md), the runtime one the
    slim variant, with no compiler.  That it builds and serves is
    tests/e2e/test_image.py's real build.
    """
    instructions = containerfile_instructions(CONTAINERFILE)
    arguments = dict(args.partition("=")[::2] for keyword, args in instructions
                     if keyword == "ARG")
    assert arguments["BASE"].startswith("docker.io/library/python:3.11-")
    assert "slim" in arguments["BASE"], "no compiler in the image"
    assert arguments["BUILD_BASE"].startswith("docker.io/library/python:3.11-")
    bases = [args for keyword, args in instructions if keyword == "FROM"]
    assert bases == ["${BUILD_BASE} AS build", "${BASE}"]
    argv, env = containerfile_command()
    assert argv == BROKER_COMMAND
    assert env["PATH"].startswith("/opt/hostpid/venv/bin:"), "the virtual environment's twistd"
    assert not any(k == "USER" for k, _ in instructions), "the broker must run as root"
    # --metrics needs prometheus-client: a dependency of the package itself.
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert "prometheus-client" in setup["options"]["install_requires"].split()
    # The DaemonSet states the same command explicitly.
    assert broker_container(daemonset())["command"] == argv


def test_containerfile_copies_what_the_wheel_is_built_from(tmp_path: Path) -> None:
    """
    The build context as the Containerfile's build stage sees it (exactly
    what its COPY lines name, nothing else) builds the package's wheel,
    with the C helper where a compiler is: the same C{pip wheel} as the
    image's first stage, here without the network (no dependencies, this
    environment's setuptools).  Copying too little fails here in seconds
    (C{setup.cfg} names a script, a license file, a long description),
    before the privileged image build would.
    """
    context = tmp_path / "context"
    context.mkdir()
    for source in copied_sources(CONTAINERFILE):
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(origin, context / source,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            shutil.copy2(origin, context / source)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("hostpid_broker-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith(".data/scripts/hostpid") for name in names), names
    assert "twisted/plugins/hostpid_broker.py" in names
    if shutil.which("cc") and sysconfig.get_config_var("INCLUDEPY") and os.path.isfile(
            os.path.join(sysconfig.get_config_var("INCLUDEPY"), "Python.h")):
        assert any(name.startswith("_hostpid_native.") for name in names), names


def test_containerfile_command_exists() -> None:
    """
    C{twistd} is a console script of the Twisted distribution (so C{pip
    install} puts it on the image's PATH), and it finds the C{hostpid-broker}
    plugin.
    """
    argv, _ = containerfile_command()
    scripts = entry_points(group="console_scripts", name=argv[0])
    assert [script.dist.name.lower() for script in scripts if script.dist] == ["twisted"]
    result = subprocess.run(
        from_working_tree([*argv, "--help"]), env=subprocess_env(),
        capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir(),
    )
    assert result.returncode == 0, result.stderr
    assert "--max-connections" in result.stdout and "--metrics" in result.stdout


@pytest.mark.parametrize("gate", ["1", None])
def test_containerfile_command_starts(tmp_path: Path, gate: str | None) -> None:
    """The image's command line, as the image runs it, serves (gate "1") or says disabled."""
    argv, image_env = containerfile_command()
    # The image's PATH names its own virtual environment; here the working tree's runs.
    image_env.pop("PATH", None)
    directory = tmp_path / "broker"
    env = subprocess_env(image_env)
    env.pop(GATE, None)
    if gate is not None:
        env[GATE] = gate
    with running(from_working_tree([*argv, "--directory", str(directory)]), env) as broker:
        if gate == "1":
            wait_for(
                lambda: broker.alive() and ask_pid(directory / "broker.sock") == os.getpid(),
                "the broker to answer with this process's PID",
            )
        else:
            wait_for(lambda: broker.alive() and "disabled" in broker.output(), "disabled")
            assert not directory.exists()
        assert broker.terminate() == -signal.SIGTERM, broker.output()
    assert not (directory / "broker.sock").exists()


# --- the DaemonSet's container, run as its securityContext says ------------------------


def probe_commands(container: Mapping[str, Any]) -> dict[str, list[str]]:
    """The container's exec probes, by kind, as the kubelet runs them."""
    return {kind: list(container[kind]["exec"]["command"])
            for kind in ("livenessProbe", "readinessProbe")}


def run_daemonset_container(doc: Mapping[str, Any]) -> None:
    """
    Run the broker container of the DaemonSet C{doc} as its securityContext
    says, and its exec probes as the kubelet does, in a private mount
    namespace whose C{/run} and C{/tmp} are fresh tmpfs mounts (the hostPaths
    at their own paths: the broker directory as kubelet's C{DirectoryOrCreate}
    makes it, root 0755, holding a previous broker's stale socket and lock;
    the CDI directory; the host's C{/tmp}): root with every capability dropped
    and no_new_privs.  It starts; both probes pass while it serves (gate "1")
    or is disabled (gate "0": skipped, a disabled broker serves nothing);
    with C{--cdi-dir}, even disabled, it prepared the lock parent and wrote
    the spec for its gate; with C{--metrics}, C{/readyz} still answers
    scrapers; and once a gate-on broker is gone its probes fail.
    """
    hostpid_script = Path(sys.executable).parent / "hostpid"
    assert hostpid_script.exists(), "the hostpid console script of this environment"
    container = broker_container(doc)
    gate = gate_value(container)
    env = subprocess_env({var["name"]: var["value"] for var in container["env"]})
    env["PATH"] = f"{hostpid_script.parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    probes = probe_commands(container)
    argv = container_argv(container)
    port = None
    if "--metrics" in argv:
        port = free_tcp_port()
        argv = with_metrics_port(argv, port)
    cdi_dir = option_value(argv, "--cdi-dir")
    lock_parent = option_value(argv, "--lock-parent") or LOCK_PARENT

    with DefaultLayout() as layout:
        prefix = [*layout.prefix, *restricted_prefix()]
        directory = layout.seen_from_here(BROKER_DIRECTORY)
        directory.mkdir(parents=True, mode=0o755)
        directory.chmod(0o755)
        stale_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale_socket.bind(str(directory / "broker.sock"))
        stale_socket.close()
        (directory / "broker.lock").touch(mode=0o600)
        if cdi_dir is not None:
            layout.seen_from_here(cdi_dir).mkdir(parents=True, mode=0o755, exist_ok=True)
        # The pod's own emptyDirs (the ready file's): empty directories, as kubelet makes them.
        empty = {v["name"] for v in doc["spec"]["template"]["spec"]["volumes"] if "emptyDir" in v}
        for mount in container["volumeMounts"]:
            if mount["name"] in empty:
                layout.seen_from_here(mount["mountPath"]).mkdir(parents=True, exist_ok=True)

        def run_probe(kind: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*prefix, *probes[kind]], env=env, capture_output=True, text=True,
                timeout=container[kind]["timeoutSeconds"] + WAIT_SECONDS,
                cwd=tempfile.gettempdir(),
            )

        with running([*prefix, *from_working_tree(argv)], env) as broker:
            if gate == "1":
                seen = layout.seen_from_here(f"{BROKER_DIRECTORY}/broker.sock")
                wait_for(lambda: broker.alive() and ask_pid(seen) == os.getpid(), "serving")
                assert_broker_files(directory)
            else:
                wait_for(lambda: broker.alive() and "disabled" in broker.output(), "disabled")
            assert broker.status_field("CapEff") == "0" * 16
            assert broker.status_field("CapBnd") == "0" * 16
            assert broker.status_field("NoNewPrivs") == "1"
            for kind in probes:
                healthy = run_probe(kind)
                assert healthy.returncode == 0, (kind, healthy.stderr)
                if gate == "1":
                    assert re.fullmatch(
                        rf"{BROKER_DIRECTORY}/broker.sock: ok: answered PID \d+ "
                        r"\(this process\); socket, uid 0, mode 0666; gate here: "
                        r"LIBVGPU_HOSTPID_BROKER='1'\n",
                        healthy.stdout,
                    ), healthy.stdout
                else:
                    assert healthy.stdout == "", "skipped: a disabled broker serves nothing"
            if cdi_dir is not None:
                # Even with the gate off: the lock parent and the spec for this gate.
                spec = json.loads(layout.seen_from_here(
                    f"{cdi_dir}/hami.io-hostpid.json").read_text())
                assert spec == cdi.build_spec(broker_enabled=gate == "1",
                                              lock_parent=lock_parent,
                                              broker_directory=BROKER_DIRECTORY)
                prepared = os.lstat(layout.seen_from_here(lock_parent))
                assert (prepared.st_uid, stat.S_IMODE(prepared.st_mode)) == (0, 0o1777)
            if port is not None:
                status, body = http_get(port, "/readyz")
                assert status == 200, body
                assert ("listening" if gate == "1" else "disabled") in body
            assert broker.terminate() == -signal.SIGTERM, broker.output()
        for kind in probes:
            after = run_probe(kind)
            if gate == "1" and kind == "readinessProbe":
                # The broker removed its ready file at its stop: not ready, at once.
                assert after.returncode == 1 and after.stderr == "", (kind, after.stderr)
            elif gate == "1":
                assert after.returncode == 1, (kind, after.stdout)
                assert after.stderr == (
                    f"hostpid probe: socket check failed: {BROKER_DIRECTORY}/broker.sock: "
                    "cannot lstat: ENOENT (No such file or directory)\n"
                ), kind
            else:
                assert after.returncode == 0, (kind, after.stderr)


@pytest.mark.parametrize("gate", ["0", "1"])
@pytest.mark.parametrize("path", [DAEMONSET, DAEMONSET_WITHOUT_METRICS],
                         ids=["daemonset", "without-metrics"])
def test_daemonset_container_and_its_probes_as_root_without_capabilities(
    path: Path, gate: str
) -> None:
    """
    Each shipped DaemonSet (with the gate as shipped, then enabled), run by
    L{run_daemonset_container}.
    """
    run_daemonset_container(set_gate(daemonset(path), gate))


def test_the_probes_fail_on_a_socket_that_listens_but_never_answers() -> None:
    """
    Readiness is the broker answering, not its socket listening: a
    root-owned socket at the broker's path that accepts connections into its
    queue and never answers (what a stalled broker looks like from outside,
    while its HTTP server may still say 200) fails both exec probes, each at
    its own deadline and well inside its kubelet timeout.
    """
    container = broker_container(set_gate(daemonset(), "1"))
    hostpid_script = Path(sys.executable).parent / "hostpid"
    env = subprocess_env({var["name"]: var["value"] for var in container["env"]})
    env["PATH"] = f"{hostpid_script.parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    with DefaultLayout() as layout:
        directory = layout.seen_from_here(BROKER_DIRECTORY)
        directory.mkdir(parents=True, mode=0o711)
        directory.chmod(0o711)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.bind(str(directory / "broker.sock"))
            os.chmod(directory / "broker.sock", 0o666)
            silent.listen(64)
            # As if this pod's broker held the listener (its ready file exists).
            ready = option_value(container_argv(container), "--ready-file")
            assert ready is not None
            layout.seen_from_here(os.path.dirname(ready)).mkdir(parents=True, exist_ok=True)
            layout.seen_from_here(ready).touch()
            for kind, command in probe_commands(container).items():
                deadline = exec_probe_deadline(
                    container[kind], ready if kind == "readinessProbe" else None
                )
                assert deadline is not None
                started = time.monotonic()
                done = subprocess.run(
                    [*layout.prefix, *command], env=env, capture_output=True, text=True,
                    timeout=container[kind]["timeoutSeconds"] + WAIT_SECONDS,
                    cwd=tempfile.gettempdir(),
                )
                took = time.monotonic() - started
                assert done.returncode == 1, (kind, done.stdout)
                assert done.stderr == (
                    f"hostpid probe: deadline check failed: {BROKER_DIRECTORY}/broker.sock: "
                    f"{deadline:g} s passed waiting for the reply (0 of 12 bytes)\n"
                ), kind
                assert deadline <= took < container[kind]["timeoutSeconds"], (kind, took)


# --- the systemd unit ------------------------------------------------------------------


def unit_entries() -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order (keys may repeat)."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def unit_values(key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in unit_entries() if s == section and k == key]


def unit_value(key: str, section: str = "Service") -> str:
    values = unit_values(key, section)
    assert len(values) == 1, f"{key}= must be set once in [{section}], found {values}"
    return values[0]


def unit_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for value in unit_values("Environment"):
        for pair in shlex.split(value):
            name, _, setting = pair.partition("=")
            env[name] = setting
    return env


def test_unit_states_what_the_broker_needs() -> None:
    assert unit_value("Type") == "notify", "READY=1 once listening"
    assert unit_value("NotifyAccess") == "main"
    argv = shlex.split(unit_value("ExecStart"))
    assert argv[0] == "/opt/hostpid/venv/bin/twistd", "the documented install's environment"
    assert argv[1:4] == ["--nodaemon", "--pidfile=", "hostpid-broker"]
    assert metrics_port(argv) is not None
    assert unit_environment()[GATE] == "1"
    assert unit_value("Restart") == "on-failure"
    # A real share of a busy node's CPU (more than a default service's weight,
    # 100, not so much that tenants could take system.slice's CPU through the broker),
    # and no quota that would stall a burst.
    assert 100 < int(unit_value("CPUWeight")) <= 500
    assert -10 <= int(unit_value("Nice")) < 0
    assert unit_values("CPUQuota") == []
    # Nothing but the broker's own exit restarts it: no watchdog a flood could starve.
    assert unit_values("WatchdogSec") == []
    # The broker directory: root's, 0711, kept across stops so workloads' bind mounts of
    # it stay valid.
    assert unit_value("RuntimeDirectory") == "hami/hostpid"
    assert unit_value("RuntimeDirectoryMode") == "0711"
    assert unit_value("RuntimeDirectoryPreserve") == "yes"
    assert int(unit_value("LimitNOFILE")) > 2 * defaults.MAX_CONNECTIONS
    # Root, with nothing root brings.
    assert unit_value("CapabilityBoundingSet") == ""
    assert unit_value("NoNewPrivileges") == "yes"
    assert unit_value("ProtectSystem") == "strict"
    # The host's /tmp, read-only under ProtectSystem=strict: the mountpoint watch looks at
    # the shared lock parent there, which a private /tmp would hide from it.
    assert unit_value("PrivateTmp") == "no"
    assert unit_value("MemoryDenyWriteExecute") == "yes"
    assert set(unit_value("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    # The broker must see host PIDs and be the host's root.
    for forbidden in ("PrivatePIDs", "PrivateUsers", "User", "DynamicUser", "PrivateNetwork"):
        assert unit_values(forbidden) == [], f"{forbidden}= must not be set"


def verifiable_unit(tmp_path: Path) -> Path:
    """
    A copy of the unit whose ExecStart names an executable that exists here
    (C{verify} checks it), the unit being otherwise byte for byte the same.
    """
    twistd = Path(sys.executable).parent / "twistd"
    executable = str(twistd) if twistd.exists() else shutil.which("twistd") or sys.executable
    copy_path = tmp_path / UNIT.name
    text = UNIT.read_text()
    assert text.count("ExecStart=/opt/hostpid/venv/bin/twistd ") == 1
    copy_path.write_text(
        text.replace("ExecStart=/opt/hostpid/venv/bin/twistd ", f"ExecStart={executable} ")
    )
    return copy_path


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    result = subprocess.run(
        [analyze, "verify", str(verifiable_unit(tmp_path))],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == "", "no warning either (unknown keys are warnings)"


SOCKET_UNIT = DEPLOY / "systemd" / "hostpid-broker.socket"


def socket_unit_values(key: str) -> list[str]:
    values, section = [], ""
    for raw in SOCKET_UNIT.read_text().splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and line[0] not in "#;" and section == "Socket":
            name, _, value = line.partition("=")
            if name.strip() == key:
                values.append(value.strip())
    return values


def test_socket_unit_states_the_rules_the_broker_checks() -> None:
    """The passed listener is what the broker would have bound itself."""
    assert socket_unit_values("ListenStream") == ["/run/hami/hostpid/broker.sock"]
    assert os.path.realpath("/var/run") == "/run" or not os.path.exists("/var/run")
    assert socket_unit_values("SocketMode") == [f"{defaults.SOCKET_MODE:04o}"]
    assert socket_unit_values("DirectoryMode") == [f"{defaults.DIRECTORY_MODE:04o}"]
    assert socket_unit_values("SocketUser") == ["root"]
    assert socket_unit_values("FileDescriptorName") == ["broker"]
    assert socket_unit_values("Backlog") == [str(defaults.LISTEN_BACKLOG)]
    assert socket_unit_values("Service") == [UNIT.name]
    # The service keeps its own listener too, across restarts.
    assert int(unit_value("FileDescriptorStoreMax")) >= 1


def test_both_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    service = verifiable_unit(tmp_path)
    socket_copy = tmp_path / SOCKET_UNIT.name
    socket_copy.write_text(SOCKET_UNIT.read_text())
    result = subprocess.run(
        [analyze, "verify", str(socket_copy), str(service)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == "", "no warning either (unknown keys are warnings)"


def test_unit_security_exposure_is_low(tmp_path: Path) -> None:
    """C{systemd-analyze security} rates exposure 0-10; require 2.0 or less ("OK")."""
    analyze = require_tool("systemd-analyze")
    result = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=20", "--no-pager",
         str(verifiable_unit(tmp_path))],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_command_runs_as_the_unit_restricts_it(tmp_path: Path) -> None:
    """
    The unit's ExecStart and Environment=, with systemd's part played by hand:
    root with an empty capability bounding set, no_new_privs, no W+X memory,
    umask 077 and a real NOTIFY_SOCKET.  READY=1 arrives once it serves, the
    files have the modes clients require, the metrics count the transaction,
    and SIGTERM brings STOPPING=1 and status 143 (SuccessExitStatus=).
    """
    prefix = restricted_prefix()
    if mdwe_supported():
        refused = subprocess.run(
            [*prefix, sys.executable, "-c",
             "import mmap; mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE"
             " | mmap.PROT_EXEC)"],
            capture_output=True, text=True, timeout=60,
        )
        assert "PermissionError" in refused.stderr, "the W+X restriction is in force"

    port = free_tcp_port()
    argv = with_metrics_port(shlex.split(unit_value("ExecStart")), port)
    directory = tmp_path / "run" / "hami" / "hostpid"
    notify = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(notify))
        systemd.settimeout(30)
        env = subprocess_env(unit_environment(), NOTIFY_SOCKET=str(notify))
        command = [*prefix, *from_working_tree([*argv, "--directory", str(directory)])]
        with running(command, env) as broker:
            assert systemd.recv(256) == b"READY=1", broker.output()
            assert broker.status_field("CapEff") == "0" * 16
            assert broker.status_field("NoNewPrivs") == "1"
            assert ask_pid(directory / "broker.sock") == os.getpid(), "ready means serving"
            assert_broker_files(directory)
            counted = 'hostpid_broker_transactions_total{outcome="ok"} 1.0'
            wait_for(lambda: counted in http_get(port, "/metrics")[1], "the metric")
            assert http_get(port, "/readyz")[0] == 200
            broker.process.send_signal(signal.SIGTERM)
            assert systemd.recv(256) == b"STOPPING=1"
            assert broker.process.wait(30) == -signal.SIGTERM, broker.output()
