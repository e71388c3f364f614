"""
The NRI plugin's decision: a pod sandbox and a container in, an adjustment
and a reason out.

Pure, like L{hostpid.admission.decision}: no Twisted, no sockets, no clock,
no files (whether the broker's directory exists is passed in).  The
protocol (L{hostpid.nri.plugin}) and the service only decode, call
L{decide} and encode.

WHAT THE RUNTIME SHOWS AT CREATECONTAINER.  The container NRI is shown is
the OCI spec the runtime is about to create, after everything the CRI
request put in it:

  - containerd (C{internal/cri/server/container_create.go}: the NRI option
    C{c.nri.WithContainerAdjustment()} is appended after
    C{containerd.WithSpec(spec, specOpts...)}; C{internal/cri/nri/
    nri_api_linux.go} builds the NRI container from that spec:
    C{GetLinuxDevices} is C{spec.Linux.Devices}, C{GetEnv}
    C{spec.Process.Env}, C{GetMounts} C{spec.Mounts}, C{GetCDIDevices} the
    CRI C{ContainerConfig.CDIDevices}, C{GetAnnotations} the spec's
    annotations and the CRI container config's).  The spec options include
    C{WithDevices} (the CRI C{devices}: the kubelet puts a device plugin's
    C{ContainerAllocateResponse.devices} there) and C{WithCDI} (CDI devices
    a device plugin or a DRA driver named, injected into the spec before
    NRI sees it), so a GPU's device nodes are in C{linux.devices};
  - CRI-O (C{server/container_create_linux.go}: C{s.nri.createContainer(ctx,
    specgen, sb, ociContainer)} runs after the spec generator has the
    devices, mounts and CDI edits; C{internal/nri} reads them from
    C{specgen.Config});
  - NRI plugins with a lower index run first and this plugin sees their
    adjustments (C{result.apply} in containerd/nri
    C{pkg/adaptation/result.go} updates the request's container), so a GPU
    a device-injecting NRI plugin adds is seen too (hence the default index
    90, L{hostpid.nri.plugin.DEFAULT_INDEX}).

WHICH SIGNALS A POD SPEC CAN FORGE, and so which the decision trusts:

  - C{env}: FORGEABLE.  A device plugin's variables
    (C{NVIDIA_VISIBLE_DEVICES}...) and the pod spec's C{env} land in the same
    C{process.env}; nothing tells them apart.  Never a signal here.
  - pod annotations and labels (C{PodSandbox}): FORGEABLE, the pod's own.
    Used only to opt out (L{OPT_OUT_KEY}), never to opt in.
  - container annotations: the kubelet puts a device plugin's annotations
    there, but containerd's C{pod_annotations} passthrough and CRI-O's
    allowed annotations copy pod annotations into the spec: FORGEABLE on
    such a runtime.  Never a signal here.
  - C{linux.devices}: a pod spec cannot add a device node without the
    Pod Security level C{privileged} (a C{privileged} container gets every
    host device: containerd's C{WithPrivilegedDevices}); a C{hostPath}
    volume of C{/dev/nvidia0} is a mount, not a device, and the device
    cgroup refuses it.  TRUSTED, by its device number and not its path
    alone: CRI-O's default runtime handler allows the pod annotation
    C{io.kubernetes.cri-o.Devices}, which puts any device of its
    C{allowed_devices} (C{/dev/fuse}, C{/dev/net/tun} by default) at any
    container path under C{/dev} (C{internal/config/device/device_linux.go}
    C{DevicesFromAnnotation} checks the host path only), so a restricted
    pod can show NRI a C{/dev/nvidia0} that is FUSE's 10:229
    (tests/e2e/test_crio.py).  The NVIDIA preset's device signal is a
    character device of NVIDIA's major, 195.
  - C{CDI_devices}: only the kubelet sets them, from a device plugin's
    C{cdiDevices} or a DRA claim.  TRUSTED.
  - a mount whose source is C{/dev/null} at
    C{/var/run/nvidia-container-devices/...} (NVIDIA's device plugin with
    C{--device-list-strategy=volume-mounts}): forging it needs a
    C{hostPath} volume, refused below Pod Security C{privileged}.  TRUSTED.

Whatever only a C{privileged}-level pod can forge is no way around the
design's boundary: such a pod can mount the broker's directory with a
C{hostPath} volume itself.

Idempotent and careful: a container that already has the canonical mounts
and the gate gets nothing; a C{LIBVGPU_HOSTPID_BROKER} other than exactly
C{"1"} is replaced (NRI replaces every entry of a key it is given); a
container whose own mount would cover C{/tmp/vgpulock} or the broker
directory gets nothing and the reason names the mount (an NRI mount
adjustment would replace the container's mount at the same destination).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping

import attrs

from hostpid import defaults
from hostpid.gate import ENABLED_VALUE, GATE_ENV
from hostpid.node.allocation import canonical_mounts, clean_container_path, is_within
from hostpid.nri import api_pb2

#: A pod label or annotation with this key and the value L{OPT_OUT_VALUE}
#: keeps every container of the pod as it is.
OPT_OUT_KEY = "hostpid.hami.io/nri"
OPT_OUT_VALUE = "disabled"

#: Reasons, one per decision (the C{/metrics} label).
ADJUSTED = "adjusted"
UNCHANGED = "unchanged"
NOT_QUALIFYING = "not_qualifying"
OPTED_OUT = "opted_out"
GATE_OFF = "gate_off"
BROKER_ABSENT = "broker_absent"
SHADOWED = "shadowed"
#: Not the decision's: the service's when the decision raised.
ERROR = "error"
REASONS = (ADJUSTED, UNCHANGED, NOT_QUALIFYING, OPTED_OUT, GATE_OFF, BROKER_ABSENT,
           SHADOWED, ERROR)

#: Mount options of the bind mounts added: what containerd's CRI gives a
#: kubelet mount (C{internal/cri/opts/spec_linux_opts.go}, C{WithMounts}:
#: C{rbind}, C{rprivate}, then C{rw} or C{ro}).  Never C{idmap} or C{ridmap}
#: (runc 1.2+): in a user-namespaced pod a plain read-only bind shows the
#: host's root as the overflow UID, which the client's rule accepts, and it is
#: the one mount such a pod's root cannot write through even after remounting
#: it, where an idmapped one maps that root to the host's (docs/userns.md).
LOCK_PARENT_OPTIONS = ("rbind", "rprivate", "rw")
BROKER_OPTIONS = ("rbind", "rprivate", "ro")

NVIDIA_DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"

#: The major of NVIDIA's GPU device nodes, C{/dev/nvidia0}... (the driver's
#: C{NV_MAJOR_DEVICE_NUMBER}; C{/proc/devices}: 195 nvidia-frontend).
NVIDIA_MAJOR = 195


#: Signals a pod spec cannot forge (the module docstring says why); there is
#: deliberately no kind for environment variables or annotations.
SIGNAL_KINDS = ("device", "cdi", "devnull-mount")


@attrs.frozen
class Signal:
    """
    One trusted sign of a GPU allocation.

    @ivar kind: C{"device"} (a device node path in C{linux.devices},
        C{pattern} a shell glob or, prefixed C{re:}, a regular expression
        matched whole), C{"cdi"} (a CDI device whose kind, the part before
        C{=}, is C{pattern}) or C{"devnull-mount"} (a mount of C{/dev/null}
        whose destination is inside the directory C{pattern}).
    """

    kind: str
    pattern: str
    #: For C{"device"}: the character device major it must also have, or
    #: C{None} to match the path alone (C{--resource device:...}).
    major: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in SIGNAL_KINDS:
            raise ValueError(f"unknown signal kind {self.kind!r}")
        if self.kind == "device" and self.pattern.startswith("re:"):
            re.compile(self.pattern[3:])

    def describe(self) -> str:
        suffix = f" (character major {self.major})" if self.major is not None else ""
        return f"{self.kind}:{self.pattern}{suffix}"


#: What C{--resource NAME} means for the resource names the plugin knows.
PRESETS: Mapping[str, tuple[Signal, ...]] = {
    "nvidia.com/gpu": (
        Signal("device", r"re:/dev/nvidia[0-9]+", NVIDIA_MAJOR),
        Signal("cdi", "nvidia.com/gpu"),
        Signal("devnull-mount", NVIDIA_DEVICE_LIST_DIR),
    ),
}
DEFAULT_RESOURCES = ("nvidia.com/gpu",)


def parse_resource(value: str) -> tuple[Signal, ...]:
    """
    C{--resource}: a preset name (L{PRESETS}), C{device:GLOB},
    C{device:re:REGEX}, C{cdi:VENDOR/CLASS} or C{devnull-mount:DIR}.

    @raise ValueError: anything else.
    """
    if value in PRESETS:
        return PRESETS[value]
    kind, sep, pattern = value.partition(":")
    if not sep or not pattern or kind not in SIGNAL_KINDS:
        raise ValueError(
            f"{value!r} is neither a known resource ({', '.join(PRESETS)}) nor "
            "device:GLOB, device:re:REGEX, cdi:VENDOR/CLASS or devnull-mount:DIR")
    if kind == "device" and not pattern.startswith(("/", "re:")):
        raise ValueError(f"{value!r}: a device pattern is an absolute path glob")
    if kind == "devnull-mount" and not pattern.startswith("/"):
        raise ValueError(f"{value!r}: a directory is an absolute path")
    try:
        return (Signal(kind, pattern),)
    except (ValueError, re.error) as e:
        raise ValueError(f"{value!r}: {e}") from None


@attrs.frozen
class Config:
    """
    What the plugin is told at startup.

    @ivar signals: the trusted signs of a GPU allocation.
    @ivar gate: the plugin's own C{LIBVGPU_HOSTPID_BROKER} is exactly C{"1"}.
    @ivar lock_parent: the host lock parent, mounted at C{/tmp/vgpulock}.
    @ivar broker_dir: the host broker directory, mounted read-only at
        C{/tmp/vgpulock/hostpid}.
    """

    signals: tuple[Signal, ...] = PRESETS["nvidia.com/gpu"]
    gate: bool = False
    lock_parent: str = defaults.LOCK_PARENT
    broker_dir: str = defaults.BROKER_DIRECTORY

    def __attrs_post_init__(self) -> None:
        if not self.signals:
            raise ValueError("at least one signal is needed")


@attrs.frozen
class AddMount:
    destination: str
    source: str
    options: tuple[str, ...]


@attrs.frozen
class Decision:
    """
    @ivar mounts: mounts to add, in order (NRI sorts them parent first too).
    @ivar env: variables to set, replacing every entry of their key.
    @ivar reason: one of L{REASONS}.
    @ivar detail: a short sentence for the log (which signal, which mount).
    """

    mounts: tuple[AddMount, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    reason: str = NOT_QUALIFYING
    detail: str = ""

    @property
    def empty(self) -> bool:
        return not self.mounts and not self.env


def to_adjustment(decision: Decision) -> api_pb2.ContainerAdjustment:
    """The NRI message for C{decision}."""
    adjustment = api_pb2.ContainerAdjustment()
    for mount in decision.mounts:
        adjustment.mounts.add(destination=mount.destination, type="bind",
                              source=mount.source, options=list(mount.options))
    for key, value in decision.env:
        adjustment.env.add(key=key, value=value)
    return adjustment


def _device_matches(pattern: str, path: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], path) is not None
    return fnmatch.fnmatchcase(path, pattern)


def allocation_signal(container: api_pb2.Container, signals: Iterable[Signal]) -> str | None:
    """The first trusted signal C{container} carries, described, or None."""
    devices = [(d.path, d.type, d.major) for d in container.linux.devices]
    cdi_kinds = [d.name.partition("=")[0] for d in container.CDI_devices]
    devnull = [clean_container_path(m.destination) for m in container.mounts
               if clean_container_path(m.source) == "/dev/null"]
    for signal in signals:
        if signal.kind == "device":
            for path, kind, major in devices:
                if signal.major is not None and (kind, major) != ("c", signal.major):
                    continue
                if _device_matches(signal.pattern, path):
                    return f"device {path}"
        elif signal.kind == "cdi":
            for kind in cdi_kinds:
                if kind == signal.pattern:
                    return f"CDI device of kind {kind}"
        else:
            directory = clean_container_path(signal.pattern)
            for destination in devnull:
                if destination != directory and is_within(destination, directory):
                    return f"device-list mount {destination}"
    return None


def opted_out(pod: api_pb2.PodSandbox) -> str | None:
    """Where the pod opts out (C{"label"}, C{"annotation"}) or None."""
    if pod.labels.get(OPT_OUT_KEY) == OPT_OUT_VALUE:
        return "label"
    if pod.annotations.get(OPT_OUT_KEY) == OPT_OUT_VALUE:
        return "annotation"
    return None


def _is_reserved(target: str) -> bool:
    return target == defaults.LOCK_PARENT or is_within(
        target, defaults.CONTAINER_BROKER_DIRECTORY)


def _is_canonical(mount: api_pb2.Mount, want: AddMount) -> bool:
    return (
        clean_container_path(mount.destination) == want.destination
        and clean_container_path(mount.source) == clean_container_path(want.source)
        and ("ro" in mount.options) == ("ro" in want.options)
    )


def _wanted(config: Config) -> tuple[AddMount, ...]:
    return tuple(
        AddMount(m.container_path, m.host_path,
                 BROKER_OPTIONS if m.read_only else LOCK_PARENT_OPTIONS)
        for m in canonical_mounts(True, config.lock_parent, config.broker_dir)
    )


def gate_values(env: Iterable[str]) -> list[str]:
    """Every value C{env} gives the gate, in order."""
    values = []
    for entry in env:
        key, _, value = entry.partition("=")
        if key == GATE_ENV:
            values.append(value)
    return values


def decide(pod: api_pb2.PodSandbox, container: api_pb2.Container, config: Config, *,
           broker_present: bool = True) -> Decision:
    """
    The adjustment for C{container} of C{pod}.

    @param broker_present: the broker directory and the lock parent exist
        on the host (the caller looks): a bind mount of a missing source
        would fail the container's creation.
    """
    signal = allocation_signal(container, config.signals)
    if signal is None:
        return Decision(reason=NOT_QUALIFYING)
    where = opted_out(pod)
    if where is not None:
        return Decision(reason=OPTED_OUT,
                        detail=f"pod {where} {OPT_OUT_KEY}={OPT_OUT_VALUE}")
    if not config.gate:
        return Decision(reason=GATE_OFF, detail=f"{GATE_ENV} is not exactly 1 for the plugin")
    if not broker_present:
        return Decision(reason=BROKER_ABSENT,
                        detail=f"the broker directory {config.broker_dir} or the lock parent "
                               f"{config.lock_parent} does not exist")
    wanted = _wanted(config)
    missing = []
    for want in wanted:
        present = False
        for mount in container.mounts:
            target = clean_container_path(mount.destination)
            if not _is_reserved(target):
                continue
            if _is_canonical(mount, want):
                present = True
            elif target == want.destination or (
                    want.destination == defaults.CONTAINER_BROKER_DIRECTORY
                    and is_within(target, want.destination)):
                return Decision(reason=SHADOWED, detail=(
                    f"the container's mount of {mount.source or mount.type!s} at "
                    f"{mount.destination} would shadow the broker's mount at "
                    f"{want.destination}"))
        if not present:
            missing.append(want)
    values = gate_values(container.env)
    env: tuple[tuple[str, str], ...] = ()
    if not values or any(v != ENABLED_VALUE for v in values):
        env = ((GATE_ENV, ENABLED_VALUE),)
    decision = Decision(tuple(missing), env, ADJUSTED, f"GPU allocation: {signal}")
    if decision.empty:
        return attrs.evolve(decision, reason=UNCHANGED)
    return decision
