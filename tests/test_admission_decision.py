"""
The webhook's pure decision (L{hostpid.admission.decision}): Pods in, JSON
Patches out, applied with a real RFC 6902 implementation (C{jsonpatch}) and
the result validated as a Pod (C{kubernetes-validate}, strict) for the
supported Kubernetes versions.

Why each check exists:

- Which pods qualify (requests or limits, containers or init containers) and
  what each mode adds; the mounts are exactly L{canonical_mounts}' (parent
  first, broker read-only) and the design's workload rules hold
  (L{test_deploy.pod_rule_violations}).
- Idempotency: the patched pod, and a pod that already has HAMi's own
  mounts and gate, give no patch; generated pods (hypothesis) keep every
  unrelated volume, mount, variable and annotation unchanged.
- The boundary: a pod that does not qualify loses the broker's annotation;
  the gate off patches nothing else; a pod whose own mount covers a reserved
  path is admitted unpatched with a warning naming the volume.
- JSON Pointer escaping: the annotation key holds C{/}; a missing
  C{metadata}, C{annotations}, C{volumes}, C{volumeMounts} or C{env} is
  added whole.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate.utils as kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_deploy import KUBERNETES_VERSIONS, pod_rule_violations

from hostpid.admission.decision import (
    ANNOTATION_KEY,
    ANNOTATION_REMOVED,
    ANNOTATION_VALUE,
    ANNOTATIONS_LIMIT,
    BROKER_VOLUME,
    GATE_OFF,
    LOCK_PARENT_VOLUME,
    MAX_WARNINGS,
    NOT_QUALIFYING,
    OVERSIZED,
    PATCHED,
    SHADOWED,
    UNCHANGED,
    USERNS_SYS_ADMIN,
    Config,
    Decision,
    annotations_size,
    clip,
    decide,
    pointer,
)
from hostpid.node.allocation import canonical_mounts

GPU = "nvidia.com/gpu"
CDI = Config(gate=True, mode="cdi")
MOUNTS = Config(gate=True, mode="mounts")


def container(name: str, gpu: str | None = "limits", **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "image": "registry.example.com/cuda:12"}
    if gpu:
        out["resources"] = {gpu: {GPU: "1"}}
    out.update(more)
    return out


def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (),
        **metadata: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "spec": spec}
    out["metadata"] = {"name": "p", "namespace": "team", **metadata}
    return out


def hami_pod() -> dict[str, Any]:
    """A pod as HAMi's own device plugin leaves it: its volumes, mounts and gate."""
    result = pod(container(
        "cuda",
        env=[{"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"}],
        volumeMounts=[{"name": "vgpulock", "mountPath": "/tmp/vgpulock"},
                      {"name": "hami-hostpid", "mountPath": "/tmp/vgpulock/hostpid",
                       "readOnly": True}],
    ))
    result["spec"]["volumes"] = [
        {"name": "vgpulock", "hostPath": {"path": "/tmp/vgpulock"}},
        {"name": "hami-hostpid", "hostPath": {"path": "/var/run/hami/hostpid/"}},
    ]
    return result


def applied(original: dict[str, Any], config: Config) -> tuple[dict[str, Any], Any]:
    decision = decide(original, config)
    before = copy.deepcopy(original)
    result = jsonpatch.apply_patch(original, list(decision.patch))
    assert original == before, "the decision never changes its input"
    return result, decision


