"""
The Helm chart C{deploy/helm/hostpid-broker}, rendered and linted by Helm's
own engine: C{helm_python} (PyPI C{helm-python-sdk}) binds Helm 4's Go SDK
through ctypes, so templates, C{fail}, C{values.schema.json} and C{lint} are
Helm's, not a re-implementation.

Why each check exists:

- C{lint} with strict on, for the oldest and newest Kubernetes the docs
  claim: what C{helm lint --strict} would refuse is found here.
- Every object of every render in L{RENDERS} validates offline with
  C{kubernetes-validate} (strict: an unknown field fails) for the same
  versions, and every broker pod keeps the design's rules
  (L{test_deploy.pod_rule_violations}).  The Prometheus Operator's objects
  are custom resources, which C{kubernetes-validate} has no schema for: their
  selectors and ports are checked against the DaemonSet instead.
- The design's rule (the broker is never enabled without the host PID
  namespace), the other impossible combinations and the schema each fail a
  render, with the exact message an operator reads.  The design's value
  names (C{devicePlugin.hostPID}, C{devicePlugin.hostPIDBroker.enabled}) are
  the same settings as the short ones: either spelling renders the same, and
  the two disagreeing fail the render naming both.
- Helm's conventions: everything lands in the release's namespace (C{helm
  install -n hostpid --create-namespace}); a Namespace object only when
  asked for (so C{helm uninstall} deletes no namespace it was not asked to
  create); Kubernetes' recommended labels and C{helm.sh/chart} on every
  object; NOTES that need nothing but the cluster (no file of this
  repository).
- The design's rollout and rollback as chart value changes (install
  disabled, upgrade enabled, upgrade disabled) render what the docs say: only
  the gate changes, the rolled-back render is the disabled one, and each
  render's broker command runs as the shipped DaemonSet's does
  (L{test_deploy.run_daemonset_container}).
- C{deploy/kubernetes/} is generated from the chart
  (C{deploy/helm/render-manifests}); the generated files must equal a fresh
  render, and the script's C{--check} must catch a file that drifted.
"""

from __future__ import annotations

import configparser
import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate.utils as kubernetes_validate
import pytest
import yaml
from support import REPO
from test_deploy import (
    BROKER_DIRECTORY,
    DAEMONSET,
    DAEMONSET_WITHOUT_METRICS,
    KUBERNETES,
    KUBERNETES_VERSIONS,
    broker_container,
    container_argv,
    gate_value,
    load_documents,
    option_value,
    pod_rule_violations,
    pod_spec,
    run_daemonset_container,
)

CHART = REPO / "deploy" / "helm" / "hostpid-broker"
RENDER_MANIFESTS = REPO / "deploy" / "helm" / "render-manifests"
RELEASE = "hostpid-broker"
#: The release's namespace, where every object goes (helm install -n hostpid).
RELEASE_NAMESPACE = "hostpid"
#: The standard labels every object carries (the values are the default render's).
STANDARD_LABELS = {
    "app.kubernetes.io/name": "hostpid-broker",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/managed-by": "Helm",
    "app.kubernetes.io/component": "broker",
}
MONITORING_KINDS = {"PodMonitor", "ServiceMonitor"}


