"""
The webhook's decision (L{hostpid.admission.decision}) for pods whose GPU
comes from a ResourceClaim (DRA, C{resource.k8s.io/v1}).

Why each check exists:

- what a pod names (L{claim_sources}): a template or a claim per entry,
  never the device class, which only a lookup of that object gives;
- what a looked-up object asks for (L{request_classes}): each request's
  class, every alternative of a C{firstAvailable} request, nothing proven by
  a request that names no class;
- which containers qualify: those naming a claim one of whose requests can
  only be satisfied from the operator's device classes; not a container of
  the same pod that names no claim, not a claim with a class not listed
  among its alternatives, not a claim that was not looked up (its name
  proves nothing), and nothing at all without device classes configured;
- the patch such a pod gets is the one a resource-requesting pod gets, and
  it adds nothing to a container that names no GPU claim.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from test_admission_decision import MOUNTS, broker_mounted, container, pod

from hostpid.admission.decision import (
    NOT_QUALIFYING,
    PATCHED,
    ClaimSource,
    Config,
    claim_sources,
    decide,
    request_classes,
)

GPU_CLASS = "hami-core-gpu.project-hami.io"
NIC_CLASS = "nic.example.com"
DRA = Config(gate=True, mode="mounts", device_classes=(GPU_CLASS,))


def claim_pod(*containers: dict[str, Any]) -> dict[str, Any]:
    result = pod(*containers)
    result["spec"]["resourceClaims"] = [
        {"name": "gpu", "resourceClaimTemplateName": "single-gpu"},
        {"name": "shared", "resourceClaimName": "team-gpu"},
        {"name": "broken"},
    ]
    return result


def uses(name: str, *claims: str) -> dict[str, Any]:
    return container(name, gpu=None, resources={"claims": [{"name": c} for c in claims]})


def template(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "spec": {"spec": {"devices": {"requests": list(requests)}}}}


def exactly(device_class: str) -> dict[str, Any]:
    return {"name": "r", "exactly": {"deviceClassName": device_class}}


def test_claim_sources_are_what_a_lookup_reads() -> None:
    assert claim_sources(claim_pod()) == (
        ClaimSource("gpu", "ResourceClaimTemplate", "single-gpu"),
        ClaimSource("shared", "ResourceClaim", "team-gpu"),
    )
    assert claim_sources(pod(container("c"))) == ()
    assert claim_sources({"spec": {"resourceClaims": [7, {"name": 3}]}}) == ()


def test_request_classes() -> None:
    assert request_classes(template(exactly(GPU_CLASS))) == (frozenset({GPU_CLASS}),)
    claim = {"kind": "ResourceClaim", "spec": {"devices": {"requests": [
        exactly(NIC_CLASS),
        {"name": "any", "firstAvailable": [{"name": "a", "deviceClassName": GPU_CLASS},
                                           {"name": "b", "deviceClassName": NIC_CLASS}]},
        {"name": "nothing", "firstAvailable": [{"name": "a"}]},
    ]}}}
    assert request_classes(claim) == (frozenset({NIC_CLASS}),
                                      frozenset({GPU_CLASS, NIC_CLASS}), frozenset())
    assert request_classes({}) == ()


def lookups(**objects: dict[str, Any]) -> dict[str, tuple[frozenset[str], ...]]:
    return {name: request_classes(obj) for name, obj in objects.items()}


def test_container_naming_a_gpu_claim_qualifies() -> None:
    original = claim_pod(uses("cuda", "gpu"), uses("sidecar"))
    decision = decide(original, DRA, lookups(gpu=template(exactly(GPU_CLASS))))
    assert decision.outcome == PATCHED
    result = jsonpatch.apply_patch(copy.deepcopy(original), list(decision.patch))
    cuda, sidecar = result["spec"]["containers"]
    assert broker_mounted(cuda) and not broker_mounted(sidecar)


@pytest.mark.parametrize("config,found", [
    pytest.param(DRA, {}, id="not-looked-up"),
    pytest.param(MOUNTS, lookups(gpu=template(exactly(GPU_CLASS))), id="no-device-classes"),
    pytest.param(DRA, lookups(gpu=template(exactly(NIC_CLASS))), id="class-not-listed"),
    pytest.param(DRA, lookups(gpu=template(
        {"name": "r", "firstAvailable": [{"name": "a", "deviceClassName": GPU_CLASS},
                                         {"name": "b", "deviceClassName": NIC_CLASS}]})),
        id="an-alternative-not-listed"),
    pytest.param(DRA, lookups(shared=template(exactly(GPU_CLASS))), id="claim-not-used"),
])
def test_what_does_not_qualify(config: Config, found: dict[str, Any]) -> None:
    decision = decide(claim_pod(uses("cuda", "gpu")), config, found)
    assert decision.outcome == NOT_QUALIFYING and decision.patch == ()


def test_one_gpu_request_among_others_is_enough() -> None:
    found = lookups(shared={"kind": "ResourceClaim", "spec": {"devices": {"requests": [
        exactly(NIC_CLASS), exactly(GPU_CLASS)]}}})
    decision = decide(claim_pod(uses("cuda", "shared")), DRA, found)
    assert decision.outcome == PATCHED