def valid(result: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(result, version, strict=True)
    assert pod_rule_violations(result["spec"], "patched pod") == []


def broker_mounted(spec_container: dict[str, Any]) -> bool:
    mounts = [(m["mountPath"], m["name"], m.get("readOnly", False))
              for m in spec_container.get("volumeMounts", [])]
    env = spec_container.get("env", [])
    return mounts[-2:] == [("/tmp/vgpulock", LOCK_PARENT_VOLUME, False),
                           ("/tmp/vgpulock/hostpid", BROKER_VOLUME, True)] and \
        {"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"} in env


def test_pointer_escapes_tilde_then_slash() -> None:
    assert pointer("metadata", "annotations", "cdi.k8s.io/a~b") == \
        "/metadata/annotations/cdi.k8s.io~1a~0b"
    assert pointer("spec", "containers", 3, "env", "-") == "/spec/containers/3/env/-"


def test_the_annotation_names_the_brokers_cdi_device() -> None:
    assert ANNOTATION_KEY == "cdi.k8s.io/hostpid-broker"
    assert ANNOTATION_VALUE == "hami.io/hostpid=broker"


@pytest.mark.parametrize("where", ["limits", "requests"])
def test_cdi_mode_annotates_a_gpu_pod(where: str) -> None:
    result, decision = applied(pod(container("cuda", where)), CDI)
    assert decision.outcome == PATCHED and decision.warnings == ()
    assert result["metadata"]["annotations"] == {ANNOTATION_KEY: ANNOTATION_VALUE}
    assert decision.patch == ({"op": "add", "path": "/metadata/annotations",
                               "value": {ANNOTATION_KEY: ANNOTATION_VALUE}},)
    valid(result)


def test_cdi_mode_adds_one_key_beside_other_annotations_escaped() -> None:
    original = pod(container("cuda"), annotations={"example.com/owner": "ml"})
    result, decision = applied(original, CDI)
    assert decision.patch == ({"op": "add",
                               "path": "/metadata/annotations/cdi.k8s.io~1hostpid-broker",
                               "value": ANNOTATION_VALUE},)
    assert result["metadata"]["annotations"] == {"example.com/owner": "ml",
                                                 ANNOTATION_KEY: ANNOTATION_VALUE}


def test_cdi_mode_adds_metadata_when_there_is_none() -> None:
    original = pod(container("cuda"))
    del original["metadata"]
    result, decision = applied(original, CDI)
    assert result["metadata"] == {"annotations": {ANNOTATION_KEY: ANNOTATION_VALUE}}


def test_cdi_mode_corrects_a_wrong_value_of_its_own_key() -> None:
    original = pod(container("cuda"), annotations={ANNOTATION_KEY: "hami.io/hostpid=other"})
    result, decision = applied(original, CDI)
    assert decision.outcome == PATCHED
    assert result["metadata"]["annotations"] == {ANNOTATION_KEY: ANNOTATION_VALUE}


@pytest.mark.parametrize("config", [CDI, MOUNTS], ids=["cdi", "mounts"])
def test_reinvocation_is_unchanged(config: Config) -> None:
    once, _ = applied(pod(container("a"), container("b", "requests"), container("c", None),
                          init=(container("i"),)), config)
    twice, decision = applied(once, config)
    assert decision.outcome == UNCHANGED and decision.patch == () and twice == once


def test_mounts_mode_gives_each_qualifying_container_the_canonical_mounts() -> None:
    original = pod(container("a"), container("sidecar", None), container("b", "requests"),
                   init=(container("i", env=[{"name": "OTHER", "value": "x"}]),
                         container("plain-init", None)))
    result, decision = applied(original, MOUNTS)
    assert decision.outcome == PATCHED
    spec = result["spec"]
    assert [broker_mounted(c) for c in spec["containers"]] == [True, False, True]
    assert [broker_mounted(c) for c in spec["initContainers"]] == [True, False]
    assert spec["containers"][1] == original["spec"]["containers"][1]
    assert spec["initContainers"][0]["env"][0] == {"name": "OTHER", "value": "x"}
    ours = {v["name"]: v["hostPath"] for v in spec["volumes"]}
    canonical = canonical_mounts(True)
    assert ours == {LOCK_PARENT_VOLUME: {"path": canonical[0].host_path, "type": "Directory"},
                    BROKER_VOLUME: {"path": canonical[1].host_path, "type": "Directory"}}
    valid(result)


def test_mounts_mode_uses_the_configured_host_paths() -> None:
    config = Config(gate=True, mode="mounts", lock_parent="/var/tmp/vgpulock",
                    broker_dir="/run/hostpid")
    result, _ = applied(pod(container("a")), config)
    assert {v["hostPath"]["path"] for v in result["spec"]["volumes"]} == \
        {"/var/tmp/vgpulock", "/run/hostpid"}


def test_a_stale_gate_value_is_replaced_not_duplicated() -> None:
    original = pod(container("a", env=[{"name": "LIBVGPU_HOSTPID_BROKER", "value": "0"},
                                       {"name": "KEEP", "value": "1"}]))
    result, _ = applied(original, MOUNTS)
    assert result["spec"]["containers"][0]["env"][:2] == [
        {"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"}, {"name": "KEEP", "value": "1"}]


def test_a_pod_with_hamis_own_mounts_and_gate_is_left_as_it_is() -> None:
    result, decision = applied(hami_pod(), MOUNTS)
    assert decision.outcome == UNCHANGED and decision.patch == ()


def test_a_non_gpu_pod_is_not_touched() -> None:
    for config in (CDI, MOUNTS):
        decision = decide(pod(container("web", None)), config)
        assert (decision.patch, decision.outcome) == ((), NOT_QUALIFYING)


def test_other_resources_qualify_when_configured() -> None:
    hami = Config(gate=True, resources=("nvidia.com/gpumem", "nvidia.com/gpucores"))
    gpumem = pod({"name": "a", "image": "x", "resources": {"limits": {"nvidia.com/gpumem": "4k"}}})
    assert decide(gpumem, hami).outcome == PATCHED
    assert decide(gpumem, CDI).outcome == NOT_QUALIFYING


@pytest.mark.parametrize("config", [CDI, MOUNTS, Config(), Config(mode="mounts")],
                         ids=["cdi", "mounts", "cdi gate off", "mounts gate off"])
def test_a_non_gpu_pod_carrying_the_annotation_loses_it(config: Config) -> None:
    original = pod(container("web", None), annotations={ANNOTATION_KEY: ANNOTATION_VALUE,
                                                        "keep": "me"})
    result, decision = applied(original, config)
    assert decision.outcome == ANNOTATION_REMOVED
    assert result["metadata"]["annotations"] == {"keep": "me"}
    assert ANNOTATION_KEY in decision.warnings[0]
    valid(result)


@pytest.mark.parametrize("mode", ["cdi", "mounts"])
def test_gate_off_patches_nothing(mode: str) -> None:
    decision = decide(pod(container("cuda")), Config(mode=mode))
    assert (decision.patch, decision.outcome) == ((), GATE_OFF)


def test_gate_off_removes_the_annotation_it_gave() -> None:
    annotated, _ = applied(pod(container("cuda")), CDI)
    result, decision = applied(annotated, Config(mode="cdi"))
    assert decision.outcome == ANNOTATION_REMOVED and result["metadata"]["annotations"] == {}


@pytest.mark.parametrize("path", ["/tmp/vgpulock", "/tmp/vgpulock/hostpid",
                                  "/tmp/vgpulock/hostpid/broker.sock", "//tmp/./vgpulock/"])
@pytest.mark.parametrize("config", [CDI, MOUNTS], ids=["cdi", "mounts"])
def test_a_shadowing_volume_is_named_and_the_pod_admitted_unpatched(
        path: str, config: Config) -> None:
    original = pod(container("cuda", volumeMounts=[{"name": "scratch", "mountPath": path}]))
    original["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    decision = decide(original, config)
    assert (decision.patch, decision.outcome) == ((), SHADOWED)
    (warning,) = decision.warnings
    assert "'scratch'" in warning and "shadow" in warning


def test_a_mount_inside_the_lock_parent_does_not_shadow() -> None:
    original = pod(container("cuda", volumeMounts=[{"name": "lock", "mountPath":
                                                    "/tmp/vgpulock/0.lock"}]))
    original["spec"]["volumes"] = [{"name": "lock", "emptyDir": {}}]
    assert decide(original, MOUNTS).outcome == PATCHED


def test_a_pod_volume_holding_the_webhooks_volume_name_is_named() -> None:
    original = pod(container("cuda"))
    original["spec"]["volumes"] = [{"name": LOCK_PARENT_VOLUME, "emptyDir": {}}]
    decision = decide(original, MOUNTS)
    assert decision.outcome == SHADOWED and LOCK_PARENT_VOLUME in decision.warnings[0]


# --- generated pods: unrelated parts never change, reinvocation is a no-op ------------

names = st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True)
env_entries = st.lists(st.builds(lambda n, v: {"name": n.upper(), "value": v}, names, names),
                       max_size=3, unique_by=lambda e: e["name"])
safe_paths = st.sampled_from(["/data", "/tmp", "/tmp/vgpulock/0.lock", "/models", "/var/x"])


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    volume_names = draw(st.lists(names, max_size=3, unique=True))
    def one(prefix: str, index: int) -> dict[str, Any]:
        gpu = draw(st.sampled_from([None, "limits", "requests"]))
        extra: dict[str, Any] = {}
        if draw(st.booleans()):
            extra["env"] = draw(env_entries)
        if volume_names and draw(st.booleans()):
            chosen = draw(st.lists(st.sampled_from(volume_names), max_size=2, unique=True))
            extra["volumeMounts"] = [{"name": n, "mountPath": draw(safe_paths) + "/" + n}
                                     for n in chosen]
        return container(f"{prefix}{index}", gpu, **extra)
    result = pod(*[one("c", i) for i in range(draw(st.integers(1, 3)))],
                 init=tuple(one("i", i) for i in range(draw(st.integers(0, 2)))))
    if draw(st.booleans()):
        result["metadata"]["annotations"] = draw(st.dictionaries(
            names.map(lambda n: f"example.com/{n}"), names, max_size=2))
    if volume_names:
        result["spec"]["volumes"] = [{"name": n, "emptyDir": {}} for n in volume_names]
    return result


def unrelated(p: dict[str, Any]) -> Any:
    annotations = {k: v for k, v in p.get("metadata", {}).get("annotations", {}).items()
                   if k != ANNOTATION_KEY}
    volumes = [v for v in p["spec"].get("volumes", [])
               if v["name"] not in (LOCK_PARENT_VOLUME, BROKER_VOLUME)]
    containers = []
    for field in ("initContainers", "containers"):
        for c in p["spec"].get(field, []):
            containers.append((
                c["name"],
                [m for m in c.get("volumeMounts", [])
                 if m["name"] not in (LOCK_PARENT_VOLUME, BROKER_VOLUME)],
                [e for e in c.get("env", []) if e["name"] != "LIBVGPU_HOSTPID_BROKER"],
            ))
    return annotations, volumes, containers


@settings(max_examples=150, deadline=None)
@given(pods(), st.sampled_from([CDI, MOUNTS, Config(), Config(mode="mounts")]))
def test_generated_pods_keep_everything_unrelated_and_settle(
        original: dict[str, Any], config: Config) -> None:
    result, decision = applied(original, config)
    assert unrelated(result) == unrelated(original)
    again = decide(result, config)
    assert again.patch == ()
    for field in ("initContainers", "containers"):
        for c in result["spec"].get(field, []):
            qualifies = "resources" in c
            if config.gate and config.mode == "mounts":
                assert broker_mounted(c) == qualifies
            else:
                assert "volumeMounts" not in c or not any(
                    m["name"] in (LOCK_PARENT_VOLUME, BROKER_VOLUME) for m in c["volumeMounts"])
    annotated = ANNOTATION_KEY in result["metadata"].get("annotations", {})
    assert annotated == (config.gate and config.mode == "cdi" and decision.outcome == PATCHED)


# --- bounds: whatever the pod supplies, the answer and the log stay small ----------


def test_zero_amounts_do_not_qualify() -> None:
    for where in ("requests", "limits"):
        for amount in ("0", "0.0", "00", "0Gi", 0):
            zero = pod({"name": "cuda", "image": "x", "resources": {where: {GPU: amount}}})
            assert decide(zero, MOUNTS).outcome == NOT_QUALIFYING, (where, amount)
    # One container asking for none, another for one: the pod qualifies,
    # and only the one asking gets the broker.
    both = pod({"name": "a", "image": "x", "resources": {"limits": {GPU: "0"}}},
               container("b"))
    result, decision = applied(both, MOUNTS)
    assert decision.outcome == PATCHED
    assert [broker_mounted(c) for c in result["spec"]["containers"]] == [False, True]


def test_warnings_are_few_and_clip_what_the_pod_supplies() -> None:
    mounts = [{"name": "v" * 5000 + str(i), "mountPath": f"/tmp/vgpulock/hostpid/{'p' * 5000}{i}"}
              for i in range(2000)]
    decision = decide(pod(container("n" * 100_000, volumeMounts=mounts)), MOUNTS)
    assert decision.outcome == SHADOWED
    assert len(decision.warnings) == MAX_WARNINGS
    assert decision.warnings[-1] == f"and {2000 - MAX_WARNINGS + 1:,} more"
    assert all(len(w) < 600 for w in decision.warnings), [len(w) for w in decision.warnings]
    assert "(100,000 characters)" in decision.warnings[0]


def test_a_patch_past_its_bound_is_not_given() -> None:
    many = pod(*[container(f"c{i}") for i in range(400)])
    decision = decide(many, MOUNTS)
    assert decision.outcome == OVERSIZED and decision.patch == ()
    assert "400 qualifying containers" in decision.warnings[0]
    few = pod(*[container(f"c{i}") for i in range(20)])
    assert decide(few, MOUNTS).outcome == PATCHED


def test_cdi_keeps_the_annotations_within_the_api_servers_limit() -> None:
    def with_annotations(size: int, key: str = "k") -> dict[str, Any]:
        p = pod(container("cuda"))
        p["metadata"]["annotations"] = {key: "é" * ((size - len(key)) // 2)}
        assert annotations_size(p["metadata"]["annotations"]) == size
        return p
    added = len(ANNOTATION_KEY) + len(ANNOTATION_VALUE)
    assert decide(with_annotations(ANNOTATIONS_LIMIT - added), CDI).outcome == PATCHED
    over = decide(with_annotations(ANNOTATIONS_LIMIT - added + 2), CDI)
    assert over.outcome == OVERSIZED and over.patch == () and "256 KiB" in over.warnings[0]
    # Its own key with a wrong value is replaced, not added: only the
    # difference of the values counts.
    near = with_annotations(ANNOTATIONS_LIMIT - 3)
    near["metadata"]["annotations"][ANNOTATION_KEY] = "x"
    assert annotations_size(near["metadata"]["annotations"]) > ANNOTATIONS_LIMIT - added
    assert decide(near, CDI).outcome == OVERSIZED


def test_clip_names_the_length_and_only_the_type_of_anything_else() -> None:
    assert clip("short") == "short"
    assert clip("x" * 1000) == "x" * 64 + "...(1,000 characters)"
    assert clip({"a": "b" * 10**6}) == "<dict>" and clip(None) == "<none>"


@pytest.mark.parametrize("security", [
    {"capabilities": {"add": ["SYS_ADMIN"]}},
    {"capabilities": {"add": ["NET_ADMIN", "sys_admin"]}},
    {"capabilities": {"add": ["ALL"]}},
    {"privileged": True},
], ids=["sys_admin", "lower-case", "all", "privileged"])
@pytest.mark.parametrize("where", ["qualifying", "sidecar", "init"])
def test_a_user_namespaced_pod_that_can_remount_gets_no_broker_volume(
        security: dict[str, Any], where: str) -> None:
    """
    The kubelet idmaps a hostPath for a pod with C{hostUsers: false}, and
    through an idmapped broker mount such a pod's root, with C{CAP_SYS_ADMIN}
    in its namespace, remounts it writable and replaces the node's socket
    (tests/integration/test_userns_pod.py measures it): in mode mounts the
    pod is admitted as it is, with a warning naming the container.
    """
    cuda = container("cuda")
    other = container("helper", gpu=None, securityContext=security)
    if where == "qualifying":
        cuda["securityContext"] = security
        original = pod(cuda)
    elif where == "sidecar":
        original = pod(cuda, other)
    else:
        original = pod(cuda, init=(other,))
    original["spec"]["hostUsers"] = False
    decision = decide(original, MOUNTS)
    assert (decision.patch, decision.outcome) == ((), USERNS_SYS_ADMIN)
    (warning,) = decision.warnings
    assert "hostUsers: false" in warning and "docs/userns.md" in warning
    assert ("cuda" if where == "qualifying" else "helper") in warning


def test_the_remounting_rule_spares_other_pods() -> None:
    """
    Without C{hostUsers: false} (the host's user namespace, where a pod's
    root is the host's anyway), without a remounting capability, or in mode
    cdi (the runtime's CDI mounts are not the kubelet's idmapped volumes),
    the pod gets the broker as before.
    """
    admin = container("cuda", securityContext={"capabilities": {"add": ["SYS_ADMIN"]}})
    in_host_userns = pod(admin)
    assert decide(in_host_userns, MOUNTS).outcome == PATCHED
    in_host_userns["spec"]["hostUsers"] = True
    assert decide(in_host_userns, MOUNTS).outcome == PATCHED
    plain = pod(container("cuda", securityContext={"capabilities": {"add": ["NET_RAW"],
                                                                      "drop": ["ALL"]}}))
    plain["spec"]["hostUsers"] = False
    assert decide(plain, MOUNTS).outcome == PATCHED
    user_namespaced = pod(admin)
    user_namespaced["spec"]["hostUsers"] = False
    assert decide(user_namespaced, CDI).outcome == PATCHED


@pytest.mark.parametrize("security", [
    {"capabilities": {"add": ["SYS_ADMIN"]}},
    {"capabilities": {"add": ["ALL"]}},
    {"privileged": True},
], ids=["sys_admin", "all", "privileged"])
@pytest.mark.parametrize("where", ["qualifying", "sidecar", "init"])
def test_reinvoked_after_a_later_webhook_made_it_remounting_it_takes_its_volumes_back(
        security: dict[str, Any], where: str) -> None:
    """
    The webhook patched a user-namespaced pod; a later webhook then gave one
    of its containers C{SYS_ADMIN}, C{ALL} or privilege, and the API server
    reinvokes this one (C{reinvocationPolicy: IfNeeded}).  It removes the
    volumes, mounts and gate it added, and nothing of the pod's own: the pod
    ends as a first call on it would have left it (once an empty patch, and
    the broker's volume stayed).
    """
    own_env = [{"name": "OTHER", "value": "x"}]
    own_mount = {"name": "scratch", "mountPath": "/scratch"}
    cuda = container("cuda", env=list(own_env), volumeMounts=[dict(own_mount)])
    helper = container("helper", gpu=None, env=list(own_env))
    second = container("second", "requests")
    initial = pod(cuda, helper, second, init=(container("i", None),))
    initial["spec"]["hostUsers"] = False
    initial["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    patched, first = applied(initial, MOUNTS)
    assert first.outcome == PATCHED
    later = copy.deepcopy(patched)
    spec = later["spec"]
    target = {"qualifying": spec["containers"][0], "sidecar": spec["containers"][1],
              "init": spec["initContainers"][0]}[where]
    target["securityContext"] = security
    result, again = applied(later, MOUNTS)
    assert again.outcome == USERNS_SYS_ADMIN and again.patch
    (warning,) = again.warnings
    assert warning.startswith("hostpid broker removed: ") and "docs/userns.md" in warning
    expected = copy.deepcopy(initial)
    {"qualifying": expected["spec"]["containers"][0],
     "sidecar": expected["spec"]["containers"][1],
     "init": expected["spec"]["initContainers"][0]}[where]["securityContext"] = security
    # The webhook's own additions of empty lists stay as empty lists.
    for field, index in (("containers", 2),):
        expected["spec"][field][index].setdefault("volumeMounts", [])
        expected["spec"][field][index].setdefault("env", [])
    assert result == expected
    valid(result)
    # A third call changes nothing more.
    assert decide(result, MOUNTS) == Decision((), (warning.replace("removed", "not added"),),
                                              USERNS_SYS_ADMIN)


def test_the_removal_leaves_a_volume_of_its_name_with_another_path() -> None:
    original = pod(container("cuda", securityContext={"privileged": True},
                             volumeMounts=[{"name": BROKER_VOLUME, "mountPath": "/data"}]))
    original["spec"]["hostUsers"] = False
    original["spec"]["volumes"] = [{"name": BROKER_VOLUME, "hostPath": {"path": "/srv/data"}}]
    decision = decide(original, MOUNTS)
    assert decision.patch == ()
