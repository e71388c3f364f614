"""
The chart's admission webhook objects (C{webhook.enabled}), rendered by
Helm's own engine as C{tests/test_chart.py} renders the rest.

Why each check exists:

- Off by default: a default install changes no pod.
- Every object validates (strict) for the supported Kubernetes versions, and
  C{helm lint --strict} stays clean with the webhook on.
- The webhook can never refuse a pod nor hold pod creation long
  (C{failurePolicy: Ignore}, C{timeoutSeconds} at most 5), is reinvoked,
  skips C{kube-system} and its own namespaces, and honours the opt-out label
  on namespaces and pods; in mode C{mounts} it skips namespaces whose Pod
  Security level would refuse the hostPath volumes it adds.
- Its pods run with nothing of the host's and no privilege, are spread over
  nodes, and no broker selector (DaemonSet, NetworkPolicy) selects them.
- TLS: the generated certificate names the Service and is signed by the
  CA in C{caBundle}; an existing Secret is reused (what C{lookup} returns on
  an upgrade); cert-manager replaces both when asked.
- With C{webhook.deviceClasses} (DRA pods), and only then: each class as
  C{--device-class}, each read within half of C{timeoutSeconds}, the
  service account token mounted, and a ClusterRole granting C{get} on
  C{resourceclaims} and C{resourceclaimtemplates} and nothing else, bound
  to the webhook's own ServiceAccount; without it, no token and no RBAC.
- The rules: mode C{cdi} without the broker's CDI spec, and the webhook's
  gate without the broker's, fail the render naming both values.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate.utils as kubernetes_validate
import pytest
import yaml
from cryptography import x509
from test_chart import CHART, RELEASE_NAMESPACE, by_kind, merge, refusal, render, sets
from test_deploy import KUBERNETES_VERSIONS

WEBHOOK_KINDS = {"Deployment", "PodDisruptionBudget", "Service", "Secret",
                 "MutatingWebhookConfiguration", "NetworkPolicy"}
CERT_MANAGER_KINDS = {"Issuer", "Certificate"}

RENDERS = {
    "cdi": sets("webhook.enabled=true", "webhook.mode=cdi"),
    "mounts": sets("webhook.enabled=true", "webhook.mode=mounts"),
    "gate on": sets("webhook.enabled=true", "webhook.gate=true", "hostPIDBroker.enabled=true"),
    "cert-manager": sets("webhook.enabled=true", "webhook.certManager.enabled=true"),
    "cert-manager with an issuer": sets(
        "webhook.enabled=true", "webhook.certManager.enabled=true",
        "webhook.certManager.issuerRef.name=corp-ca",
        "webhook.certManager.issuerRef.kind=ClusterIssuer"),
    "device classes": sets("webhook.enabled=true",
                           "webhook.deviceClasses={gpu.hami.io,gpu.nvidia.com}"),
}


def webhook_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["metadata"].get("labels", {}).get(
        "app.kubernetes.io/name") == "hostpid-webhook"]


def configuration(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (webhook,) = by_kind(docs, "MutatingWebhookConfiguration")["webhooks"]
    return webhook


def test_off_by_default() -> None:
    assert webhook_objects(render()) == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(RENDERS))
def test_every_webhook_object_validates(case: str, version: str) -> None:
    objects = webhook_objects(render(RENDERS[case]))
    kinds = {d["kind"] for d in objects}
    expected = WEBHOOK_KINDS - ({"Secret"} if "cert-manager" in case else set())
    assert expected <= kinds
    for doc in objects:
        if doc["kind"] in CERT_MANAGER_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_lint_strict_is_clean_with_the_webhook(version: str) -> None:
    report = helm.lint(CHART, RENDERS["mounts"], strict=True, namespace=RELEASE_NAMESPACE,
                       kube_version=f"v{version}")
    assert report["errors"] == [], report
    assert [m["error"] for m in report["messages"]] == ["icon is recommended"], report


@pytest.mark.parametrize("case", ["cdi", "mounts"])
def test_the_webhook_never_refuses_nor_holds_a_pod(case: str) -> None:
    webhook = configuration(render(RENDERS[case]))
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["sideEffects"] == "None"
    assert webhook["timeoutSeconds"] == 5
    assert webhook["reinvocationPolicy"] == "IfNeeded"
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""],
                                 "apiVersions": ["v1"], "resources": ["pods"],
                                 "scope": "Namespaced"}]
    assert webhook["clientConfig"]["service"] == {
        "name": "hostpid-webhook", "namespace": RELEASE_NAMESPACE, "path": "/mutate",
        "port": 443}


def test_the_schema_keeps_the_timeout_at_most_5() -> None:
    error = refusal(sets("webhook.enabled=true", "webhook.timeoutSeconds=10"))
    assert "timeoutSeconds" in str(error)


@pytest.mark.parametrize("namespace", ["gpu-system", "hostpid-webhook"])
def test_kube_system_and_the_charts_namespaces_are_left_out(namespace: str) -> None:
    docs = render(RENDERS["mounts"], namespace=namespace)
    expressions = configuration(docs)["namespaceSelector"]["matchExpressions"]
    by_key = {e["key"]: e for e in expressions}
    assert by_key["kubernetes.io/metadata.name"]["operator"] == "NotIn"
    broker_namespace = yaml.safe_load((CHART / "values.yaml").read_text()).get(
        "namespace", {}).get("name") or namespace
    assert {"kube-system", namespace, broker_namespace, "gpu-operator"} == set(
        by_key["kubernetes.io/metadata.name"]["values"])
    assert by_key["hostpid.hami.io/webhook"] == {
        "key": "hostpid.hami.io/webhook", "operator": "NotIn", "values": ["disabled"]}
    assert by_key["pod-security.kubernetes.io/enforce"] == {
        "key": "pod-security.kubernetes.io/enforce", "operator": "NotIn",
        "values": ["baseline", "restricted"]}
    objects = configuration(docs)["objectSelector"]["matchExpressions"]
    assert objects == [by_key["hostpid.hami.io/webhook"]]
    for doc in webhook_objects(docs):
        if doc["kind"] != "MutatingWebhookConfiguration":
            assert doc["metadata"]["namespace"] == namespace


def test_mode_cdi_does_not_skip_pod_security_levels() -> None:
    """The annotation adds no hostPath: baseline and restricted namespaces admit it."""
    keys = {e["key"] for e in configuration(render(RENDERS["cdi"]))["namespaceSelector"][
        "matchExpressions"]}
    assert "pod-security.kubernetes.io/enforce" not in keys


def test_the_webhook_pods_have_nothing_of_the_host_and_no_privilege() -> None:
    docs = render(RENDERS["gate on"])
    deployment = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    spec = deployment["spec"]["template"]["spec"]
    assert not any(spec.get(k) for k in ("hostPID", "hostIPC", "hostNetwork"))
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert all("hostPath" not in v for v in spec["volumes"])
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert container["command"] == ["twistd", "--nodaemon", "--pidfile=", "hostpid-webhook"]
    assert {"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"} in container["env"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["hostpid.hami.io/webhook"] == "disabled", "never sent to itself"
    spread = spec["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"].items() <= labels.items()
    pdb = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = by_kind(docs, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    for broker in (by_kind(docs, "DaemonSet"), *[
            d for d in docs if d["kind"] == "NetworkPolicy"
            and d["metadata"]["name"] != "hostpid-webhook"]):
        broker_kind = broker["kind"]
        selector = (broker["spec"].get("selector") or broker["spec"]["podSelector"])[
            "matchLabels"]
        assert not selector.items() <= labels.items(), f"the {broker_kind} selects webhook pods"


def test_device_classes_get_a_token_and_get_only_on_claims() -> None:
    docs = render(RENDERS["device classes"])
    spec = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "hostpid-webhook"
    assert spec["automountServiceAccountToken"] is True
    (container,) = spec["containers"]
    args = container["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--device-class"] == [
        "gpu.hami.io", "gpu.nvidia.com"]
    assert args[args.index("--claim-lookup-timeout") + 1] == "2.5"
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"
                  and d["metadata"]["name"] == "hostpid-webhook"]
    assert account["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert account["automountServiceAccountToken"] is False
    role = by_kind(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": ["resource.k8s.io"],
                              "resources": ["resourceclaims", "resourceclaimtemplates"],
                              "verbs": ["get"]}]
    binding = by_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hostpid-webhook",
                                    "namespace": RELEASE_NAMESPACE}]
    one = render(merge(RENDERS["device classes"], sets("webhook.timeoutSeconds=1")))
    args = by_kind(one, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--claim-lookup-timeout") + 1] == "0.5"


def test_without_device_classes_no_token_and_no_rbac() -> None:
    docs = render(RENDERS["mounts"])
    spec = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert not {"ClusterRole", "ClusterRoleBinding"} & {d["kind"] for d in docs}
    assert "--device-class" not in spec["containers"][0]["args"]


def test_a_device_class_must_be_a_name() -> None:
    assert "deviceClasses" in str(refusal(sets("webhook.enabled=true",
                                               "webhook.deviceClasses={Not_A_Name}")))


def test_more_namespaces_are_left_out_when_listed() -> None:
    docs = render(sets("webhook.enabled=true", "webhook.excludedNamespaces={gpu-operator,"
                       "nvidia-network-operator}"))
    (names,) = [e["values"] for e in configuration(docs)["namespaceSelector"][
        "matchExpressions"] if e["key"] == "kubernetes.io/metadata.name"]
    assert {"gpu-operator", "nvidia-network-operator", "kube-system"} <= set(names)
    none = render(sets("webhook.enabled=true", "webhook.excludedNamespaces=null"))
    (names,) = [e["values"] for e in configuration(none)["namespaceSelector"][
        "matchExpressions"] if e["key"] == "kubernetes.io/metadata.name"]
    assert "gpu-operator" not in names


def webhook_policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"
                 and d["metadata"]["name"] == "hostpid-webhook"]
    return policy


def test_a_network_policy_admits_only_the_webhooks_port() -> None:
    """
    Any pod could reach the webhook's port and make it work; the policy admits
    that port alone, and only from the API server's addresses when given.
    """
    docs = render(RENDERS["mounts"])
    policy = webhook_policy(docs)
    labels = by_kind(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule == {"ports": [{"protocol": "TCP", "port": "https"}]}
    (container,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert any(p["name"] == "https" for p in container["ports"]), "the port it names"
    limited = webhook_policy(render(sets(
        "webhook.enabled=true", "webhook.apiServerCIDRs={10.0.0.0/24,fd00::/64}")))
    (rule,) = limited["spec"]["ingress"]
    assert rule["from"] == [{"ipBlock": {"cidr": "10.0.0.0/24"}},
                            {"ipBlock": {"cidr": "fd00::/64"}}]
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(policy, version, strict=True)
        kubernetes_validate.validate(limited, version, strict=True)
    off = render(sets("webhook.enabled=true", "networkPolicy.enabled=false"))
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("values, gate", [
    (RENDERS["cdi"], "0"),
    (sets("webhook.enabled=true", "hostPIDBroker.enabled=true"), "0"),
    (RENDERS["gate on"], "1"),
])
def test_the_webhooks_gate(values: dict[str, Any], gate: str) -> None:
    (container,) = by_kind(render(values), "Deployment")["spec"]["template"]["spec"][
        "containers"]
    assert {"name": "LIBVGPU_HOSTPID_BROKER", "value": gate} in container["env"]


def test_the_generated_certificate_names_the_service_and_is_signed_by_the_ca_bundle() -> None:
    docs = render(RENDERS["cdi"])
    secret = by_kind(docs, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    ca_bundle = configuration(docs)["clientConfig"]["caBundle"]
    assert ca_bundle == secret["data"]["ca.crt"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(ca_bundle))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"hostpid-webhook.{RELEASE_NAMESPACE}.svc" in names.get_values_for_type(x509.DNSName)
    (mount,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert mount["secret"]["secretName"] == secret["metadata"]["name"]


def test_an_existing_secret_is_kept(tmp_path: Path) -> None:
    """
    What C{lookup} returns on an upgrade (offline renders get nothing from
    it, so a copy of the chart has it return a Secret) is used as it is.
    """
    copy = tmp_path / "hostpid-broker"
    shutil.copytree(CHART, copy)
    template = copy / "templates" / "webhook-admission.yaml"
    text = template.read_text()
    call = 'lookup "v1" "Secret" $namespace $secretName'
    assert call in text
    template.write_text(text.replace(
        call, '(dict "data" (dict "ca.crt" "S0VQVC1DQQ==" "tls.crt" "S0VQVC1DRVJU" '
              '"tls.key" "S0VQVC1LRVk="))'))
    with helm.Chart.load(copy) as chart:
        rendered = chart.render(RENDERS["cdi"], name="hostpid-broker",
                                namespace=RELEASE_NAMESPACE, is_upgrade=True, is_install=False)
    docs = [d for t, text in rendered.items() if t.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    assert by_kind(docs, "Secret")["data"] == {
        "ca.crt": "S0VQVC1DQQ==", "tls.crt": "S0VQVC1DRVJU", "tls.key": "S0VQVC1LRVk="}
    assert configuration(docs)["clientConfig"]["caBundle"] == "S0VQVC1DQQ=="


@pytest.mark.parametrize("case", ["cert-manager", "cert-manager with an issuer"])
def test_cert_manager_when_asked(case: str) -> None:
    docs = render(RENDERS[case])
    assert [d for d in docs if d["kind"] == "Secret"] == []
    certificate = by_kind(docs, "Certificate")
    assert certificate["spec"]["secretName"] == "hostpid-webhook-tls"
    assert f"hostpid-webhook.{RELEASE_NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    configuration_doc = by_kind(docs, "MutatingWebhookConfiguration")
    assert configuration_doc["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{RELEASE_NAMESPACE}/hostpid-webhook"}
    assert "caBundle" not in configuration(docs)["clientConfig"]
    issuers = [d for d in docs if d["kind"] == "Issuer"]
    if case == "cert-manager":
        assert certificate["spec"]["issuerRef"] == {"name": issuers[0]["metadata"]["name"],
                                                    "kind": "Issuer"}
    else:
        assert issuers == []
        assert certificate["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}


RULES = {
    "mode cdi without the CDI spec": (
        sets("webhook.enabled=true", "webhook.mode=cdi", "broker.cdi.enabled=false"),
        "webhook.mode=cdi requires broker.cdi.enabled=true: the annotation names the device "
        "hami.io/hostpid=broker of the CDI spec the broker writes; set broker.cdi.enabled=true "
        "or webhook.mode=mounts"),
    "the webhook's gate without the broker's": (
        sets("webhook.enabled=true", "webhook.gate=true"),
        "webhook.gate=true requires hostPIDBroker.enabled=true: pods would get the mount of a "
        "broker that serves nothing; turn webhook.gate on after the broker, and off before it "
        "(docs/paths.md)"),
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_a_rule_fails_the_render_naming_both_values(case: str) -> None:
    values, message = RULES[case]
    refused = refusal(values)
    assert isinstance(refused, helm.HelmRenderError)
    assert refused.detail.startswith(
        "execution error at (hostpid-broker/templates/webhook-rules.yaml:")
    assert refused.detail.endswith(f": {message}")


def test_mode_mounts_without_the_cdi_spec_renders() -> None:
    docs = render(sets("webhook.enabled=true", "webhook.mode=mounts", "broker.cdi.enabled=false"))
    assert by_kind(docs, "Deployment")
