"""
CDI shaped like HAMi's DRA driver's (C{Project-HAMi/k8s-dra-driver},
C{cmd/hami-kubelet-plugin}: C{cdi.go}, C{hami_core.go}), for the tests that
give a container a GPU from a ResourceClaim: the cluster tier's DRA driver
(C{tests/cluster/draplugin.py}) and the runtime cells
(C{tests/e2e/test_nri_dra.py}), which hand the same CDI devices to the
runtime as the kubelet does.

Two CDI devices per allocated device, as HAMi names them: the standard
C{k8s.DRIVER/device=hami-gpu-N} (the device node: a character device of
NVIDIA's major, 195) and the claim's C{k8s.DRIVER/claim=UID-hami-gpu-N},
whose edits are HAMi-core's: C{CUDA_DEVICE_MEMORY_LIMIT_i} and
C{CUDA_DEVICE_SM_LIMIT_i} from the claim's consumed capacity, a read-only
C{libvgpu.so} and C{/etc/ld.so.preload}, and a bind of the lock parent
itself at C{/tmp/vgpulock}, C{rw,nosuid,nodev} (HAMi's options: no
C{noexec}).

Left out, for the tests' sake: C{libvgpu.so} is an empty stand-in and
C{ld.so.preload} is empty (a preload naming a file that is no library makes
the dynamic loader complain in every dynamically linked program, the Python
client's interpreter too); HAMi's per-claim shared cache directory
(C{CUDA_DEVICE_MEMORY_SHARED_CACHE}) is not made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: NVIDIA's character device major (C{/proc/devices}: 195 nvidia-frontend).
NVIDIA_MAJOR = 195

#: The driver's name (HAMi's is C{hami-core-gpu.project-hami.io}).
DRIVER = "gpu.hostpid.test"
#: The DeviceClass a claim names.
DEVICE_CLASS = "gpu.hostpid.test"
#: HAMi's CDI vendor is C{k8s.} and its driver's name, its classes
#: C{device} and C{claim} (C{cmd/hami-kubelet-plugin/cdi.go}).
CDI_VENDOR = f"k8s.{DRIVER}"
CDI_DEVICE_KIND = f"{CDI_VENDOR}/device"
CDI_CLAIM_KIND = f"{CDI_VENDOR}/claim"
#: Memory of each fake GPU, bytes.
GPU_MEMORY = 16 * 1024**3
#: Where HAMi's driver puts HAMi-core in the container (its C{hostHookPath}).
HOOK_DIR = "/usr/local/vgpu"
LOCK_PARENT = "/tmp/vgpulock"


def device_name(minor: int) -> str:
    return f"hami-gpu-{minor}"


def standard_spec(devices: Mapping[str, Path]) -> dict[str, Any]:
    """The driver's standard CDI spec: each device's node (NVIDIA's major)."""
    return {
        "cdiVersion": "0.5.0", "kind": CDI_DEVICE_KIND,
        "devices": [
            {"name": device_name(int(minor)),
             "containerEdits": {"deviceNodes": [
                 {"path": f"/dev/nvidia{minor}", "hostPath": str(node), "type": "c",
                  "major": NVIDIA_MAJOR, "minor": int(minor),
                  "permissions": "rw"}]}}
            for minor, node in sorted(devices.items(), key=lambda item: int(item[0]))
        ],
    }


def _mebibytes(quantity: str) -> int:
    """A memory quantity as the API server normalises it (bytes, C{Ki}, C{Mi}, C{Gi}), in MiB."""
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[:-2]) * factor // 1024**2
    return int(quantity) // 1024**2


def claim_edits(results: Sequence[Mapping[str, Any]], hook_dir: Path,
                lock_parent: Path) -> dict[str, Any]:
    """
    HAMi-core's container edits for a claim's devices (HAMi's
    C{HAMiCoreManager.GetCDIContainerEdits}): the limits by index, the
    library and the preload read-only, the lock parent read-write.
    """
    env = []
    for index, result in enumerate(results):
        consumed = result.get("consumedCapacity") or {}
        cores = consumed.get("cores", "100")
        memory = _mebibytes(consumed.get("memory", str(GPU_MEMORY)))
        env += [f"CUDA_DEVICE_SM_LIMIT_{index}={cores}",
                f"CUDA_DEVICE_MEMORY_LIMIT_{index}={memory}m"]
    read_only = ["ro", "nosuid", "nodev", "bind"]
    return {
        "env": env,
        "mounts": [
            {"containerPath": f"{HOOK_DIR}/libvgpu.so", "hostPath": str(hook_dir / "libvgpu.so"),
             "options": read_only},
            {"containerPath": "/etc/ld.so.preload", "hostPath": str(hook_dir / "ld.so.preload"),
             "options": read_only},
            {"containerPath": LOCK_PARENT, "hostPath": str(lock_parent),
             "options": ["rw", "nosuid", "nodev", "bind"]},
        ],
    }


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    """Whole or not at all: the runtime's CDI cache reads only C{*.json} files."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document))
    temporary.replace(path)


def hook_files(directory: Path) -> Path:
    """The stand-ins of HAMi-core's library and preload list, in C{directory}."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("libvgpu.so", "ld.so.preload"):
        (directory / name).touch()
    return directory