def render(
    values: dict[str, Any] | None = None,
    *,
    namespace: str = RELEASE_NAMESPACE,
    revision: int = 1,
    upgrade: bool = False,
) -> list[dict[str, Any]]:
    """Every object the chart renders with C{values}, as Helm renders it."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(
            values, name=RELEASE, namespace=namespace, revision=revision,
            is_install=not upgrade, is_upgrade=upgrade,
        )
    return [
        doc for template, text in sorted(rendered.items()) if template.endswith(".yaml")
        for doc in yaml.safe_load_all(text) if doc
    ]


def notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE)
    return rendered[f"{RELEASE}/templates/NOTES.txt"]


def refusal(values: dict[str, Any], namespace: str = RELEASE_NAMESPACE) -> helm.HelmError:
    """The error Helm refuses C{values} with (the test fails if it renders)."""
    with pytest.raises(helm.HelmError) as refused:
        render(values, namespace=namespace)
    return refused.value


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in docs if doc["kind"] == kind]
    return doc


def sets(*expressions: str) -> dict[str, Any]:
    """Values as C{helm --set EXPR ...} gives them (Helm's own parser)."""
    values: dict[str, Any] = {}
    for expression in expressions:
        values = merge(values, helm.parse_set_string(expression))
    return values


def merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


#: Renders whose every object must validate and keep the design's rules.
RENDERS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "enabled": sets("hostPIDBroker.enabled=true"),
    "enabled by the design's names": sets("devicePlugin.hostPIDBroker.enabled=true",
                                          "devicePlugin.hostPID=true"),
    "the namespace created by the chart": sets("namespace.create=true", "namespace.name=gpu-node"),
    "without metrics": sets("metrics.enabled=false"),
    "enabled without metrics or CDI": sets(
        "hostPIDBroker.enabled=true", "metrics.enabled=false", "broker.cdi.enabled=false"),
    "monitors on": sets("podMonitor.enabled=true", "serviceMonitor.enabled=true",
                        "podMonitor.labels.release=prometheus"),
    "IPv6 metrics": sets("metrics.bindAddress=::", "metrics.port=9500"),
    "everything an operator sets": {
        "hostPIDBroker": {"enabled": True},
        "image": {"repository": "registry.internal/hami/hostpid-broker", "tag": "0.1.0-1",
                  "pullPolicy": "Always", "pullSecrets": ["registry"]},
        "broker": {"maxConnections": 1024, "deadline": 0.25, "lockParent": "/var/tmp/vgpulock",
                   "logFormat": "text",
                   "cdi": {"enabled": True, "directory": "/etc/cdi"}},
        "networkPolicy": {
            "monitoringNamespaceSelector": {"matchLabels": {"team": "observability"}},
            "additionalFrom": [{"ipBlock": {"cidr": "192.0.2.0/24"}}],
        },
        "livenessProbe": {"deadline": 5, "periodSeconds": 30, "timeoutSeconds": 8,
                          "failureThreshold": 5},
        "resources": {"requests": {"cpu": "250m", "memory": "64Mi"},
                      "limits": {"cpu": "2", "memory": "256Mi"}},
        "priorityClassName": "",
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
        "updateStrategy": {"type": "OnDelete"},
        "podAnnotations": {"example.com/owner": "gpu-platform"},
        "podLabels": {"example.com/tier": "node"},
        "commonLabels": {"example.com/team": "gpu"},
    },
}


# --- the chart itself ---------------------------------------------------------------


def test_chart_metadata() -> None:
    """
    The chart's own C{version} is held by C{test_chart_version.py} (it
    changes with every change to the chart); C{appVersion} follows the
    distribution's version there too.
    """
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "hostpid-broker"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", [None, RENDERS["enabled"], RENDERS["monitors on"]],
                         ids=["defaults", "enabled", "monitors on"])
def test_lint_strict_is_clean(version: str, values: dict[str, Any] | None) -> None:
    """
    C{helm lint --strict} (warnings are errors): nothing but Helm's one
    informational note, that a chart icon is recommended (the project has no
    icon to point at).
    """
    report = helm.lint(CHART, values, strict=True, namespace=RELEASE_NAMESPACE,
                       kube_version=f"v{version}")
    assert report["errors"] == [], report
    assert report["messages"] == [
        {"severity": 1, "path": "Chart.yaml", "error": "icon is recommended"}
    ], report


def test_lint_strict_fails_on_a_broken_chart(tmp_path: Path) -> None:
    """The lint above can fail: a copy with a template error is reported."""
    broken = tmp_path / "hostpid-broker"
    shutil.copytree(CHART, broken)
    path = broken / "templates" / "serviceaccount.yaml"
    path.write_text(path.read_text() + "{{ .Values.broker.directory | nosuchfunction }}\n")
    report = helm.lint(broken, strict=True, namespace=RELEASE_NAMESPACE)
    assert any('function "nosuchfunction" not defined' in error for error in report["errors"])


# --- every render: schemas and the design's rules -------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(RENDERS))
def test_every_rendered_object_validates(case: str, version: str) -> None:
    docs = render(RENDERS[case])
    validated = 0
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            continue
        assert kubernetes_validate.validate(doc, version, strict=True) == \
            version.rsplit(".", 1)[0], (case, doc["kind"])
        validated += 1
    assert validated >= 2, [doc["kind"] for doc in docs]


