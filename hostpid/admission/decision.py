"""
The webhook's decision: a Pod in, an RFC 6902 JSON Patch and warnings out.

Pure, like L{hostpid.wire}: no Twisted, no sockets, no clock.  The service
(L{hostpid.admission.service}) only decodes, calls L{decide} and encodes.

Which pods: a pod any of whose containers or init containers requests or
limits one of L{Config.resources}.  Only those get the broker; the design's
boundary is "the socket is available only to workloads that receive the
allocation mount", so a pod that does not qualify but names the broker's
CDI device itself loses that annotation.

PODS WHOSE GPU COMES FROM A RESOURCECLAIM (DRA, C{resource.k8s.io/v1}), and
what the webhook can know at admission, before the scheduler allocates:

 - a pod names its claims only (C{spec.resourceClaims[]}: a
   C{resourceClaimTemplateName} or a C{resourceClaimName}) and each
   container names the pod's claims it uses (C{resources.claims[].name}).
   The device class, the one thing that says "GPU", is in the template's
   or the claim's object, not in the pod: reading it needs an API lookup
   of that object (L{claim_sources} says which, L{request_classes} reads
   it; the lookup is the caller's I/O), and which device the scheduler
   picks is known to nobody yet.  A class the operator lists
   (L{Config.device_classes}) is the signal: a request that can only be
   satisfied from listed classes gives its container a GPU, or the pod
   never runs.  Names alone (of the claim, the template, the request) are
   the pod's author's choice and prove nothing: without the lookup a
   container qualifies by its resources only;
 - a DeviceClass with C{extendedResourceName} (HAMi's chart sets
   C{nvidia.com/gpu}: the DRAExtendedResource feature) lets a pod ask for
   the extended resource itself; such a pod qualifies by
   L{Config.resources} as any other, and the scheduler makes its claim;
 - the node knows for certain: the NRI plugin sees the device nodes the
   driver's CDI edits inject (C{hostpid.nri.decision}), with no lookup.

Two modes:

 - C{mounts}: each qualifying container gets what C{hostpid allocate} gives
   a kubelet allocation (L{hostpid.node.allocation.canonical_mounts}): the
   writable lock parent at C{/tmp/vgpulock}, then the read-only broker
   directory at C{/tmp/vgpulock/hostpid}, and C{LIBVGPU_HOSTPID_BROKER=1}.
   The pod gets two C{hostPath} volumes (type C{Directory}: the broker's
   DaemonSet prepares both paths, and a kubelet that created a missing lock
   parent would make it 0755, not the design's 01777).

 - C{cdi}: the pod gets the annotation L{ANNOTATION_KEY} =
   C{hami.io/hostpid=broker} (L{hostpid.node.cdi}).  WHERE THIS REACHES A
   RUNTIME, AND WHERE IT DOES NOT: containerd
   (C{internal/cri/server/container_create_linux.go} and 1.7's
   C{pkg/cri/server/} and C{pkg/cri/sbserver/container_create_linux.go},
   C{containerSpecOpts}:
   C{customopts.WithCDI(config.Annotations, config.CDIDevices)}) and CRI-O
   (C{internal/factory/container/device_linux.go}, C{specInjectCDIDevices}:
   C{cdi.ParseAnnotations(c.Config().GetAnnotations())}) read CDI
   annotations from the CRI I{ContainerConfig}.  The kubelet fills
   C{ContainerConfig.Annotations} from C{newContainerAnnotations}
   (kubernetes/kubernetes C{pkg/kubelet/kuberuntime/labels.go}, used by
   C{generateContainerConfig} in C{kuberuntime_container.go}): the device
   plugin's annotations (C{opts.Annotations}) plus the kubelet's own
   C{io.kubernetes.container.*} keys, and no pod annotation.  Pod annotations
   go only to the I{PodSandboxConfig} (C{newPodAnnotations}, used by
   C{generatePodSandboxConfig} in C{kuberuntime_sandbox.go}), which neither
   runtime reads CDI devices from.  So on a stock kubelet with containerd or
   CRI-O, the pod annotation alone injects nothing: mode C{cdi} needs a
   node component that turns it into container CDI devices (an NRI plugin,
   or a device plugin naming the device itself, C{hostpid allocate --cdi});
   mode C{mounts} works everywhere.  C{docs/admission.md} says so.

What a pod supplies never sizes the answer: every string taken from the pod
(a container's or a volume's name, a path) is clipped to L{MAX_POD_STRING}
characters, at most L{MAX_WARNINGS} warnings are given (the last saying how
many more there were), and a patch longer than L{MAX_PATCH} bytes is not
given at all (the pod is admitted unpatched, with a warning).  The API
server calls mutating webhooks before it validates names, paths or the
number of containers, so a pod with a 200 KB container name and 14,000
mounts under the broker directory reaches the webhook; unbounded, it was
answered with one warning per mount, each repeating the name: 135 KB in,
40 MB out.

Either way the decision is idempotent (a patched pod, and a pod that already
has HAMi's own mounts and gate, give no patch), touches no unrelated volume,
mount, variable or annotation, and admits a pod whose own mounts would cover
C{/tmp/vgpulock} or the broker directory unpatched, with a warning naming
the volume.  The gate (L{Config.gate}) off patches nothing but the removal
of the broker annotation, so the design's rollout and rollback order holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from hostpid import defaults
from hostpid.admission.quantity import is_positive
from hostpid.gate import ENABLED_VALUE, GATE_ENV
from hostpid.node import cdi
from hostpid.node.allocation import canonical_mounts, clean_container_path, is_within

#: The pod annotation mode C{cdi} gives (CDI's prefix, C{pkg/cdi/annotations.go}).
ANNOTATION_KEY = cdi.ANNOTATION_PREFIX + "hostpid-broker"
#: Its value: the broker device of the spec the broker writes (C{docs/cdi.md}).
ANNOTATION_VALUE = cdi.qualified_name(cdi.BROKER_DEVICE)

#: The pod volumes mode C{mounts} adds.
LOCK_PARENT_VOLUME = "hostpid-lock-parent"
BROKER_VOLUME = "hostpid-broker"

MODES = ("cdi", "mounts")

#: Outcome labels, one per decision (the C{/metrics} counter's label).
PATCHED = "patched"
UNCHANGED = "unchanged"
NOT_QUALIFYING = "not_qualifying"
GATE_OFF = "gate_off"
SHADOWED = "shadowed"
ANNOTATION_REMOVED = "annotation_removed"
OVERSIZED = "oversized"
USERNS_SYS_ADMIN = "userns_sys_admin"
OUTCOMES = (PATCHED, UNCHANGED, NOT_QUALIFYING, GATE_OFF, SHADOWED, ANNOTATION_REMOVED,
            OVERSIZED, USERNS_SYS_ADMIN)

#: Added capabilities (as a pod spec names them: the runtime prefixes
#: C{CAP_} and upper-cases, containerd's C{getOCICapabilitiesList}) that let
#: a process remount a mount of its own mount namespace.
_REMOUNTING = frozenset({"SYS_ADMIN", "CAP_SYS_ADMIN", "ALL"})

#: Warnings in one answer at most; past it the last one says how many more
#: there were.  The API server passes each to the client as a C{Warning}
#: header and may truncate one past 256 characters (the admission webhook
#: documentation, "Response": warnings), so a handful of short ones is all a
#: user ever reads.
MAX_WARNINGS = 8
#: Characters kept of any one string taken from the pod (a name, a path) in
#: a warning or a log field: Kubernetes' own names are at most 253.
MAX_POD_STRING = 64
#: The longest JSON Patch given, in bytes of JSON (base64 makes it 4/3 as
#: long in the answer).  A pod's patch grows with its qualifying containers
#: (about 300 bytes each in mode mounts), so this is about a hundred
#: containers, far more than any real pod; past it the pod is admitted
#: unpatched with a warning, and the answer stays under 64 KiB whatever the
#: pod.
MAX_PATCH = 40 * 1024
#: The API server's bound on a pod's annotations, in bytes: the sum over
#: every annotation of the key's and the value's lengths must not pass it
#: (apimachinery C{TotalAnnotationSizeLimitB}, checked by
#: C{ValidateAnnotationsSize} in C{pkg/api/validation/objectmeta.go}, after
#: the mutating webhooks and whatever their failure policy).
ANNOTATIONS_LIMIT = 256 * 1024

_CONTAINER_LISTS = ("initContainers", "containers")


@attrs.frozen
class Config:
    """
    What the webhook is told at startup.

    @ivar resources: extended resource names that make a pod qualify.
    @ivar mode: C{"cdi"} (the annotation) or C{"mounts"} (hostPath volumes).
    @ivar gate: the webhook's own C{LIBVGPU_HOSTPID_BROKER} is exactly C{"1"}.
    @ivar lock_parent: the host lock parent (mode C{mounts}).
    @ivar broker_dir: the host broker directory (mode C{mounts}).
    """

    resources: tuple[str, ...] = ("nvidia.com/gpu",)
    mode: str = "cdi"
    #: DeviceClasses (C{resource.k8s.io}) whose devices are GPUs: a
    #: container naming a claim that asks only for these qualifies, once the
    #: claim's object has been read (L{decide}'s C{claim_classes}).
    device_classes: tuple[str, ...] = ()
    gate: bool = False
    lock_parent: str = defaults.LOCK_PARENT
    broker_dir: str = defaults.BROKER_DIRECTORY

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not self.resources:
            raise ValueError("at least one resource name is needed")


@attrs.frozen
class Decision:
    """
    @ivar patch: RFC 6902 operations, to apply in order to the pod as given.
    @ivar warnings: short sentences for the AdmissionReview's C{warnings}.
    @ivar outcome: one of L{OUTCOMES}.
    """

    patch: tuple[dict[str, Any], ...]
    warnings: tuple[str, ...]
    outcome: str


def pointer(*parts: str | int) -> str:
    """An RFC 6901 JSON Pointer: C{~} as C{~0}, then C{/} as C{~1}, in each part."""
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else []


def _containers(spec: Mapping[str, Any]) -> Iterable[tuple[str, int, Mapping[str, Any]]]:
    for field in _CONTAINER_LISTS:
        for index, container in enumerate(_list(spec.get(field))):
            if isinstance(container, Mapping):
                yield field, index, container


def requests_resource(container: Mapping[str, Any], resources: Iterable[str]) -> bool:
    """
    Whether C{container} requests or limits a positive amount of any of
    C{resources} (L{hostpid.admission.quantity}: C{"0"}, C{"0.0"}, C{"00"}
    or C{0} ask for none).
    """
    amounts = _mapping(container.get("resources"))
    return any(
        is_positive(_mapping(amounts.get(part)).get(name))
        for part in ("requests", "limits")
        for name in resources
    )


@attrs.frozen
class ClaimSource:
    """
    One entry of a pod's C{spec.resourceClaims}: the pod's name for the
    claim and the object a lookup would read for its device classes.

    @ivar kind: C{"ResourceClaimTemplate"} or C{"ResourceClaim"}.
    """

    name: str
    kind: str
    object_name: str


def claim_sources(pod: Mapping[str, Any]) -> tuple[ClaimSource, ...]:
    """
    The pod's claims, each with the object that says which device classes
    it asks for: a template (C{resourceClaimTemplateName}) or a claim
    (C{resourceClaimName}).  Neither is in the pod: the pod names them only,
    so the device classes are known after an API lookup alone (the caller's
    I/O, never this module's).
    """
    found = []
    for entry in _list(_mapping(pod.get("spec")).get("resourceClaims")):
        entry = _mapping(entry)
        name = entry.get("name")
        if not isinstance(name, str):
            continue
        for field, kind in (("resourceClaimTemplateName", "ResourceClaimTemplate"),
                            ("resourceClaimName", "ResourceClaim")):
            value = entry.get(field)
            if isinstance(value, str) and value:
                found.append(ClaimSource(name, kind, value))
                break
    return tuple(found)


def request_classes(obj: Mapping[str, Any]) -> tuple[frozenset[str], ...]:
    """
    For each device request of a looked-up ResourceClaim or
    ResourceClaimTemplate (C{resource.k8s.io/v1}), the device classes it
    may be satisfied from: C{exactly.deviceClassName}, or every
    alternative's of a C{firstAvailable} request (the scheduler picks any
    one of them).  Empty for a request that names no class where it should:
    it proves nothing.
    """
    spec = _mapping(obj.get("spec"))
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = _mapping(spec.get("spec"))
    found = []
    for request in _list(_mapping(spec.get("devices")).get("requests")):
        request = _mapping(request)
        exactly = _mapping(request.get("exactly"))
        alternatives = [exactly] if exactly else [
            _mapping(a) for a in _list(request.get("firstAvailable"))]
        names = [a.get("deviceClassName") for a in alternatives]
        named = [n for n in names if isinstance(n, str) and n]
        found.append(frozenset(named) if named and len(named) == len(names) else frozenset())
    return tuple(found)


def container_claims(container: Mapping[str, Any]) -> tuple[str, ...]:
    """The pod claims C{container} uses (C{resources.claims[].name})."""
    return tuple(
        claim["name"] for claim in _list(_mapping(container.get("resources")).get("claims"))
        if isinstance(claim, Mapping) and isinstance(claim.get("name"), str))


def claims_gpu(container: Mapping[str, Any], config: Config,
               claim_classes: Mapping[str, tuple[frozenset[str], ...]]) -> bool:
    """
    Whether C{container} uses a claim one of whose requests can be satisfied
    only from L{Config.device_classes} (L{request_classes}, as the caller's
    lookups found them, by the pod's name for the claim).  A claim not
    looked up counts for nothing; so does a request whose alternatives
    include a class not listed (the scheduler may pick that one).
    """
    if not config.device_classes:
        return False
    listed = frozenset(config.device_classes)
    return any(
        request and request <= listed
        for name in container_claims(container)
        for request in claim_classes.get(name, ()))


def clip(value: Any) -> str:
    """
    C{value} (a string taken from the pod) as at most L{MAX_POD_STRING}
    characters and a note of its length: never the whole of what a client
    chose to send.  Anything but a string is named by its type only.
    """
    if not isinstance(value, str):
        return f"<{type(value).__name__}>" if value is not None else "<none>"
    if len(value) <= MAX_POD_STRING:
        return value
    return f"{value[:MAX_POD_STRING]}...({len(value):,} characters)"


def bounded(warnings: Sequence[str]) -> tuple[str, ...]:
    """At most L{MAX_WARNINGS} of C{warnings}, the last saying how many more there were."""
    if len(warnings) <= MAX_WARNINGS:
        return tuple(warnings)
    kept = MAX_WARNINGS - 1
    return (*warnings[:kept], f"and {len(warnings) - kept:,} more")


def _utf8_length(text: Any) -> int:
    # Go's len() of a string: its UTF-8 bytes (a lone surrogate, which Go's
    # JSON decoder makes U+FFFD, counts 3 either way).
    return len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0


def annotations_size(annotations: Mapping[str, Any]) -> int:
    """The size the API server checks against L{ANNOTATIONS_LIMIT}: keys and values, in bytes."""
    return sum(_utf8_length(k) + _utf8_length(v) for k, v in annotations.items())


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return _mapping(_mapping(pod.get("metadata")).get("annotations"))


def _remove_annotation(pod: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    if ANNOTATION_KEY not in _annotations(pod):
        return ()
    return ({"op": "remove", "path": pointer("metadata", "annotations", ANNOTATION_KEY)},)


def _add_annotation(pod: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    metadata = pod.get("metadata")
    if not isinstance(metadata, Mapping):
        return ({"op": "add", "path": "/metadata",
                 "value": {"annotations": {ANNOTATION_KEY: ANNOTATION_VALUE}}},)
    annotations = metadata.get("annotations")
    if not isinstance(annotations, Mapping):
        return ({"op": "add", "path": "/metadata/annotations",
                 "value": {ANNOTATION_KEY: ANNOTATION_VALUE}},)
    if annotations.get(ANNOTATION_KEY) == ANNOTATION_VALUE:
        return ()
    # "add" on an existing member replaces it (RFC 6902 section 4.1).
    return ({"op": "add", "path": pointer("metadata", "annotations", ANNOTATION_KEY),
             "value": ANNOTATION_VALUE},)


@attrs.frozen
class _Wanted:
    """One canonical mount as a pod spec expresses it."""

    volume: str
    container_path: str
    host_path: str
    read_only: bool

    def volume_object(self) -> dict[str, Any]:
        return {"name": self.volume, "hostPath": {"path": self.host_path, "type": "Directory"}}

    def mount_object(self) -> dict[str, Any]:
        mount: dict[str, Any] = {"name": self.volume, "mountPath": self.container_path}
        if self.read_only:
            mount["readOnly"] = True
        return mount


def _wanted(config: Config) -> tuple[_Wanted, ...]:
    names = (LOCK_PARENT_VOLUME, BROKER_VOLUME)
    return tuple(
        _Wanted(name, mount.container_path, mount.host_path, mount.read_only)
        for name, mount in zip(names, canonical_mounts(True, config.lock_parent,
                                                       config.broker_dir), strict=True)
    )


def _host_path(volume: Mapping[str, Any]) -> str | None:
    path = _mapping(volume.get("hostPath")).get("path")
    return clean_container_path(path) if isinstance(path, str) else None


def _provides(volume: Mapping[str, Any] | None, mount: Mapping[str, Any], want: _Wanted) -> bool:
    """Whether C{mount} (of C{volume}) already is the canonical C{want}."""
    return (
        volume is not None
        and _host_path(volume) == clean_container_path(want.host_path)
        and not mount.get("subPath") and not mount.get("subPathExpr")
        and bool(mount.get("readOnly", False)) == want.read_only
    )


def _is_reserved(target: str) -> bool:
    return target == defaults.LOCK_PARENT or is_within(
        target, defaults.CONTAINER_BROKER_DIRECTORY)


def _shadowing(pod_spec: Mapping[str, Any], qualifying: list[tuple[str, int, Mapping[str, Any]]],
               config: Config) -> list[str]:
    """
    Warnings for the pod's own volumes that would cover a canonical path (or
    hold one of the webhook's volume names with something else): such a pod
    is admitted as it is.
    """
    volumes = {v.get("name"): v for v in _list(pod_spec.get("volumes")) if isinstance(v, Mapping)}
    by_path = {want.container_path: want for want in _wanted(config)}
    problems: list[str] = []
    for own in _wanted(config):
        volume = volumes.get(own.volume)
        if volume is not None and _host_path(volume) != clean_container_path(own.host_path):
            problems.append(f"volume {own.volume!r} is the pod's own, not "
                            f"{clip(own.host_path)}")
    for field, index, container in qualifying:
        for mount in _list(container.get("volumeMounts")):
            if not isinstance(mount, Mapping) or not isinstance(mount.get("mountPath"), str):
                continue
            target = clean_container_path(mount["mountPath"])
            if not _is_reserved(target):
                continue
            want = by_path.get(target)
            volume = volumes.get(mount.get("name"))
            if want is not None and _provides(volume, mount, want):
                continue
            problems.append(
                f"volume {clip(mount.get('name'))!r} mounted at {clip(target)} in "
                f"{field}[{index}] ({clip(container.get('name'))}) would shadow the broker's "
                "mount"
            )
    return problems


def _mount_ops(pod_spec: Mapping[str, Any],
               qualifying: list[tuple[str, int, Mapping[str, Any]]],
               config: Config) -> list[dict[str, Any]]:
    volumes = {v.get("name"): v for v in _list(pod_spec.get("volumes")) if isinstance(v, Mapping)}
    wants = _wanted(config)
    ops: list[dict[str, Any]] = []
    needed_volumes: list[_Wanted] = []
    for field, index, container in qualifying:
        mounts = [m for m in _list(container.get("volumeMounts")) if isinstance(m, Mapping)]
        missing = [
            want for want in wants
            if not any(
                clean_container_path(str(m.get("mountPath", ""))) == want.container_path
                and _provides(volumes.get(m.get("name")), m, want)
                for m in mounts
            )
        ]
        for want in missing:
            if want.volume not in volumes and want not in needed_volumes:
                needed_volumes.append(want)
        if missing:
            objects = [want.mount_object() for want in missing]
            if not isinstance(container.get("volumeMounts"), list):
                ops.append({"op": "add", "path": pointer("spec", field, index, "volumeMounts"),
                            "value": objects})
            else:
                ops.extend({"op": "add", "path": pointer("spec", field, index, "volumeMounts", "-"),
                            "value": obj} for obj in objects)
        ops.extend(_env_ops(container, field, index))
    if needed_volumes:
        objects = [want.volume_object() for want in needed_volumes]
        if not isinstance(pod_spec.get("volumes"), list):
            ops.insert(0, {"op": "add", "path": "/spec/volumes", "value": objects})
        else:
            ops[0:0] = [{"op": "add", "path": "/spec/volumes/-", "value": obj} for obj in objects]
    return ops


def _env_ops(container: Mapping[str, Any], field: str, index: int) -> list[dict[str, Any]]:
    """
    The gate in C{container}'s env: added when absent, and every entry of the
    reserved key that is not exactly C{"1"} replaced (as C{hostpid allocate}
    clears the key before setting it, a stale or forged value never
    survives).
    """
    gate = {"name": GATE_ENV, "value": ENABLED_VALUE}
    env = container.get("env")
    if not isinstance(env, list):
        return [{"op": "add", "path": pointer("spec", field, index, "env"), "value": [gate]}]
    ops = []
    found = False
    for position, entry in enumerate(env):
        if isinstance(entry, Mapping) and entry.get("name") == GATE_ENV:
            found = True
            if dict(entry) != gate:
                ops.append({"op": "replace", "path": pointer("spec", field, index, "env",
                                                             position), "value": gate})
    if not found:
        ops.append({"op": "add", "path": pointer("spec", field, index, "env", "-"), "value": gate})
    return ops


def decide(pod: Mapping[str, Any], config: Config,
           claim_classes: Mapping[str, tuple[frozenset[str], ...]] | None = None) -> Decision:
    """
    The patch, warnings and outcome for C{pod} (a decoded Pod object).

    @param claim_classes: for pods with ResourceClaims, the device classes
        of each request of each claim (L{request_classes} of the object
        L{claim_sources} names), by the pod's name for the claim, as the
        caller's lookups found them; without them a container qualifies by
        its resources alone.
    """
    spec = _mapping(pod.get("spec"))
    classes = claim_classes or {}
    qualifying = [c for c in _containers(spec)
                  if requests_resource(c[2], config.resources)
                  or claims_gpu(c[2], config, classes)]
    removal = _remove_annotation(pod)
    if not qualifying:
        if removal:
            return Decision(removal, (
                f"annotation {ANNOTATION_KEY} removed: no container requests "
                f"{', '.join(config.resources)}, so the pod gets no broker",), ANNOTATION_REMOVED)
        return Decision((), (), NOT_QUALIFYING)
    if not config.gate:
        if removal:
            return Decision(removal, (
                f"annotation {ANNOTATION_KEY} removed: the broker's gate is off",),
                ANNOTATION_REMOVED)
        return Decision((), (), GATE_OFF)
    problems = _shadowing(spec, qualifying, config)
    if problems:
        return Decision((), bounded([f"hostpid broker not added: {p}" for p in problems]),
                        SHADOWED)
    if config.mode == "cdi":
        patch = _add_annotation(pod)
        if patch and _annotations_after(pod) > ANNOTATIONS_LIMIT:
            return Decision((), (
                f"hostpid broker not added: annotation {ANNOTATION_KEY} would take the pod's "
                f"annotations past the API server's limit of 256 KiB "
                f"({ANNOTATIONS_LIMIT:,} bytes of keys and values)",), OVERSIZED)
    else:
        remounter = _userns_remounter(spec)
        if remounter is not None:
            # Reinvoked (reinvocationPolicy: IfNeeded) after a later webhook
            # gave the pod a remounting container, the pod still carries what
            # this webhook added on its first call: take it away again, so
            # that the pod ends as a first call on it would have left it.
            taken = _userns_removal(spec, config)
            verb = "removed" if taken else "not added"
            return Decision(taken, (
                f"hostpid broker {verb}: the pod has its own user namespace "
                f"(hostUsers: false) and {remounter}: through the idmapped hostPath the "
                "kubelet gives such a pod, it could write the node's broker directory "
                "(docs/userns.md)",), USERNS_SYS_ADMIN)
        patch = tuple(_mount_ops(spec, qualifying, config))
        size = len(json.dumps(list(patch), separators=(",", ":")))
        if size > MAX_PATCH:
            return Decision((), (
                f"hostpid broker not added: its patch for {len(qualifying):,} qualifying "
                f"containers would be {size:,} bytes, more than the webhook gives "
                f"({MAX_PATCH:,})",), OVERSIZED)
    return Decision(patch, (), PATCHED if patch else UNCHANGED)


def _userns_removal(spec: Mapping[str, Any], config: Config) -> tuple[dict[str, Any], ...]:
    """
    The operations that take away what mode C{mounts} adds (L{_mount_ops}):
    the webhook's two volumes where they name its host paths, every mount of
    them, and the gate (exactly as given, C{LIBVGPU_HOSTPID_BROKER=1}) in the
    containers that had such a mount.  Nothing else: a volume of the pod's
    own under another name, or of one of these names with another path, is
    the pod's (L{_shadowing} leaves such a pod alone before this is asked).
    Array entries are removed from the last to the first, so that each
    index is still right when its operation is applied.
    """
    ours = {want.volume for want in _wanted(config)}
    paths = {want.volume: clean_container_path(want.host_path) for want in _wanted(config)}
    volumes = _list(spec.get("volumes"))
    taken_volumes = [
        index for index, volume in enumerate(volumes)
        if isinstance(volume, Mapping) and volume.get("name") in ours
        and _host_path(volume) == paths[volume["name"]]
    ]
    if not taken_volumes:
        return ()
    names = {volumes[index]["name"] for index in taken_volumes}
    gate = {"name": GATE_ENV, "value": ENABLED_VALUE}
    ops: list[dict[str, Any]] = []
    for field, index, container in _containers(spec):
        mounts = _list(container.get("volumeMounts"))
        taken = [position for position, mount in enumerate(mounts)
                 if isinstance(mount, Mapping) and mount.get("name") in names]
        if not taken:
            continue
        ops.extend({"op": "remove", "path": pointer("spec", field, index, "volumeMounts",
                                                    position)} for position in reversed(taken))
        env = _list(container.get("env"))
        ops.extend({"op": "remove", "path": pointer("spec", field, index, "env", position)}
                   for position in reversed(range(len(env)))
                   if isinstance(env[position], Mapping) and dict(env[position]) == gate)
    ops.extend({"op": "remove", "path": pointer("spec", "volumes", index)}
               for index in reversed(taken_volumes))
    return tuple(ops)


def _userns_remounter(spec: Mapping[str, Any]) -> str | None:
    """
    In a pod with a user namespace of its own (C{hostUsers: false}), the
    first container that could remount the broker's volume writable: one
    that adds C{SYS_ADMIN} (or C{ALL}) or is privileged.  The kubelet gives
    such a pod's C{hostPath} volumes the pod's idmapping
    (C{applyPlatformSpecificContainerConfig}, C{kuberuntime_container_linux.go}),
    and through an idmapped broker mount the pod's root is the host broker
    directory's owner: with C{CAP_SYS_ADMIN} in its namespace it remounts
    the mount read-write and replaces the node's socket, which the clients
    of other user-namespaced pods then trust (docs/userns.md, measured).
    Every container counts, not only the qualifying ones: containers of a
    pod share its user namespace, and with a shared process namespace one
    can enter another's mounts.  C{None} for any other pod.
    """
    if spec.get("hostUsers") is not False:
        return None
    for field, index, container in _containers(spec):
        context = _mapping(container.get("securityContext"))
        added = _list(_mapping(context.get("capabilities")).get("add"))
        named = [c for c in added if isinstance(c, str) and c.upper() in _REMOUNTING]
        if named or context.get("privileged") is True:
            what = f"adds {clip(named[0])}" if named else "is privileged"
            return f"{field}[{index}] ({clip(container.get('name'))}) {what}"
    return None


def _annotations_after(pod: Mapping[str, Any]) -> int:
    """The pod's annotations' size once L{ANNOTATION_KEY} is set to L{ANNOTATION_VALUE}."""
    annotations = dict(_annotations(pod))
    annotations[ANNOTATION_KEY] = ANNOTATION_VALUE
    return annotations_size(annotations)
