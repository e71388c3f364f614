"""
The NRI plugin's decision (L{hostpid.nri.decision}) for containers whose GPU
came from a ResourceClaim, shaped as a DRA driver like HAMi's leaves them
before NRI sees them (C{docs/dra.md}): the CDI edits already injected (the
device node, HAMi-core's environment, a read-only library and preload, and a
bind of the lock parent itself, C{rw,nosuid,nodev}, no C{noexec}), and on
containerd the CDI names too (CRI-O shows NRI none).

Why each check exists:

- the broker mount and the gate are added once and the driver's bind of
  the lock parent is kept, not doubled: the plugin's own lock parent mount
  would replace it at the same destination, with other options;
- the signal that holds on every runtime is the device node (character
  major 195), not the CDI names, which CRI-O does not show and which are
  the driver's kind, not C{nvidia.com/gpu};
- a driver binding another host path at C{/tmp/vgpulock} than the
  plugin's lock parent is left as it is, with a reason (never failed);
- a driver whose devices are no NVIDIA device nodes qualifies through
  C{--resource cdi:KIND}, on a runtime that shows CDI names.
"""

from __future__ import annotations

from nrilib import container, pod
from test_nri_decision import CONFIG, apply

from hostpid.nri import api_pb2
from hostpid.nri.decision import (
    ADJUSTED,
    NOT_QUALIFYING,
    SHADOWED,
    UNCHANGED,
    Config,
    decide,
    parse_resource,
)

#: HAMi's driver's CDI kinds (its name with C{k8s.} before it; classes
#: C{device} and C{claim}).
HAMI_DEVICE_KIND = "k8s.hami-core-gpu.project-hami.io/device"
HAMI_CLAIM_KIND = "k8s.hami-core-gpu.project-hami.io/claim"
HAMI_BIND = ["rw", "nosuid", "nodev", "bind"]


def dra_container(cdi_names: bool = True, lock_parent: str = "/tmp/vgpulock",
                  devices: tuple[str, ...] = ("/dev/nvidia3",)) -> api_pb2.Container:
    """A container a HAMi-shaped DRA driver's claim was injected into."""
    return container(
        "dra", devices=devices,
        env=["PATH=/usr/bin:/bin", "CUDA_DEVICE_SM_LIMIT_0=50",
             "CUDA_DEVICE_MEMORY_LIMIT_0=8192m"],
        mounts=[("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so",
                 ["ro", "nosuid", "nodev", "bind"]),
                ("/etc/ld.so.preload", "/usr/local/vgpu/ld.so.preload",
                 ["ro", "nosuid", "nodev", "bind"]),
                ("/tmp/vgpulock", lock_parent, HAMI_BIND)],
        cdi=[f"{HAMI_DEVICE_KIND}=hami-gpu-3", f"{HAMI_CLAIM_KIND}=0f1e-hami-gpu-3"]
        if cdi_names else [])


def test_driver_bind_kept_broker_added_once() -> None:
    decision = decide(pod(), dra_container(), CONFIG)
    assert decision.reason == ADJUSTED and "/dev/nvidia3" in decision.detail
    assert [(m.destination, m.source) for m in decision.mounts] == [
        ("/tmp/vgpulock/hostpid", CONFIG.broker_dir)]
    assert decision.env == (("LIBVGPU_HOSTPID_BROKER", "1"),)
    after = apply(dra_container(), decision)
    locks = [m for m in after.mounts if m.destination == "/tmp/vgpulock"]
    assert [list(m.options) for m in locks] == [HAMI_BIND]
    assert [m.destination for m in after.mounts].count("/tmp/vgpulock/hostpid") == 1
    assert decide(pod(), after, CONFIG).reason == UNCHANGED


def test_device_node_holds_without_cdi_names() -> None:
    """CRI-O shows NRI no CDI names: the device node is the signal there."""
    with_names = decide(pod(), dra_container(), CONFIG)
    without = decide(pod(), dra_container(cdi_names=False), CONFIG)
    assert without == with_names


def test_driver_cdi_names_alone_are_not_the_preset() -> None:
    """The default preset knows C{nvidia.com/gpu} CDI names, not a DRA driver's kinds."""
    ctr = dra_container(devices=())
    assert decide(pod(), ctr, CONFIG).reason == NOT_QUALIFYING
    config = Config(signals=parse_resource(f"cdi:{HAMI_DEVICE_KIND}"), gate=True,
                    broker_dir=CONFIG.broker_dir)
    decision = decide(pod(), ctr, config)
    assert decision.reason == ADJUSTED and HAMI_DEVICE_KIND in decision.detail


def test_driver_bind_of_another_lock_parent_is_left_alone() -> None:
    decision = decide(pod(), dra_container(lock_parent="/var/lib/hami/vgpulock"), CONFIG)
    assert decision.reason == SHADOWED and decision.empty
    assert "/var/lib/hami/vgpulock" in decision.detail