@pytest.mark.parametrize("case", sorted(RENDERS))
def test_every_render_keeps_the_design_rules(case: str) -> None:
    docs = render(RENDERS[case])
    ds = by_kind(docs, "DaemonSet")
    spec = pod_spec(ds)
    assert spec is not None
    assert pod_rule_violations(spec, case) == []
    values = RENDERS[case]
    enabled = values.get("hostPIDBroker", {}).get("enabled") or \
        values.get("devicePlugin", {}).get("hostPIDBroker", {}).get("enabled", False)
    assert gate_value(broker_container(ds)) == ("1" if enabled else "0")
    namespaces = {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"}
    assert namespaces == {RENDERS[case].get("namespace", {}).get("name", RELEASE_NAMESPACE)}, \
        "every object in the broker's namespace"


@pytest.mark.parametrize("case", sorted(RENDERS))
def test_every_object_carries_the_standard_labels(case: str) -> None:
    """
    Kubernetes' recommended labels and Helm's chart label, on every object
    and on the broker's pods: what C{kubectl get -l
    app.kubernetes.io/instance=RELEASE} and dashboards select by.
    """
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    expected = {**STANDARD_LABELS, "app.kubernetes.io/version": chart["appVersion"],
                "helm.sh/chart": f"hostpid-broker-{chart['version']}"}
    docs = render(RENDERS[case])
    pods = [doc["spec"]["template"] for doc in docs if doc["kind"] == "DaemonSet"]
    for doc in [*docs, *pods]:
        labels = doc["metadata"]["labels"]
        assert expected.items() <= labels.items(), (case, doc.get("kind", "pod template"))
        assert labels.items() >= RENDERS[case].get("commonLabels", {}).items()


#: Every part of the chart on: the broker, the webhook (Helm's certificates, or
#: cert-manager's), the NRI plugin and the Prometheus Operator's objects.
EVERY_PART = sets("hostPIDBroker.enabled=true", "webhook.enabled=true", "webhook.gate=true",
                  "nri.enabled=true", "nri.gate=true", "podMonitor.enabled=true",
                  "serviceMonitor.enabled=true", "commonLabels.example\\.com/team=gpu")
PARTS = {"hostpid-broker": "broker", "hostpid-webhook": "webhook", "hostpid-nri": "nri-plugin"}


@pytest.mark.parametrize("certificates", ["helm", "cert-manager"])
def test_every_object_of_every_part_carries_the_release_labels(certificates: str) -> None:
    """
    What docs/operations.md promises of every object: the release's
    instance, version, managed-by, part-of and chart labels and
    C{commonLabels}, on the webhook's and the NRI plugin's objects and pods
    as on the broker's (C{kubectl get all -l app.kubernetes.io/instance=R}
    finds the whole release); each part has its own name and component.
    """
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    release = {"app.kubernetes.io/instance": RELEASE,
               "app.kubernetes.io/version": chart["appVersion"],
               "app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/part-of": "hostpid",
               "helm.sh/chart": f"hostpid-broker-{chart['version']}",
               "example.com/team": "gpu"}
    values = EVERY_PART if certificates == "helm" else \
        merge(EVERY_PART, sets("webhook.certManager.enabled=true"))
    docs = render(values)
    pods = [doc["spec"]["template"] for doc in docs if doc["kind"] in ("DaemonSet", "Deployment")]
    assert len(pods) == 3
    missing = []
    for doc in [*docs, *pods]:
        labels = doc["metadata"]["labels"]
        where = (doc.get("kind", "pod template"), labels.get("app.kubernetes.io/name"))
        if not release.items() <= labels.items():
            missing.append((where, sorted(set(release) - {k for k in release
                                                           if labels.get(k) == release[k]})))
        elif PARTS.get(labels["app.kubernetes.io/name"]) != labels.get(
                "app.kubernetes.io/component"):
            missing.append((where, "app.kubernetes.io/component"))
    assert missing == []


def test_monitors_scrape_the_brokers_metrics_port() -> None:
    """
    The custom resources (no schema in kubernetes-validate): each selects the
    broker's pods (the ServiceMonitor through a headless Service that does),
    on the port named C{metrics} that the container declares.
    """
    docs = render(RENDERS["monitors on"])
    ds = by_kind(docs, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in broker_container(ds)["ports"]}
    pod_monitor = by_kind(docs, "PodMonitor")
    assert pod_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert "metrics" in ports
    service = by_kind(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert (service_port["name"], service_port["targetPort"]) == ("metrics", "metrics")
    service_monitor = by_kind(docs, "ServiceMonitor")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert not {"PodMonitor", "ServiceMonitor", "Service"} & {d["kind"] for d in render()}, \
        "off by default"


def test_updates_surge_first_with_the_handover() -> None:
    """
    The new pod starts beside the old one and takes its listener over; Ready
    only once its own broker holds it (the ready file, in the pod's own
    emptyDir); the old broker idles after handing over until its pod goes.
    """
    ds = by_kind(render(), "DaemonSet")
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0},
    }
    container = broker_container(ds)
    argv = container_argv(container)
    ready = option_value(argv, "--ready-file")
    assert ready == "/run/hostpid-ready/ready"
    assert option_value(argv, "--after-handover") == "wait"
    assert f"[ -e {ready} ] && exec hostpid probe" in container["readinessProbe"]["exec"][
        "command"][2]
    assert "-e " not in container["livenessProbe"]["exec"]["command"][2], \
        "liveness: the socket answers, whichever broker holds it"
    (volume,) = [v for v in pod_spec(ds)["volumes"] if v["name"] == "ready"]  # type: ignore[index]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert {"name": "ready", "mountPath": "/run/hostpid-ready"} in container["volumeMounts"]


