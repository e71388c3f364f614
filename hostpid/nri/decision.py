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
    character device of NVIDIA's major, 195, with a GPU's minor (0 to
    253): the driver's control nodes share the major (C{/dev/nvidiactl} is
    195:255, C{/dev/nvidia-modeset} 195:254), are no GPU, and are what a
    runtime allowing such devices through an annotation would hand a pod
    that has none.
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
import functools
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
#: The broker mountpoint C{<lock parent>/hostpid} is not a directory owned by
#: the trusted UID and could not be repaired: the lock parent alone, no broker
#: mount and no gate (a bind mount onto a planted file fails the container; onto
#: a planted symlink it lands wherever the link points inside the container).
MOUNTPOINT_UNSAFE = "mountpoint_unsafe"
#: More entries in one of the container's lists than L{MAX_ENTRIES}: not
#: looked at (a decision over millions of entries outlasts the runtime's
#: request timeout, and the runtime then drops the plugin for every container).
OVERSIZED = "oversized"
#: Not the decision's: the service's when the decision raised.
ERROR = "error"
REASONS = (ADJUSTED, UNCHANGED, NOT_QUALIFYING, OPTED_OUT, GATE_OFF, BROKER_ABSENT,
           SHADOWED, MOUNTPOINT_UNSAFE, OVERSIZED, ERROR)

#: The most entries of one list (devices, CDI devices, mounts, environment)
#: a container may have for the decision to look at it.  A real container has
#: hundreds at most (a privileged one gets every host device: a few thousand);
#: one frame of NRI (4 MiB) can carry two million empty ones, whose Python
#: objects alone take a second to walk.  At this bound every list together is
#: walked in milliseconds (tests/integration/test_nri_process.py sends the
#: largest frames).
MAX_ENTRIES = 16384
#: Paths longer than the kernel's C{PATH_MAX} cannot be mounted or opened: a
#: mount or device with one is no signal and covers nothing the broker needs,
#: so it is never cleaned (cleaning is linear in the path, and there may be
#: thousands of them).
PATH_MAX = 4096

#: Mount options of the bind mounts added: what containerd's CRI gives a
#: kubelet mount (C{internal/cri/opts/spec_linux_opts.go}, C{WithMounts}:
#: C{rbind}, C{rprivate}, then C{rw} or C{ro}).  Never C{idmap} or C{ridmap}
#: (runc 1.2+): in a user-namespaced pod a plain read-only bind shows the
#: host's root as the overflow UID, which the client's rule accepts, and it is
#: the one mount such a pod's root cannot write through even after remounting
#: it, where an idmapped one maps that root to the host's (docs/userns.md).
#:
#: C{nosuid} and C{nodev} on both (as the CDI spec has them,
#: L{hostpid.node.cdi}): the lock parent is writable by every GPU container, so
#: without them a set-user-ID program or a device node one container's root
#: leaves there works for another container's user.  C{noexec} on both: nothing
#: is executed from either (HAMi-core opens only C{/tmp/vgpulock/lock}, with
#: C{open(O_CREAT|O_RDWR)} and C{flock}: C{src/utils.c},
#: C{try_lock_unified_lock}; its shared region is C{/tmp/cudevshr.cache},
#: outside; the client connects to the socket).
LOCK_PARENT_OPTIONS = ("rbind", "rprivate", "rw", "nosuid", "nodev", "noexec")
BROKER_OPTIONS = ("rbind", "rprivate", "ro", "nosuid", "nodev", "noexec")

NVIDIA_DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"

#: The major of NVIDIA's GPU device nodes, C{/dev/nvidia0}... (the driver's
#: C{NV_MAJOR_DEVICE_NUMBER}; C{/proc/devices}: 195 nvidia-frontend).
NVIDIA_MAJOR = 195
#: The highest minor of a GPU's node: the driver numbers GPUs from 0 and keeps
#: 254 for C{/dev/nvidia-modeset} and 255 for C{/dev/nvidiactl}
#: (C{NV_CONTROL_DEVICE_MINOR}, C{NV_MODESET_MINOR}).  The path's number is
#: not required to equal the minor: a device plugin may name the host's
#: C{/dev/nvidia3} C{/dev/nvidia0} inside the container, and what cannot be
#: forged is the device number, not the name.
NVIDIA_GPU_MINOR_MAX = 253


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
    #: For C{"device"} with a C{major}: the highest minor it may have, or
    #: C{None} for any.
    minor_max: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in SIGNAL_KINDS:
            raise ValueError(f"unknown signal kind {self.kind!r}")
        if self.kind == "device" and self.pattern.startswith("re:"):
            re.compile(self.pattern[3:])

    def describe(self) -> str:
        suffix = ""
        if self.major is not None:
            minors = f", minor 0-{self.minor_max}" if self.minor_max is not None else ""
            suffix = f" (character major {self.major}{minors})"
        return f"{self.kind}:{self.pattern}{suffix}"


