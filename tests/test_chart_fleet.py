"""
The chart on a fleet, rendered by Helm's own engine (L{test_chart.render}):

- which nodes its two DaemonSets select: GPU nodes labelled by HAMi
  (C{gpu: "on"}) or by NVIDIA's GPU feature discovery
  (C{nvidia.com/gpu.present: "true"}) or by the operator's own label
  (C{gpuNodes}, ORed), ANDed with C{nodeSelector} and the operator's own
  required node affinity.  A node's selection is decided here as the
  scheduler decides it for these fields (L{selects}); the cluster tier's
  fleet (C{tests/cluster/test_fleet.py}) shows the real scheduler placing
  the pods on both kinds of node;
- the rollout's surge, an operator's value for both DaemonSets (a count or
  a percentage), always with C{maxUnavailable: 0};
- the NOTES' warning that a DaemonSet no node matches wants 0 pods.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_chart import merge, notes, refusal, render, sets

ON = sets("nri.enabled=true")
HAMI = {"gpu": "on", "kubernetes.io/os": "linux"}
NVIDIA = {"nvidia.com/gpu.present": "true", "kubernetes.io/os": "linux"}
PLAIN = {"kubernetes.io/os": "linux"}


def daemonsets(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    docs = render(merge(ON, values or {}))
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "DaemonSet"}


def _expression(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    values = expression.get("values", [])
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise AssertionError(f"operator {operator!r} is not one the chart renders")


def selects(daemonset: dict[str, Any], labels: dict[str, str]) -> bool:
    """
    Whether a node with C{labels} is one the DaemonSet wants, by the rules
    of the pod's C{nodeSelector} (every label) and its required node
    affinity (any term; every expression of a term).
    """
    spec = daemonset["spec"]["template"]["spec"]
    if not all(labels.get(k) == v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = (spec.get("affinity", {}).get("nodeAffinity", {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is None:
        return True
    return any(all(_expression(e, labels) for e in term.get("matchExpressions", []))
               for term in required["nodeSelectorTerms"])


def test_gpu_nodes_are_found_by_hamis_label_or_nvidias() -> None:
    """
    With the defaults both DaemonSets want a node NVIDIA's feature discovery
    labelled, as well as one HAMi's chart labelled; not a node with
    neither.  (The former C{nodeSelector: {gpu: "on"}} wanted 0 pods on a
    fleet labelled by NVIDIA.)
    """
    for name, ds in daemonsets().items():
        assert selects(ds, HAMI), name
        assert selects(ds, NVIDIA), (name, ds["spec"]["template"]["spec"])
        assert not selects(ds, PLAIN), name
        assert not selects(ds, {**PLAIN, "gpu": "off"}), name


def test_an_operators_own_gpu_label_is_one_more_choice() -> None:
    own = {"gpuNodes": [{"gpu": "on"}, {"nvidia.com/gpu.present": "true"},
                        {"node.example.com/accelerator": "nvidia", "pool": "train"}]}
    for name, ds in daemonsets(own).items():
        for labels in (HAMI, NVIDIA,
                       {**PLAIN, "node.example.com/accelerator": "nvidia", "pool": "train"}):
            assert selects(ds, labels), (name, labels)
        # Every label of the operator's map, not one of them.
        assert not selects(ds, {**PLAIN, "node.example.com/accelerator": "nvidia"}), name


def test_the_operators_affinity_and_node_selector_are_anded_with_the_gpu_labels() -> None:
    """
    The operator's own required terms (here: a pool, or a zone) each paired
    with each GPU label; nodeSelector on top: a GPU node outside them is
    not wanted, a non-GPU node inside them neither.
    """
    values = {
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
            ]}}},
    }
    for name, ds in daemonsets(values).items():
        terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert len(terms) == 4, terms
        assert selects(ds, {**NVIDIA, "pool": "a"}), name
        assert selects(ds, {**HAMI, "zone": "z1"}), name
        assert not selects(ds, {**NVIDIA, "pool": "b"}), name
        assert not selects(ds, {**PLAIN, "pool": "a", "zone": "z1"}), name
        assert not selects(ds, {"gpu": "on", "pool": "a"}), name
        # The operator's values are not changed by the render.
        assert values["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"][0]["matchExpressions"] == [
                {"key": "pool", "operator": "In", "values": ["a"]}]


def test_no_gpu_labels_leaves_the_operators_selection_alone() -> None:
    for name, ds in daemonsets({"gpuNodes": [], "nodeSelector": {"pool": "gpu"}}).items():
        assert "affinity" not in ds["spec"]["template"]["spec"], name
        assert selects(ds, {"pool": "gpu"}) and not selects(ds, HAMI), name


@pytest.mark.parametrize("values", [{"gpuNodes": [{}]}, {"gpuNodes": [{"gpu": True}]},
                                    {"gpuNodes": {"gpu": "on"}}])
def test_schema_refuses_a_gpu_nodes_value_that_selects_nothing_or_is_not_labels(
        values: dict[str, Any]) -> None:
    assert "gpuNodes" in str(refusal(values))


def test_both_daemonsets_surge_ten_percent_of_the_fleet_by_default_never_unavailable() -> None:
    for name, ds in daemonsets().items():
        assert ds["spec"]["updateStrategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0}}, name


@pytest.mark.parametrize("surge", [1, 25, "5%", "100%"])
def test_the_surge_is_an_operators_value_for_both(surge: int | str) -> None:
    found = daemonsets({"nri": {"maxSurge": surge},
                        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {
                            "maxUnavailable": 0, "maxSurge": surge}}})
    for name, ds in found.items():
        assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {
            "maxSurge": surge, "maxUnavailable": 0}, name


def test_a_release_without_the_value_keeps_the_former_surge_of_one() -> None:
    """
    C{helm upgrade --reuse-values} from a chart without C{nri.maxSurge}
    reuses the old release's values, where the key is absent: the former 1.
    """
    values = render(merge(ON, {"nri": {"maxSurge": None}}))
    (ds,) = [d for d in values if d["kind"] == "DaemonSet"
             and d["metadata"]["name"] == "hostpid-nri"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize("surge", [0, "0%", "150%", "ten", -1])
def test_schema_refuses_a_plugin_surge_that_is_not_surge_first(surge: int | str) -> None:
    assert "maxSurge" in str(refusal(merge(ON, {"nri": {"maxSurge": surge}})))


def test_notes_warn_that_a_daemonset_no_node_matches_wants_zero_pods() -> None:
    text = notes()
    assert "wants 0 pods, and rollout status reports success" in text
    assert "gpu=on OR nvidia.com/gpu.present=true" in text
    assert ("get daemonset -l app.kubernetes.io/instance=hostpid-broker \\\n"
            "       -o custom-columns=NAME:.metadata.name,"
            "DESIRED:.status.desiredNumberScheduled") in text
    assert "and of nodeSelector" in notes({"nodeSelector": {"pool": "gpu"}})
    assert "none: gpuNodes is empty" in notes({"gpuNodes": []})


def test_the_documented_group_first_releases_split_the_gpu_nodes() -> None:
    """
    docs/rollout.md, "A group of nodes first": the main release's affinity
    leaves the nodes labelled canary-only; the canary release takes the
    nodes labelled canary; a node labelled canary alone has both (the
    handover's moment), one labelled both has the canary's alone.
    """
    main = daemonsets({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "hostpid.hami.io/canary-only",
                                   "operator": "DoesNotExist"}]}]}}}})
    canary = daemonsets({"hostPIDBroker": {"enabled": True},
                         "nodeSelector": {"hostpid.hami.io/canary": "true"}})
    moving = {**NVIDIA, "hostpid.hami.io/canary": "true"}
    moved = {**moving, "hostpid.hami.io/canary-only": "true"}
    for name in ("hostpid-broker", "hostpid-nri"):
        assert selects(main[name], NVIDIA) and not selects(canary[name], NVIDIA), name
        assert selects(main[name], moving) and selects(canary[name], moving), name
        assert not selects(main[name], moved) and selects(canary[name], moved), name
        assert not selects(canary[name], {**PLAIN, "hostpid.hami.io/canary": "true"}), name