def test_values_reach_the_broker_as_options() -> None:
    """The broker's options, metrics endpoint and probes follow the values."""
    docs = render(RENDERS["everything an operator sets"])
    container = broker_container(by_kind(docs, "DaemonSet"))
    argv = container_argv(container)
    assert option_value(argv, "--max-connections") == "1024"
    assert option_value(argv, "--deadline") == "0.25"
    assert option_value(argv, "--log-format") == "text"
    assert option_value(argv, "--cdi-dir") == "/etc/cdi"
    assert option_value(argv, "--lock-parent") == "/var/tmp/vgpulock"
    assert option_value(argv, "--metrics") == "tcp:9394:interface=0.0.0.0"
    assert container["image"] == "registry.internal/hami/hostpid-broker:0.1.0-1"
    assert container["livenessProbe"]["exec"]["command"][2].endswith("--timeout 5")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {BROKER_DIRECTORY, "/etc/cdi", "/var/tmp", "/run/hostpid-ready"}
    # The broker's own bound, from a values file (where Helm reads numbers as floats,
    # which its templates would print as 1.048576e+06).
    largest = render(helm.values_from_yaml("broker:\n  maxConnections: 1048576\n"))
    argv = container_argv(broker_container(by_kind(largest, "DaemonSet")))
    assert option_value(argv, "--max-connections") == "1048576"
    ipv6 = broker_container(by_kind(render(RENDERS["IPv6 metrics"]), "DaemonSet"))
    assert option_value(container_argv(ipv6), "--metrics") == r"tcp6:9500:interface=\:\:"


def test_another_broker_directory_is_used_everywhere() -> None:
    """C{broker.directory}: the option, the hostPath, the mount and both probes."""
    directory = "/var/lib/hami/hostpid"
    ds = by_kind(render(sets(f"broker.directory={directory}")), "DaemonSet")
    container = broker_container(ds)
    assert option_value(container_argv(container), "--directory") == directory
    (volume,) = [v for v in pod_spec(ds)["volumes"] if v["name"] == "broker-dir"]  # type: ignore[index]
    assert volume["hostPath"] == {"path": directory, "type": "DirectoryOrCreate"}
    assert {"name": "broker-dir", "mountPath": directory} in container["volumeMounts"]
    for kind in ("livenessProbe", "readinessProbe"):
        assert f"--socket {directory}/broker.sock " in container[kind]["exec"]["command"][2]


@pytest.mark.parametrize("lock_parent", ["/tmp/vgpulock", "/var/tmp/vgpulock"])
def test_the_host_tmp_mount_is_the_lock_parents_parent_and_as_tight_as_it_can_be(
    lock_parent: str,
) -> None:
    """
    The one mount of the host's C{/tmp} (the lock parent's parent, which
    preparation must check and C{mkdirat} the lock parent in: so writable
    and whole, docs/security.md "The broker's mounts") has no mount
    propagation either way, must already exist on the host (C{Directory}:
    kubelet creates nothing there), is never a mount of the lock parent
    itself, and is not rendered at all without CDI.
    """
    parent = lock_parent.rsplit("/", 1)[0]
    daemonset = by_kind(render(sets(f"broker.lockParent={lock_parent}")), "DaemonSet")
    spec = pod_spec(daemonset)
    assert spec is not None
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in broker_container(daemonset)["volumeMounts"]
                if m["name"] == "host-tmp"]
    assert mount == {"name": "host-tmp", "mountPath": parent, "mountPropagation": "None"}
    assert volumes["host-tmp"] == {"name": "host-tmp",
                                   "hostPath": {"path": parent, "type": "Directory"}}
    host_paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert not any(path == lock_parent or path.startswith(lock_parent + "/")
                   for path in host_paths), "never the lock parent or anything in it"
    without = pod_spec(by_kind(render(sets("broker.cdi.enabled=false")), "DaemonSet"))
    assert without is not None
    assert all(v["hostPath"]["path"] not in ("/tmp", parent)
               for v in without["volumes"] if "hostPath" in v), "no host /tmp without CDI"


