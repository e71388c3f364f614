"""
The broker mountpoint's immutable attribute on the filesystems a lock parent
lives on, each made for the test: ext4 and xfs on loop images, tmpfs, and
overlayfs with its upper layer on ext4 and on tmpfs.

Why: the NRI plugin gives a container the broker only on a mountpoint that
carries the attribute (a HAMi device plugin makes the lock parent 0777 at every
allocation, and then any user can rename a mountpoint that lacks it).  On each
filesystem the preparation either makes it immutable, and then a UID 1000
process in the 0777 lock parent can neither rename, remove nor replace it; or
it says that the filesystem has none, naming the filesystem, and the NRI plugin
gives the lock parent alone.  ext4 and xfs always have it; tmpfs from Linux
6.0; overlayfs passes it to its upper layer for a directory from 5.13 (the
generic file attribute calls).  Each case prints what it measured (C{pytest -s}).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from support import remove_tree, require_root, require_tool
from test_lockparent import WORKLOAD_UID, run_as

from hostpid.node.lockparent import prepare_lock_parent

pytestmark = pytest.mark.privileged

#: Loop images: xfs refuses a filesystem under 300 MB; both are sparse.
IMAGE_BYTES = 320 * 1024 * 1024


def _mount(stack: ExitStack, *argv: str) -> None:
    target = argv[-1]
    subprocess.run(["mount", *argv], check=True, capture_output=True, timeout=60)
    stack.callback(subprocess.run, ["umount", "-l", target], check=False, timeout=60)


def _image(stack: ExitStack, work: Path, mkfs: str, target: Path) -> None:
    image = work / f"{Path(mkfs).name}.img"
    with open(image, "wb") as made:
        made.truncate(IMAGE_BYTES)
    subprocess.run([mkfs, "-q", str(image)] if "xfs" in mkfs else [mkfs, "-q", "-F", str(image)],
                   check=True, capture_output=True, timeout=120)
    target.mkdir()
    _mount(stack, "-o", "loop", str(image), str(target))


def _ext4(stack: ExitStack, work: Path) -> Path:
    _image(stack, work, require_tool("mkfs.ext4"), work / "ext4")
    return work / "ext4"


def _xfs(stack: ExitStack, work: Path) -> Path:
    _image(stack, work, require_tool("mkfs.xfs"), work / "xfs")
    return work / "xfs"


def _tmpfs(stack: ExitStack, work: Path) -> Path:
    (work / "tmpfs").mkdir()
    _mount(stack, "-t", "tmpfs", "-o", "mode=0755", "hostpid-test", str(work / "tmpfs"))
    return work / "tmpfs"


def _overlay(lower_fs: Callable[[ExitStack, Path], Path]) -> Callable[[ExitStack, Path], Path]:
    def made(stack: ExitStack, work: Path) -> Path:
        base = lower_fs(stack, work)
        for name in ("lower", "upper", "work"):
            (base / name).mkdir()
        merged = work / "overlay"
        merged.mkdir()
        _mount(stack, "-t", "overlay", "-o",
               f"lowerdir={base / 'lower'},upperdir={base / 'upper'},workdir={base / 'work'}",
               "hostpid-test", str(merged))
        return merged
    return made


FILESYSTEMS: dict[str, Callable[[ExitStack, Path], Path]] = {
    "ext4": _ext4,
    "xfs": _xfs,
    "tmpfs": _tmpfs,
    "overlay-on-ext4": _overlay(_ext4),
    "overlay-on-tmpfs": _overlay(_tmpfs),
}
#: Where the attribute is there on every kernel this project supports (overlayfs
#: passes it on for a directory through the generic file attribute calls of 5.13+).
ALWAYS = {"ext4", "xfs"}


@contextmanager
def filesystem(kind: str) -> Iterator[Path]:
    """A fresh filesystem of C{kind}, mounted for the test; a root 0755 directory in it."""
    require_root()
    work = Path(tempfile.mkdtemp(prefix="hostpid-fs-"))
    os.chmod(work, 0o755)
    try:
        with ExitStack() as stack:
            root = FILESYSTEMS[kind](stack, work)
            os.chmod(root, 0o755)
            yield root
            remove_tree(root / "tree", ignore_errors=True)
    finally:
        remove_tree(work, ignore_errors=True)


@pytest.mark.parametrize("kind", sorted(FILESYSTEMS))
def test_the_mountpoint_is_immutable_or_the_filesystem_is_named(kind: str) -> None:
    with filesystem(kind) as root:
        tree = root / "tree"
        tree.mkdir(mode=0o755)
        lock_parent = tree / "vgpulock"
        prepared = prepare_lock_parent(str(lock_parent), broker_enabled=True)
        entry = lock_parent / "hostpid"
        print(f"\n[fs] {kind} on {os.uname().release}: immutable={prepared.mountpoint_immutable}"
              f" {prepared.immutable_problem}")
        if kind in ALWAYS:
            assert prepared.mountpoint_immutable, prepared.immutable_problem
        if not prepared.mountpoint_immutable:
            assert "has no immutable attribute" in prepared.immutable_problem, prepared
            assert kind.partition("-")[0] in prepared.immutable_problem, prepared
            assert any("is not immutable" in line for line in prepared.describe_repairs())
            return
        # HAMi's device plugin at an allocation; then a UID 1000 tenant.
        os.chmod(lock_parent, 0o777)
        before = os.lstat(entry)

        def tenant() -> None:
            os.symlink("/etc", lock_parent / "planted")
            for attempt in (lambda: os.rename(entry, lock_parent / "moved"),
                            lambda: os.rmdir(entry),
                            lambda: os.rename(lock_parent / "planted", entry)):
                with pytest.raises(PermissionError):
                    attempt()

        run_as(WORKLOAD_UID, tenant)
        after = os.lstat(entry)
        assert (after.st_ino, after.st_uid, after.st_mode) == (
            before.st_ino, before.st_uid, before.st_mode)
