"""
The guest's initramfs: Debian's static busybox, the modules that reach the
host's root (virtio PCI, 9p, overlay) taken from the kernel package itself,
and an C{/init} that mounts that root read-only with a tmpfs overlay on top
and C{switch_root}s into it.

The kernel packages ship no C{modules.dep} (their postinst runs C{depmod}),
so each module's dependencies are read from its own C{.modinfo} section
(C{depends=...}) and the modules are loaded in dependency order.  Modules
compressed in the package (C{.ko.xz} from 6.12 on) are decompressed here,
so that busybox's C{insmod} needs no decompressor of its own.
"""

from __future__ import annotations

import lzma
import os
import re
import stat
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from kernels.debian import UnpackedKernel

#: What the guest needs to reach its root: the virtio PCI transport, 9p over
#: virtio, and overlayfs.  Their dependencies (netfs, fscache, 9pnet, virtio,
#: virtio_ring ...) follow from each module's own C{depends=}.
WANTED = ("virtio_pci", "9pnet_virtio", "9p", "overlay")

#: Where the job share is mounted in the guest's new root.
JOB_MOUNT = "/mnt/hostpid-job"

#: Options for the 9p mounts: 9P2000.L over virtio with a larger message
#: size (the 5.10 transport's limit is 512 KiB).
P9_OPTIONS = "trans=virtio,version=9p2000.L,msize=262144"


def busybox_static() -> Path:
    """The binary that Debian's C{busybox-static} package installs."""
    listed = subprocess.run(
        ["dpkg-query", "-L", "busybox-static"], capture_output=True, text=True, check=False
    )
    for line in listed.stdout.splitlines():
        if line.endswith("/bin/busybox") and os.path.isfile(line):
            return Path(line)
    raise RuntimeError("busybox-static is not installed (apt-get install busybox-static)")


def _module_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".zst"):
        return subprocess.run(
            ["zstd", "-dc", str(path)], capture_output=True, check=True
        ).stdout
    return data


def _module_name(path: Path) -> str:
    return re.sub(r"\.ko(\.xz|\.zst|\.gz)?$", "", path.name).replace("-", "_")


def _depends(image: bytes) -> list[str]:
    """The C{depends=} field of a module's C{.modinfo} section."""
    match = re.search(rb"(?:^|\0)depends=([^\0]*)\0", image)
    if match is None or not match.group(1):
        return []
    return [name.replace("-", "_") for name in match.group(1).decode().split(",")]


def modules_in_load_order(
    unpacked: UnpackedKernel, wanted: Sequence[str] = WANTED
) -> list[tuple[str, bytes]]:
    """
    C{wanted} and everything they depend on, each after its dependencies,
    as (name, uncompressed module) pairs.  A wanted module the kernel has
    built in is not in the package and needs no loading.
    """
    files = {_module_name(path): path for path in unpacked.modules.rglob("*.ko*")}
    builtin_list = unpacked.modules / "modules.builtin"
    builtin = {
        _module_name(Path(line)) for line in builtin_list.read_text().split()
    } if builtin_list.is_file() else set()
    order: list[tuple[str, bytes]] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in seen:
            return
        if name not in files:
            if name in builtin:
                seen.add(name)
                return
            raise RuntimeError(f"{unpacked.release} has no module {name} (needed by {chain})")
        seen.add(name)
        image = _module_bytes(files[name])
        for dependency in _depends(image):
            visit(dependency, (*chain, name))
        order.append((name, image))

    for name in wanted:
        visit(name, ())
    return order


def _newc(entries: Iterable[tuple[str, int, bytes, int]]) -> bytes:
    """
    A cpio archive in the kernel's C{newc} format from (name, mode, data,
    rdev) entries; the C{TRAILER!!!} entry is added.
    """
    out = bytearray()

    def pad() -> None:
        out.extend(b"\0" * (-len(out) % 4))

    for inode, (name, mode, data, rdev) in enumerate(
        [*entries, ("TRAILER!!!", 0, b"", 0)], start=1
    ):
        encoded = name.encode() + b"\0"
        fields = (
            inode, mode, 0, 0, 2 if stat.S_ISDIR(mode) else 1, 0, len(data),
            0, 0, os.major(rdev), os.minor(rdev), len(encoded), 0,
        )
        out.extend(b"070701" + b"".join(b"%08X" % field for field in fields))
        out.extend(encoded)
        pad()
        out.extend(data)
        pad()
    return bytes(out)


def init_script(modules: Sequence[str]) -> str:
    """
    The initramfs C{/init}.  The second stage's path comes from the kernel
    command line (C{hostpid_stage2=}, which the kernel passes to init in its
    environment); it lives in the host's tree, seen through the overlay.
    """
    loads = "\n".join(f"load {name}" for name in modules)
    return f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
fail() {{ echo "hostpid-initramfs: $*"; echo o > /proc/sysrq-trigger; sleep 60; }}
load() {{ insmod "/modules/$1.ko" || fail "insmod $1 failed"; }}
{loads}
mount -t 9p -o {P9_OPTIONS},ro,cache=loose hostroot /lower || fail "mounting the host's root failed"
mount -t tmpfs -o mode=0755 overlay-upper /upper || fail "tmpfs for the overlay failed"
mkdir -p /upper/data /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot \\
    || fail "the overlay failed"
mkdir -p /newroot{JOB_MOUNT}
mount -t 9p -o {P9_OPTIONS} job /newroot{JOB_MOUNT} || fail "mounting the job share failed"
umount /dev
umount /proc
exec switch_root /newroot /bin/sh "$hostpid_stage2"
"""


def build(unpacked: UnpackedKernel, destination: Path) -> Path:
    """Write the initramfs for C{unpacked} to C{destination} (uncompressed newc)."""
    modules = modules_in_load_order(unpacked)
    directory = stat.S_IFDIR | 0o755
    entries: list[tuple[str, int, bytes, int]] = [
        (name, directory, b"", 0)
        for name in ("bin", "dev", "proc", "sys", "lower", "upper", "newroot", "modules")
    ]
    entries.append(("dev/console", stat.S_IFCHR | 0o600, b"", os.makedev(5, 1)))
    entries.append(("bin/busybox", stat.S_IFREG | 0o755, busybox_static().read_bytes(), 0))
    entries.append(
        ("init", stat.S_IFREG | 0o755, init_script([n for n, _ in modules]).encode(), 0)
    )
    entries.extend(
        (f"modules/{name}.ko", stat.S_IFREG | 0o644, image, 0) for name, image in modules
    )
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    partial.write_bytes(_newc(entries))
    partial.rename(destination)
    return destination