#: What C{--resource NAME} means for the resource names the plugin knows.
PRESETS: Mapping[str, tuple[Signal, ...]] = {
    "nvidia.com/gpu": (
        Signal("device", r"re:/dev/nvidia[0-9]+", NVIDIA_MAJOR, NVIDIA_GPU_MINOR_MAX),
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


@functools.lru_cache(maxsize=64)
def _device_pattern(pattern: str) -> re.Pattern[str]:
    """C{pattern} (a glob, or C{re:} and a regular expression) compiled once."""
    return re.compile(pattern[3:] if pattern.startswith("re:") else fnmatch.translate(pattern))


def _device_matches(pattern: str, path: str) -> bool:
    return _device_pattern(pattern).fullmatch(path) is not None


def _could_name(path: str, name: str) -> bool:
    """
    Whether C{path} could clean to a path with the component C{name}:
    cleaning only removes components, never makes one, so a path without
    C{name} in it cannot (a substring search, for the many mounts that are
    nothing of ours, instead of cleaning each).
    """
    return name in path and len(path) <= PATH_MAX


def oversized(container: api_pb2.Container) -> str | None:
    """Which of C{container}'s lists is longer than L{MAX_ENTRIES}, or None."""
    for what, entries in (("devices", container.linux.devices),
                          ("CDI devices", container.CDI_devices),
                          ("mounts", container.mounts), ("environment", container.env)):
        if len(entries) > MAX_ENTRIES:
            return f"{len(entries)} {what}, more than {MAX_ENTRIES}"
    return None


def allocation_signal(container: api_pb2.Container, signals: Iterable[Signal]) -> str | None:
    """
    The first trusted signal C{container} carries, described, or None.

    Each list is walked once per signal kind, with no cleaning of a path
    that cannot match (L{_could_name}): linear in the container, and a few
    milliseconds at L{MAX_ENTRIES}.  A device signal with a C{major} asks for
    a character device of that major, not a path alone: CRI-O's allowed
    C{io.kubernetes.cri-o.Devices} annotation lets a pod put an allowed
    device (C{/dev/fuse} by default) at any path, C{/dev/nvidia0} too.  With
    a C{minor_max} the minor must be at most that too: NVIDIA's control
    nodes (195:254, 195:255) are no GPU.
    """
    signals = tuple(signals)
    for signal in signals:
        if signal.kind == "device":
            for device in container.linux.devices:
                path = device.path
                if signal.major is not None and (device.type, device.major) != ("c", signal.major):
                    continue
                if signal.minor_max is not None and not 0 <= device.minor <= signal.minor_max:
                    continue
                if len(path) <= PATH_MAX and _device_matches(signal.pattern, path):
                    return f"device {path}"
        elif signal.kind == "cdi":
            for cdi_device in container.CDI_devices:
                kind = cdi_device.name.partition("=")[0]
                if kind == signal.pattern:
                    return f"CDI device of kind {kind}"
        else:
            directory = clean_container_path(signal.pattern)
            last = directory.rsplit("/", 1)[-1]
            for mount in container.mounts:
                if not (_could_name(mount.source, "null")
                        and _could_name(mount.destination, last)):
                    continue
                if clean_container_path(mount.source) != "/dev/null":
                    continue
                destination = clean_container_path(mount.destination)
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


#: The one component every reserved destination has (L{_could_name}).
_RESERVED_NAME = defaults.LOCK_PARENT.rsplit("/", 1)[-1]


def _is_canonical(mount: api_pb2.Mount, target: str, want: AddMount) -> bool:
    return (
        target == want.destination
        and len(mount.source) <= PATH_MAX
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
    prefix = GATE_ENV + "="
    return [entry[len(prefix):] for entry in env
            if entry.startswith(prefix)]


@attrs.frozen
class Qualified:
    """A container L{qualify} found to need the broker: the signal, described."""

    signal: str


def qualify(pod: api_pb2.PodSandbox, container: api_pb2.Container,
            config: Config) -> Decision | Qualified:
    """
    The part of the decision that needs nothing of the host: a final
    L{Decision} (not qualifying, opted out, gate off, oversized), or
    L{Qualified} when the host's state decides the rest (L{adjust}).  The
    caller looks at the host only for a qualifying container.
    """
    too_many = oversized(container)
    if too_many is not None:
        return Decision(reason=OVERSIZED, detail=f"not looked at: {too_many}")
    signal = allocation_signal(container, config.signals)
    if signal is None:
        return Decision(reason=NOT_QUALIFYING)
    where = opted_out(pod)
    if where is not None:
        return Decision(reason=OPTED_OUT,
                        detail=f"pod {where} {OPT_OUT_KEY}={OPT_OUT_VALUE}")
    if not config.gate:
        return Decision(reason=GATE_OFF, detail=f"{GATE_ENV} is not exactly 1 for the plugin")
    return Qualified(signal)


def adjust(container: api_pb2.Container, config: Config, qualified: Qualified, *,
           broker_present: bool = True, mountpoint_problem: str = "") -> Decision:
    """
    The adjustment of a qualifying container, given what the caller saw on
    the host.

    @param broker_present: the broker directory and the lock parent exist
        on the host: a bind mount of a missing source would fail the
        container's creation.
    @param mountpoint_problem: empty when C{<lock parent>/hostpid} is a
        directory owned by the trusted UID (as found, or once repaired);
        otherwise what is wrong with it.  Then the container gets the lock
        parent alone (HAMi-core's own lock needs it) and neither the broker
        mount nor the gate: a mount onto a planted file fails the container,
        onto a planted symlink it lands where the link points inside the
        container (its C{/etc}, say).
    """
    if not broker_present:
        return Decision(reason=BROKER_ABSENT,
                        detail=f"the broker directory {config.broker_dir} or the lock parent "
                               f"{config.lock_parent} does not exist")
    wanted = _wanted(config)
    if mountpoint_problem:
        wanted = wanted[:1]
    present = [False] * len(wanted)
    # One walk over the mounts; only a destination with the reserved name
    # in it is cleaned (L{_could_name}).
    for mount in container.mounts:
        if not _could_name(mount.destination, _RESERVED_NAME):
            continue
        target = clean_container_path(mount.destination)
        if not _is_reserved(target):
            continue
        for index, want in enumerate(_wanted(config)):
            if index < len(wanted) and _is_canonical(mount, target, want):
                present[index] = True
            elif target == want.destination or (
                    want.destination == defaults.CONTAINER_BROKER_DIRECTORY
                    and is_within(target, want.destination)):
                if index >= len(wanted):
                    continue  # the broker mount is not added: nothing to shadow
                return Decision(reason=SHADOWED, detail=(
                    f"the container's mount of {mount.source or mount.type!s} at "
                    f"{mount.destination} would shadow the broker's mount at "
                    f"{want.destination}"))
    missing = tuple(want for want, there in zip(wanted, present, strict=True) if not there)
    if mountpoint_problem:
        return Decision(missing, (), MOUNTPOINT_UNSAFE,
                        f"GPU allocation: {qualified.signal}; the lock parent only, "
                        f"no broker mount: {mountpoint_problem}")
    values = gate_values(container.env)
    env: tuple[tuple[str, str], ...] = ()
    if not values or any(v != ENABLED_VALUE for v in values):
        env = ((GATE_ENV, ENABLED_VALUE),)
    decision = Decision(missing, env, ADJUSTED, f"GPU allocation: {qualified.signal}")
    if decision.empty:
        return attrs.evolve(decision, reason=UNCHANGED)
    return decision


def decide(pod: api_pb2.PodSandbox, container: api_pb2.Container, config: Config, *,
           broker_present: bool = True, mountpoint_problem: str = "") -> Decision:
    """
    The adjustment for C{container} of C{pod}: L{qualify}, then L{adjust}
    with what the caller saw on the host (see there).
    """
    qualified = qualify(pod, container, config)
    if isinstance(qualified, Decision):
        return qualified
    return adjust(container, config, qualified, broker_present=broker_present,
                  mountpoint_problem=mountpoint_problem)