def test_the_release_namespace_holds_everything_and_no_namespace_is_rendered() -> None:
    """
    C{helm install -n NAMESPACE --create-namespace}, the Helm way: every
    object goes to the release's namespace and the chart renders no
    Namespace, so C{helm uninstall} deletes none.
    """
    for namespace in ("hostpid", "gpu-system"):
        docs = render(namespace=namespace)
        assert "Namespace" not in {doc["kind"] for doc in docs}
        assert {doc["metadata"]["namespace"] for doc in docs} == {namespace}


def test_the_chart_creates_the_namespace_only_when_asked_to() -> None:
    """
    C{namespace.create=true} (the release stored elsewhere): the Namespace
    with the Pod Security labels the broker's pod needs, and every object in
    it.
    """
    docs = render(RENDERS["the namespace created by the chart"], namespace="default")
    namespace = by_kind(docs, "Namespace")
    assert namespace["metadata"]["name"] == "gpu-node"
    assert {f"pod-security.kubernetes.io/{mode}": "privileged"
            for mode in ("enforce", "warn", "audit")}.items() <= \
        namespace["metadata"]["labels"].items()
    assert {doc["metadata"]["namespace"] for doc in docs if doc is not namespace} == {"gpu-node"}


def test_the_design_value_names_are_the_same_settings() -> None:
    """
    C{devicePlugin.hostPID} and C{devicePlugin.hostPIDBroker.enabled} (the
    design's names, in HAMi users' values files) render exactly what the
    short names render, alone or together with the same value.
    """
    for short in ("hostPIDBroker.enabled=true", "hostPID=false", "hostPIDBroker.enabled=false"):
        long = f"devicePlugin.{short}"
        expected = render(sets(short))
        assert render(sets(long)) == expected, long
        assert render(sets(short, long)) == expected, (short, long)
    ds = by_kind(render(sets("devicePlugin.hostPIDBroker.enabled=true")), "DaemonSet")
    assert gate_value(broker_container(ds)) == "1"
    assert pod_spec(ds)["hostPID"] is True  # type: ignore[index]
    ds = by_kind(render(helm.values_from_yaml("devicePlugin:\n  hostPID: false\n")), "DaemonSet")
    assert pod_spec(ds)["hostPID"] is False  # type: ignore[index]


def test_notes_tell_the_operator_how_to_check_a_node() -> None:
    text = notes()
    assert "kubectl -n hostpid rollout status daemonset/hostpid-broker" in text
    assert f"hostpid probe --socket {BROKER_DIRECTORY}/broker.sock" in text
    assert "The gate is OFF (hostPIDBroker.enabled=false)" in text
    assert "kubectl label namespace hostpid pod-security.kubernetes.io/enforce=privileged" in text
    assert "--reset-then-reuse-values --set hostPIDBroker.enabled=true" in text
    enabled = notes(RENDERS["enabled"])
    assert "The gate is ON (hostPIDBroker.enabled=true)" in enabled
    assert "--reset-then-reuse-values --set hostPIDBroker.enabled=false" in enabled
    assert "The gate is ON (devicePlugin.hostPIDBroker.enabled=true)" in \
        notes(RENDERS["enabled by the design's names"])


@pytest.mark.parametrize("case", ["defaults", "enabled"])
def test_notes_are_self_contained(case: str) -> None:
    """
    NOTES are read by someone who installed from a chart repository: no path
    of this repository (docs/, deploy/, *.md); the manual is the chart's home.
    """
    text = notes(RENDERS[case])
    assert not re.search(r"docs/|deploy/|tests/|\.md\b", text), text
    home = yaml.safe_load((CHART / "Chart.yaml").read_text()).get("home")
    if home:
        assert home in text
    else:
        assert "://" not in text and "manual:" not in text, text


