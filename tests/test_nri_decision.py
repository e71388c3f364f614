"""
The NRI plugin's pure decision (L{hostpid.nri.decision}).

Why each check exists:

- Which containers: only trusted signals of an allocation (a GPU device
  node, a CDI device of the kind, NVIDIA's device-list mount of
  C{/dev/null}) qualify; what a pod spec can write (env such as
  C{NVIDIA_VISIBLE_DEVICES} or the gate itself, pod and container
  annotations such as C{cdi.k8s.io/...}, an emptyDir at the device-list
  path) gets nothing: the design's boundary.
- What a qualifying container gets: exactly L{canonical_mounts} (the
  writable lock parent, then the broker directory read-only) and the gate.
- Idempotency and care: applied as NRI applies it, a second decision is
  C{unchanged}; a gate other than exactly C{"1"} is replaced; a container
  mount covering a reserved path gives nothing and a reason naming it;
  the gate off, the broker directory absent and the pod's opt-out give
  nothing; property tests over generated container shapes.
- C{--resource} parsing.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nrilib import container, gpu_container, pod

from hostpid import defaults
from hostpid.node.allocation import canonical_mounts
from hostpid.nri import api_pb2
from hostpid.nri.decision import (
    ADJUSTED,
    BROKER_ABSENT,
    GATE_OFF,
    MAX_ENTRIES,
    MOUNTPOINT_UNSAFE,
    NOT_QUALIFYING,
    OPT_OUT_KEY,
    OPT_OUT_VALUE,
    OPTED_OUT,
    OVERSIZED,
    PRESETS,
    SHADOWED,
    UNCHANGED,
    Config,
    Decision,
    Signal,
    decide,
    parse_resource,
    to_adjustment,
)

CONFIG = Config(gate=True, broker_dir="/var/run/hami/hostpid")


def apply(ctr: api_pb2.Container, decision: Decision) -> api_pb2.Container:
    """The container as NRI leaves it (C{pkg/adaptation/result.go}: a mount
    replaces one at its destination, a variable every entry of its key)."""
    adjusted = api_pb2.Container()
    adjusted.CopyFrom(ctr)
    adjustment = to_adjustment(decision)
    keep = [m for m in adjusted.mounts
            if m.destination not in {n.destination for n in adjustment.mounts}]
    del adjusted.mounts[:]
    adjusted.mounts.extend(keep)
    adjusted.mounts.extend(adjustment.mounts)
    keys = {kv.key for kv in adjustment.env}
    env = [e for e in adjusted.env if e.partition("=")[0] not in keys]
    env += [f"{kv.key}={kv.value}" for kv in adjustment.env]
    del adjusted.env[:]
    adjusted.env.extend(env)
    return adjusted


def test_gpu_container_gets_canonical_mounts_and_gate() -> None:
    decision = decide(pod(), gpu_container(), CONFIG)
    assert decision.reason == ADJUSTED and "/dev/nvidia0" in decision.detail
    want = canonical_mounts(True, defaults.LOCK_PARENT, CONFIG.broker_dir)
    assert [(m.destination, m.source, "ro" in m.options) for m in decision.mounts] == [
        (m.container_path, m.host_path, m.read_only) for m in want]
    assert decision.env == (("LIBVGPU_HOSTPID_BROKER", "1"),)
    adjustment = to_adjustment(decision)
    assert [m.type for m in adjustment.mounts] == ["bind", "bind"]
    assert list(adjustment.mounts[0].options) == [
        "rbind", "rprivate", "rw", "nosuid", "nodev", "noexec"]
    assert list(adjustment.mounts[1].options) == [
        "rbind", "rprivate", "ro", "nosuid", "nodev", "noexec"]
    assert decide(pod(), apply(gpu_container(), decision), CONFIG).reason == UNCHANGED


@pytest.mark.parametrize("ctr", [
    pytest.param(container(devices=["/dev/nvidia3"]), id="device-node"),
    pytest.param(container(cdi=["nvidia.com/gpu=0"]), id="cdi-device"),
    pytest.param(container(mounts=[("/var/run/nvidia-container-devices/GPU-1", "/dev/null",
                                    ["ro"])]), id="device-list-mount"),
])
def test_trusted_signals(ctr: api_pb2.Container) -> None:
    assert decide(pod(), ctr, CONFIG).reason == ADJUSTED


FORGED = pod(annotations={"cdi.k8s.io/nvidia": "nvidia.com/gpu=all"},
             labels={"nvidia.com/gpu": "1"})


def device_at(path: str, kind: str, major: int, minor: int) -> api_pb2.Container:
    """A container with one device node: C{kind} C{major}:C{minor} at C{path}."""
    message = container()
    message.linux.devices.add(path=path, type=kind, major=major, minor=minor)
    return message


@pytest.mark.parametrize("ctr", [
    # CRI-O's pod annotation io.kubernetes.cri-o.Devices: /dev/fuse:/dev/nvidia0 (its
    # default runtime handler allows it): FUSE's 10:229 at a GPU's path.
    pytest.param(device_at("/dev/nvidia0", "c", 10, 229), id="annotated-device-at-gpu-path"),
    pytest.param(device_at("/dev/nvidia0", "b", 195, 0), id="block-device-at-gpu-path"),
    # NVIDIA's control nodes share the GPUs' major: nvidiactl 195:255 and
    # nvidia-modeset 195:254 at a GPU's path are no GPU (a runtime allowing
    # them through an annotation would hand them to a pod that has none).
    pytest.param(device_at("/dev/nvidia0", "c", 195, 255), id="nvidiactl-at-gpu-path"),
    pytest.param(device_at("/dev/nvidia0", "c", 195, 254), id="modeset-at-gpu-path"),
    pytest.param(device_at("/dev/nvidia7", "c", 195, 4096), id="minor-beyond-gpus"),
    pytest.param(container(env=["NVIDIA_VISIBLE_DEVICES=all", "LIBVGPU_HOSTPID_BROKER=1",
                                "CUDA_VISIBLE_DEVICES=0"]), id="env"),
    pytest.param(container(annotations={"cdi.k8s.io/x": "nvidia.com/gpu=0"}),
                 id="container-annotation"),
    pytest.param(container(mounts=[("/var/run/nvidia-container-devices/GPU-1",
                                    "/var/lib/kubelet/pods/x/volumes/empty", [])]),
                 id="emptydir-at-device-list"),
    pytest.param(container(mounts=[("/dev/nvidia0", "/dev/nvidia0", ["rbind"])]),
                 id="device-as-mount"),
    pytest.param(container(devices=["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/fuse"]),
                 id="control-devices-only"),
    pytest.param(container(cdi=["vendor.com/gpu=0", "nvidia.com/gpux=1"]), id="other-cdi"),
])
def test_forged_signals_get_nothing(ctr: api_pb2.Container) -> None:
    decision = decide(FORGED, ctr, CONFIG)
    assert decision.reason == NOT_QUALIFYING and decision.empty


@pytest.mark.parametrize("minor", [0, 7, 253])
def test_every_gpu_minor_qualifies(minor: int) -> None:
    """195:0 to 195:253 are GPUs, whichever number the container path carries."""
    decision = decide(pod(), device_at("/dev/nvidia0", "c", 195, minor), CONFIG)
    assert decision.reason == ADJUSTED and decision.detail == "GPU allocation: device /dev/nvidia0"


def test_gate_replaced_when_not_exactly_one() -> None:
    for values in (["0"], ["1 "], ["1", "0"], [""], ["true"]):
        ctr = gpu_container(env=[f"LIBVGPU_HOSTPID_BROKER={v}" for v in values])
        assert decide(pod(), ctr, CONFIG).env == (("LIBVGPU_HOSTPID_BROKER", "1"),), values
    already = gpu_container(env=["LIBVGPU_HOSTPID_BROKER=1"])
    assert decide(pod(), already, CONFIG).env == ()


def test_already_has_mounts_and_gate() -> None:
    ctr = gpu_container(env=["LIBVGPU_HOSTPID_BROKER=1"], mounts=[
        ("/tmp/vgpulock", "/tmp/vgpulock", ["rbind", "rw"]),
        ("//tmp/vgpulock/hostpid/", "/var/run/hami/hostpid", ["rbind", "ro"]),
    ])
    assert decide(pod(), ctr, CONFIG) == Decision(reason=UNCHANGED,
                                                  detail="GPU allocation: device /dev/nvidia0")


@pytest.mark.parametrize("mount", [
    ("/tmp/vgpulock", "/var/lib/kubelet/pods/x/volumes/empty", ["rw"]),
    ("/tmp/vgpulock/hostpid", "/var/run/hami/hostpid", ["rw"]),
    ("/tmp/vgpulock/hostpid/broker.sock", "/tmp/evil.sock", ["ro"]),
    ("/tmp/./vgpulock/", "/elsewhere", []),
])
def test_shadowing_mount_gets_nothing(mount: tuple[str, str, list[str]]) -> None:
    decision = decide(pod(), gpu_container(mounts=[mount]), CONFIG)
    assert decision.reason == SHADOWED and decision.empty
    assert mount[1] in decision.detail and mount[0] in decision.detail


def test_unrelated_mounts_around_the_lock_parent_are_fine() -> None:
    ctr = gpu_container(mounts=[("/tmp", "/host/tmp", []),
                                ("/tmp/vgpulock/lock0", "/host/lock0", [])])
    assert decide(pod(), ctr, CONFIG).reason == ADJUSTED


def test_gate_off_broker_absent_opt_out() -> None:
    assert decide(pod(), gpu_container(), Config(gate=False)).reason == GATE_OFF
    assert decide(pod(), gpu_container(), CONFIG, broker_present=False).reason == BROKER_ABSENT
    for where in ("labels", "annotations"):
        opted = pod(**{where: {OPT_OUT_KEY: OPT_OUT_VALUE}})  # type: ignore[arg-type]
        decision = decide(opted, gpu_container(), CONFIG)
        assert decision.reason == OPTED_OUT and decision.empty
    assert decide(pod(labels={OPT_OUT_KEY: "yes"}), gpu_container(), CONFIG).reason == ADJUSTED


def test_parse_resource() -> None:
    assert parse_resource("nvidia.com/gpu") == PRESETS["nvidia.com/gpu"]
    assert parse_resource("device:/dev/dri/renderD*") == (Signal("device", "/dev/dri/renderD*"),)
    assert parse_resource("cdi:amd.com/gpu") == (Signal("cdi", "amd.com/gpu"),)
    for bad in ("amd.com/gpu", "device:dri", "env:NVIDIA_VISIBLE_DEVICES", "device:re:(",
                "devnull-mount:relative", "cdi:"):
        with pytest.raises(ValueError):
            parse_resource(bad)
    config = Config(signals=parse_resource("device:/dev/dri/renderD*"), gate=True)
    assert decide(pod(), container(devices=["/dev/dri/renderD128"]), config).reason == ADJUSTED
    assert decide(pod(), gpu_container(), config).reason == NOT_QUALIFYING


PATHS = st.sampled_from([
    "/tmp/vgpulock", "/tmp/vgpulock/hostpid", "/tmp/vgpulock/hostpid/broker.sock",
    "/tmp", "/data", "/tmp/vgpulock/lock0", "//tmp//vgpulock", "/tmp/vgpulock/../vgpulock",
    "/var/run/nvidia-container-devices/GPU-0", "/dev/shm",
])
SOURCES = st.sampled_from(["/tmp/vgpulock", "/var/run/hami/hostpid", "/dev/null", "/x",
                           "/var/lib/kubelet/pods/p/volumes/v"])
MOUNTS = st.lists(st.tuples(PATHS, SOURCES, st.lists(st.sampled_from(["ro", "rw", "rbind"]),
                                                     max_size=2)), max_size=4)
ENV = st.lists(st.sampled_from(["LIBVGPU_HOSTPID_BROKER=1", "LIBVGPU_HOSTPID_BROKER=0",
                                "LIBVGPU_HOSTPID_BROKER=", "NVIDIA_VISIBLE_DEVICES=all",
                                "PATH=/bin", "A=B"]), max_size=4)
DEVICES = st.lists(st.sampled_from(["/dev/nvidia0", "/dev/nvidia12", "/dev/nvidiactl",
                                    "/dev/fuse", "/dev/nvidia-uvm"]), max_size=3)
CDI = st.lists(st.sampled_from(["nvidia.com/gpu=0", "vendor.com/x=1"]), max_size=2)


@settings(max_examples=300, deadline=None)
@given(MOUNTS, ENV, DEVICES, CDI, st.booleans(), st.booleans())
def test_properties(mounts: list[tuple[str, str, list[str]]], env: list[str],
                    devices: list[str], cdi: list[str], gate: bool, present: bool) -> None:
    ctr = container(env=env, devices=devices, mounts=mounts, cdi=cdi)
    config = Config(gate=gate, broker_dir="/var/run/hami/hostpid")
    decision = decide(pod(), ctr, config, broker_present=present)
    trusted = (any(d in ("/dev/nvidia0", "/dev/nvidia12") for d in devices)
               or "nvidia.com/gpu=0" in cdi
               or any(p == "/var/run/nvidia-container-devices/GPU-0" and s == "/dev/null"
                      for p, s, _ in mounts))
    if not trusted or not gate or not present:
        assert decision.empty
        return
    if decision.reason == SHADOWED:
        assert decision.empty
        return
    after = apply(ctr, decision)
    # Once applied: the gate is exactly one "1", both canonical mounts are
    # there, and deciding again changes nothing (idempotent).
    assert [e for e in after.env if e.startswith("LIBVGPU_HOSTPID_BROKER=")] in (
        ["LIBVGPU_HOSTPID_BROKER=1"], ["LIBVGPU_HOSTPID_BROKER=1"] * env.count(
            "LIBVGPU_HOSTPID_BROKER=1"))
    again = decide(pod(), after, config)
    assert again.reason == UNCHANGED and again.empty
    # Nothing unrelated is touched: every other mount and variable is kept.
    assert [e for e in after.env if not e.startswith("LIBVGPU_HOSTPID_BROKER=")] == [
        e for e in env if not e.startswith("LIBVGPU_HOSTPID_BROKER=")]
    added = {m.destination for m in decision.mounts}
    assert [m.destination for m in after.mounts if m.destination not in added] == [
        p for p, _, _ in mounts if p not in added]


def test_unsafe_mountpoint_gives_the_lock_parent_only() -> None:
    """
    C{<lock parent>/hostpid} not a directory of the trusted UID (and not
    repaired): a mount onto it would fail the container (a file) or land
    where a symlink points inside it.  The lock parent alone, no broker
    mount, no gate; the reason names the problem.
    """
    decision = decide(pod(), gpu_container(), CONFIG,
                      mountpoint_problem="it is a symlink")
    assert decision.reason == MOUNTPOINT_UNSAFE and "it is a symlink" in decision.detail
    assert [m.destination for m in decision.mounts] == [defaults.LOCK_PARENT]
    assert decision.env == ()
    # The container's own broker mount (a device plugin's) is left as it is.
    has_both = apply(gpu_container(), decide(pod(), gpu_container(), CONFIG))
    again = decide(pod(), has_both, CONFIG, mountpoint_problem="it is a file")
    assert again.reason == MOUNTPOINT_UNSAFE and again.mounts == () and again.env == ()
    # A broker mount the plugin does not add shadows nothing; the lock
    # parent's own destination still does.
    nested = gpu_container(mounts=[("/tmp/vgpulock/hostpid/x", "/elsewhere", ["rw"])])
    assert decide(pod(), nested, CONFIG, mountpoint_problem="x").reason == MOUNTPOINT_UNSAFE
    assert decide(pod(), nested, CONFIG).reason == SHADOWED
    # Not qualifying, opted out, gate off: the mountpoint does not matter.
    assert decide(pod(), container(), CONFIG, mountpoint_problem="x").reason == NOT_QUALIFYING


@pytest.mark.parametrize("field", ["devices", "cdi", "mounts", "env"])
def test_oversized_containers_are_not_looked_at(field: str) -> None:
    """More than L{MAX_ENTRIES} entries in one list: no walk, no adjustment."""
    ctr = gpu_container()
    if field == "devices":
        for _ in range(MAX_ENTRIES):
            ctr.linux.devices.add()
    elif field == "cdi":
        for _ in range(MAX_ENTRIES + 1):
            ctr.CDI_devices.add()
    elif field == "mounts":
        for _ in range(MAX_ENTRIES + 1):
            ctr.mounts.add()
    else:
        ctr.env.extend([""] * MAX_ENTRIES)
    decision = decide(pod(), ctr, CONFIG)
    assert decision.reason == OVERSIZED and decision.empty, decision
    assert f"more than {MAX_ENTRIES}" in decision.detail


def test_paths_longer_than_path_max_are_no_signal() -> None:
    """A device or device-list mount no kernel could use is no signal."""
    long = "/dev/nvidia" + "0" * 5000
    assert decide(pod(), container(devices=[long]), CONFIG).reason == NOT_QUALIFYING
    mount = ("/var/run/nvidia-container-devices/" + "a" * 5000, "/dev/null", ["ro"])
    assert decide(pod(), container(mounts=[mount]), CONFIG).reason == NOT_QUALIFYING