def test_no_address_the_project_does_not_have() -> None:
    """
    The project has no public repository or site of its own: the chart and
    the distribution name none.  An invented one (a GitHub repository that
    does not exist) sent users nowhere.
    """
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert "home" not in chart and "sources" not in chart
    assert "url" not in setup["metadata"] and "project_urls" not in setup["metadata"]


def test_a_loopback_metrics_address_renders_no_network_policy() -> None:
    """
    values.yaml says so: a loopback listener is reachable only inside the
    pod, so no NetworkPolicy is rendered for it (and the monitors are
    refused, below).
    """
    assert "NetworkPolicy" in {doc["kind"] for doc in render()}
    for address in ("127.0.0.1", "::1"):
        kinds = {doc["kind"] for doc in render(sets(f"metrics.bindAddress={address}"))}
        assert "NetworkPolicy" not in kinds, address
    comment = (CHART / "values.yaml").read_text()
    assert "the NetworkPolicy is\n  # not rendered" in comment


# --- the design's rule, the other impossible combinations, the schema ------------------

#: The design's rule, word for word as the operator reads it.
DESIGN_RULE = (
    "execution error at (hostpid-broker/templates/rules.yaml:2:4): "
    "hostPIDBroker.enabled=true requires hostPID=true: without the host PID namespace the "
    "broker would report PIDs of its own namespace (it refuses to start there); set "
    "hostPID=true or hostPIDBroker.enabled=false"
)


def test_the_design_rule_enabled_without_host_pid_fails_the_render() -> None:
    """
    The design: "The chart rejects a configuration that enables the broker
    while disabling the device plugin host PID namespace."  One message
    naming both values; given as --set flags or as a values file alike.
    """
    refused = refusal(sets("hostPIDBroker.enabled=true", "hostPID=false"))
    assert isinstance(refused, helm.HelmRenderError)
    assert refused.detail == DESIGN_RULE
    values_file = helm.values_from_yaml("hostPID: false\nhostPIDBroker:\n  enabled: true\n")
    assert refusal(values_file).detail == DESIGN_RULE
    # (helm lint renders in its lint mode, where Helm logs a `fail` instead of failing:
    # the render, which install and upgrade perform, is what enforces the rule.)


def test_host_pid_off_is_allowed_while_the_broker_is_disabled() -> None:
    """Only the enabled combination is refused: a disabled broker needs no host PIDs."""
    ds = by_kind(render(sets("hostPID=false")), "DaemonSet")
    assert pod_spec(ds)["hostPID"] is False  # type: ignore[index]
    assert gate_value(broker_container(ds)) == "0"


IMPOSSIBLE: dict[str, tuple[dict[str, Any], str, str]] = {
    "a monitor without metrics": (
        sets("metrics.enabled=false", "podMonitor.enabled=true"), RELEASE_NAMESPACE,
        "podMonitor.enabled=true requires metrics.enabled=true: there is no metrics port to "
        "scrape"),
    "a monitor of a loopback listener": (
        sets("metrics.bindAddress=127.0.0.1", "serviceMonitor.enabled=true"), RELEASE_NAMESPACE,
        "serviceMonitor.enabled=true cannot scrape metrics.bindAddress=127.0.0.1: a loopback "
        "address is reachable only inside the pod"),
    "a probe the kubelet ends before its deadline": (
        sets("livenessProbe.timeoutSeconds=3"), RELEASE_NAMESPACE,
        "livenessProbe.timeoutSeconds=3 must be at least livenessProbe.deadline=3 plus 1 s: "
        "the kubelet would end the probe before its deadline (it starts a Python process "
        "first)"),
    "the release stored in the namespace it creates": (
        sets("namespace.create=true"), "hostpid",
        "namespace.create=true renders namespace hostpid, which cannot hold the release that "
        "creates it: leave namespace.create=false and install with -n hostpid "
        "--create-namespace (labelling it for Pod Security yourself), or set namespace.name "
        "to a namespace other than the release's"),
    "the design's name enabled without the host PID namespace": (
        sets("devicePlugin.hostPIDBroker.enabled=true", "hostPID=false"), RELEASE_NAMESPACE,
        "devicePlugin.hostPIDBroker.enabled=true requires hostPID=true: without the host PID "
        "namespace the broker would report PIDs of its own namespace (it refuses to start "
        "there); set hostPID=true or devicePlugin.hostPIDBroker.enabled=false"),
    "the design's names for both, enabled without the host PID namespace": (
        helm.values_from_yaml("devicePlugin:\n  hostPID: false\n  hostPIDBroker:\n"
                              "    enabled: true\n"), RELEASE_NAMESPACE,
        "devicePlugin.hostPIDBroker.enabled=true requires devicePlugin.hostPID=true: without "
        "the host PID namespace the broker would report PIDs of its own namespace (it refuses "
        "to start there); set devicePlugin.hostPID=true or "
        "devicePlugin.hostPIDBroker.enabled=false"),
    "the two names of hostPID disagreeing": (
        sets("hostPID=true", "devicePlugin.hostPID=false"), RELEASE_NAMESPACE,
        "devicePlugin.hostPID=false and hostPID=true disagree: they are the same setting under "
        "two names (the design's and this chart's); give one of them, or the same value to "
        "both"),
    "the two names of the gate disagreeing": (
        sets("hostPIDBroker.enabled=false", "devicePlugin.hostPIDBroker.enabled=true"),
        RELEASE_NAMESPACE,
        "devicePlugin.hostPIDBroker.enabled=true and hostPIDBroker.enabled=false disagree: they "
        "are the same setting under two names (the design's and this chart's); give one of "
        "them, or the same value to both"),
    "the lock parent at the root": (
        sets("broker.lockParent=/"), RELEASE_NAMESPACE,
        "broker.lockParent must not be /: its parent directory is mounted from the host"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_an_impossible_combination_fails_the_render(case: str) -> None:
    values, namespace, message = IMPOSSIBLE[case]
    refused = refusal(values, namespace)
    assert isinstance(refused, helm.HelmRenderError)
    assert refused.detail == f"execution error at (hostpid-broker/templates/rules.yaml:2:4): " \
        f"{message}"


def schema_message(*lines: str) -> str:
    return ("values don't meet the specifications of the schema(s) in the following chart(s):\n"
            "hostpid-broker:\n" + "".join(f"- {line}\n" for line in lines))


SCHEMA_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "the gate as a string": (
        {"hostPIDBroker": {"enabled": "1"}},
        schema_message("at '/hostPIDBroker/enabled': got string, want null or boolean")),
    "hostPID mistyped": (
        {"hostPid": True}, schema_message("at '': additional properties 'hostPid' not allowed")),
    "the design's hostPID mistyped": (
        sets("devicePlugin.hostPid=true"),
        schema_message("at '/devicePlugin': additional properties 'hostPid' not allowed")),
    "hostPID as a string (--set-string)": (
        helm.parse_set_string_values("hostPID=false"),
        schema_message("at '/hostPID': got string, want null or boolean")),
    "a port out of range": (
        sets("metrics.port=70000"),
        schema_message("at '/metrics/port': maximum: got 70,000, want 65,535")),
    "a relative directory": (
        sets("broker.directory=var/run/hami/hostpid"),
        schema_message("at '/broker/directory': 'var/run/hami/hostpid' does not match "
                       "pattern '^/[A-Za-z0-9._/-]*$'")),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_REFUSALS))
def test_the_schema_refuses_a_mistyped_value_before_rendering(case: str) -> None:
    values, message = SCHEMA_REFUSALS[case]
    refused = refusal(values)
    assert isinstance(refused, helm.HelmValuesError)
    assert refused.detail == message


# --- rollout and rollback in chart terms (docs/rollout.md) -----------------------------

#: docs/rollout.md: helm install --set image.repository=... --set
#: hostPIDBroker.enabled=false, then helm upgrade --reset-then-reuse-values --set
#: hostPIDBroker.enabled=true (the design's rollout step 3), then the same with
#: false (rollback step 1).  --reset-then-reuse-values: each upgrade keeps the values before it.
INSTALLED = sets("image.repository=registry.internal/hostpid/hostpid-broker",
                 "hostPIDBroker.enabled=false")
STEPS = {
    "disabled (install)": (INSTALLED, 1, False),
    "enabled (upgrade)": (merge(INSTALLED, sets("hostPIDBroker.enabled=true")), 2, True),
    "rolled back (upgrade)": (merge(INSTALLED, sets("hostPIDBroker.enabled=false")), 3, True),
}


def step(name: str) -> list[dict[str, Any]]:
    values, revision, upgrade = STEPS[name]
    return render(values, revision=revision, upgrade=upgrade)


def without_gate(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    container = broker_container(doc)
    container["env"] = [v for v in container["env"] if v["name"] != "LIBVGPU_HOSTPID_BROKER"]
    return doc


def test_rollout_and_rollback_change_the_gate_and_nothing_else() -> None:
    disabled, enabled, rolled_back = (step(name) for name in STEPS)
    gates = [gate_value(broker_container(by_kind(docs, "DaemonSet")))
             for docs in (disabled, enabled, rolled_back)]
    assert gates == ["0", "1", "0"]
    assert rolled_back == disabled, "rolling back renders exactly the disabled release"
    assert [without_gate(d) if d["kind"] == "DaemonSet" else d for d in enabled] == \
        [without_gate(d) if d["kind"] == "DaemonSet" else d for d in disabled], \
        "enabling changes the gate alone: the same mounts, options, probes"
    for docs in (disabled, enabled):
        ds = by_kind(docs, "DaemonSet")
        container = broker_container(ds)
        mounts = {(m["name"], m["mountPath"], bool(m.get("readOnly")))
                  for m in container["volumeMounts"]}
        assert mounts == {("broker-dir", BROKER_DIRECTORY, False),
                          ("cdi-dir", "/var/run/cdi", False), ("host-tmp", "/tmp", False),
                          ("ready", "/run/hostpid-ready", False)}
        # Even disabled, the broker prepares the lock parent and writes the CDI spec.
        argv = container_argv(container)
        assert option_value(argv, "--log-format") == "json"
        assert option_value(argv, "--cdi-dir") == "/var/run/cdi"
        assert option_value(argv, "--lock-parent") == "/tmp/vgpulock"


@pytest.mark.parametrize("name", [*STEPS, "enabled without metrics or CDI"])
def test_each_rendered_broker_runs_as_the_shipped_daemonset_does(name: str) -> None:
    """
    The rendered DaemonSet's container, run as root without capabilities,
    and its exec probes, as C{test_deploy.py} runs the shipped one: it serves
    (enabled) or prepares what a disabled broker prepares (disabled, rolled
    back), and its probes judge it.
    """
    docs = step(name) if name in STEPS else render(RENDERS[name])
    run_daemonset_container(by_kind(docs, "DaemonSet"))


# --- deploy/kubernetes/ is generated from the chart ------------------------------------


def test_the_raw_manifests_are_the_default_render() -> None:
    """Object for object, independently of the script that writes them."""
    docs = render()
    assert load_documents(DAEMONSET) == [by_kind(docs, "DaemonSet")]
    assert load_documents(KUBERNETES / "00-namespace.yaml") == [by_kind(
        render(sets("namespace.create=true", "namespace.name=hostpid"), namespace="default"),
        "Namespace")]
    for name, kind in (("10-serviceaccount.yaml", "ServiceAccount"),
                       ("30-networkpolicy.yaml", "NetworkPolicy")):
        assert load_documents(KUBERNETES / name) == [by_kind(docs, kind)], name
    assert load_documents(DAEMONSET_WITHOUT_METRICS) == \
        [by_kind(render(sets("metrics.enabled=false")), "DaemonSet")]


def render_manifests(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RENDER_MANIFESTS), *args],
                          capture_output=True, text=True, timeout=120)


def test_the_generated_files_have_not_drifted_from_the_chart(tmp_path: Path) -> None:
    """
    C{render-manifests --check} passes on the tree, and fails, naming the
    file, on a copy where one generated file was edited by hand.
    """
    done = render_manifests("--check")
    assert done.returncode == 0, done.stderr
    copy_dir = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy_dir)
    edited = copy_dir / "20-daemonset.yaml"
    edited.write_text(edited.read_text().replace("cpu: 100m", "cpu: 10m"))
    drifted = render_manifests("--check", "--into", str(copy_dir))
    assert drifted.returncode == 1
    assert drifted.stderr == (f"{copy_dir} differs from the chart (run "
                              "deploy/helm/render-manifests): 20-daemonset.yaml\n")
    rewritten = render_manifests("--into", str(copy_dir))
    assert rewritten.returncode == 0, rewritten.stderr
    assert edited.read_text() == DAEMONSET.read_text()
