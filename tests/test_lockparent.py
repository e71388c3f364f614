"""
Lock parent preparation and the broker mountpoint (issues 4 and 9), in a
private tree on the real filesystem, as root.

Planted entries are made by a real process running as UID 1000 (a forked
child that drops its privileges), so ownership and the sticky bit are the
kernel's, not the test's imitation of them.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from kernelfeatures import kernel_feature
from support import as_user_argv, hostpid_argv, release_immutable, require_root, subprocess_env
from twisted.logger import ILogObserver, globalLogPublisher

from hostpid import fileattr
from hostpid.node.lockparent import (
    BUILD_PREFIX,
    MARKER_NAME,
    QUARANTINE_PREFIX,
    LockParentError,
    PreparedLockParent,
    prepare_lock_parent,
)

WORKLOAD_UID = 1000
OTHER_UID = 1234
MARKER = "do not touch\n"


@pytest.fixture
def tree(public_tmp: Path) -> Path:
    """
    A root-owned 0755 directory directly in C{/tmp}, standing in for C{/tmp}.

    Not pytest's C{tmp_path}: that lives under a 0700 directory a UID 1000
    child could not traverse.
    """
    require_root()
    return public_tmp


def run_as(uid: int, action: Callable[[], object]) -> None:
    """
    Run C{action} in a forked child that has dropped to C{uid} (and the same
    GID), and fail with the child's traceback if it fails.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action()
            status = 0
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as errors:
        message = errors.read().decode()
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0, f"UID {uid} child failed:\n{message}"


def identity(path: Path) -> tuple[int, int, int, int, int]:
    """What must not change about an entry we promise not to touch."""
    st = os.lstat(path)
    return (st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_mtime_ns)


def prepare(tree: Path, **kwargs: object) -> PreparedLockParent:
    kwargs.setdefault("broker_enabled", False)
    return prepare_lock_parent(str(tree / "vgpulock"), **kwargs)  # type: ignore[arg-type]


def assert_lock_parent(path: Path) -> None:
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode)
    assert st.st_uid == 0
    assert stat.S_IMODE(st.st_mode) == 0o1777


def is_immutable(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        return fileattr.is_immutable(fd)
    finally:
        os.close(fd)


def assert_mountpoint(path: Path) -> None:
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode), f"{path} is not a directory"
    assert st.st_uid == 0
    assert stat.S_IMODE(st.st_mode) == 0o755


# The lock parent -----------------------------------------------------------


def test_fresh_lock_parent(tree: Path) -> None:
    prepared = prepare(tree)
    assert_lock_parent(tree / "vgpulock")
    st = os.stat(tree / "vgpulock")
    assert (prepared.device, prepared.inode) == (st.st_dev, st.st_ino)
    assert prepared.path == str(tree / "vgpulock")
    assert not prepared.broker_mountpoint
    assert os.listdir(tree / "vgpulock") == []


def test_preparing_twice_keeps_the_same_directory(tree: Path) -> None:
    first = prepare(tree)
    (tree / "vgpulock" / "lock.0").write_text("held")
    second = prepare(tree)
    assert (first.device, first.inode) == (second.device, second.inode)
    assert (tree / "vgpulock" / "lock.0").read_text() == "held"


def test_umask_077_still_yields_01777(tree: Path) -> None:
    old = os.umask(0o077)
    try:
        prepare(tree, broker_enabled=True)
    finally:
        os.umask(old)
    assert_lock_parent(tree / "vgpulock")
    assert_mountpoint(tree / "vgpulock" / "hostpid")


def test_existing_0755_child_fixed_to_01777(tree: Path) -> None:
    os.mkdir(tree / "vgpulock")
    os.chmod(tree / "vgpulock", 0o755)
    prepare(tree)
    assert_lock_parent(tree / "vgpulock")


def test_parent_owned_by_another_uid(tree: Path) -> None:
    os.chown(tree, OTHER_UID, OTHER_UID)
    with pytest.raises(LockParentError) as caught:
        prepare(tree)
    assert caught.value.path == str(tree)
    assert f"owned by UID {OTHER_UID}" in caught.value.rule
    assert not (tree / "vgpulock").exists()


def test_parent_writable_without_sticky_bit(tree: Path) -> None:
    os.chmod(tree, 0o777)
    with pytest.raises(LockParentError) as caught:
        prepare(tree)
    assert "without the sticky bit" in str(caught.value)
    assert not (tree / "vgpulock").exists()


def test_parent_writable_with_sticky_bit_is_fine(tree: Path) -> None:
    os.chmod(tree, 0o1777)
    prepare(tree)
    assert_lock_parent(tree / "vgpulock")


def test_group_writable_parent_without_sticky_bit(tree: Path) -> None:
    os.chmod(tree, 0o775)
    with pytest.raises(LockParentError, match="without the sticky bit"):
        prepare(tree)


def test_child_is_a_regular_file(tree: Path) -> None:
    (tree / "vgpulock").write_text(MARKER)
    before = identity(tree / "vgpulock")
    with pytest.raises(LockParentError) as caught:
        prepare(tree)
    assert caught.value.rule == "is a regular file, not a directory (left untouched)"
    assert identity(tree / "vgpulock") == before
    assert (tree / "vgpulock").read_text() == MARKER


def test_child_is_a_symlink_target_untouched(tree: Path) -> None:
    target = tree / "elsewhere"
    target.mkdir(mode=0o700)
    (target / "marker").write_text(MARKER)
    (tree / "vgpulock").symlink_to(target)
    before = identity(target)
    with pytest.raises(LockParentError) as caught:
        prepare(tree, broker_enabled=True)
    assert "symlink" in caught.value.rule
    assert identity(target) == before
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert os.listdir(target) == ["marker"]
    assert (target / "marker").read_text() == MARKER


def test_symlinked_parent(tree: Path) -> None:
    real = tree / "real"
    real.mkdir(mode=0o755)
    (tree / "link").symlink_to(real)
    with pytest.raises(LockParentError) as caught:
        prepare_lock_parent(str(tree / "link" / "vgpulock"), broker_enabled=False)
    assert caught.value.path == str(tree / "link")
    assert "symlink" in caught.value.rule
    assert os.listdir(real) == []


def test_symlinked_ancestor(tree: Path) -> None:
    (tree / "real" / "tmp").mkdir(parents=True, mode=0o755)
    (tree / "link").symlink_to(tree / "real")
    with pytest.raises(LockParentError, match="symlink"):
        prepare_lock_parent(str(tree / "link" / "tmp" / "vgpulock"), broker_enabled=False)
    assert os.listdir(tree / "real" / "tmp") == []


def test_ancestor_writable_by_others(tree: Path) -> None:
    (tree / "open").mkdir()
    os.chmod(tree / "open", 0o777)
    (tree / "open" / "tmp").mkdir(mode=0o755)
    with pytest.raises(LockParentError) as caught:
        prepare_lock_parent(str(tree / "open" / "tmp" / "vgpulock"), broker_enabled=False)
    assert caught.value.path == str(tree / "open")
    assert not (tree / "open" / "tmp" / "vgpulock").exists()


def test_child_owned_by_another_uid(tree: Path) -> None:
    (tree / "vgpulock").mkdir()
    os.chmod(tree / "vgpulock", 0o755)
    os.chown(tree / "vgpulock", OTHER_UID, OTHER_UID)
    before = identity(tree / "vgpulock")
    with pytest.raises(LockParentError) as caught:
        prepare(tree)
    assert f"owned by UID {OTHER_UID}, not the trusted UID 0" in caught.value.rule
    assert identity(tree / "vgpulock") == before


@pytest.mark.parametrize("path", ["relative/vgpulock", "/", "/tmp/../tmp/vgpulock", "/tmp/./x"])
def test_unclean_paths_refused(path: str) -> None:
    with pytest.raises(LockParentError):
        prepare_lock_parent(path, broker_enabled=False)


def test_kernel_refusal_is_a_lock_parent_error() -> None:
    """A refusal no rule names (here procfs refusing mkdir) is still one clear error."""
    require_root()
    with pytest.raises(LockParentError) as caught:
        prepare_lock_parent("/proc/vgpulock", broker_enabled=False)
    assert caught.value.path == "/proc/vgpulock"
    assert caught.value.rule.startswith("cannot be prepared: ")


def test_trusted_uid_is_a_parameter(tree: Path) -> None:
    """A private tree owned by another UID is prepared when that UID is trusted."""
    os.chown(tree, OTHER_UID, OTHER_UID)

    def hand_over(step: str) -> None:
        # Root makes entries owned by root, which that rule refuses: hand
        # each new directory to the trusted UID as its owner would have made it.
        if step == "lock-parent-made":
            os.chown(tree / "vgpulock", OTHER_UID, OTHER_UID)
        if step == "mountpoint-made":
            os.chown(tree / "vgpulock" / "hostpid", OTHER_UID, OTHER_UID)

    prepared = prepare(tree, trusted_uid=OTHER_UID, broker_enabled=True, between_steps=hand_over)
    assert prepared.path == str(tree / "vgpulock")
    assert os.stat(tree / "vgpulock").st_uid == OTHER_UID
    assert os.stat(tree / "vgpulock" / "hostpid").st_uid == OTHER_UID
    with pytest.raises(LockParentError, match=f"owned by UID {OTHER_UID}"):
        prepare(tree)


# Replacement during preparation -------------------------------------------


def _replace_with_directory(path: Path) -> None:
    os.rename(path, path.with_name("moved-aside"))
    os.mkdir(path, 0o1777)
    os.chmod(path, 0o1777)


def _replace_with_symlink(path: Path) -> None:
    os.rename(path, path.with_name("moved-aside"))
    os.symlink(path.with_name("moved-aside"), path)


def _chmod_0755(path: Path) -> None:
    os.chmod(path, 0o755)


@pytest.mark.parametrize(
    ("step", "change", "expected"),
    [
        ("lock-parent-made", _replace_with_symlink, "is a symlink"),
        ("lock-parent-opened", _replace_with_directory, "changed while prepared"),
        ("lock-parent-mode-set", _replace_with_directory, "changed while prepared"),
        ("lock-parent-mode-set", _replace_with_symlink, "changed while prepared"),
        ("lock-parent-mode-set", _chmod_0755, "changed while prepared: mode is 0755"),
    ],
)
def test_child_replaced_during_preparation(
    tree: Path, step: str, change: Callable[[Path], None], expected: str
) -> None:
    seen: list[str] = []

    def hook(name: str) -> None:
        seen.append(name)
        if name == step:
            change(tree / "vgpulock")

    with pytest.raises(LockParentError) as caught:
        prepare(tree, between_steps=hook)
    assert expected in caught.value.rule
    assert caught.value.path == str(tree / "vgpulock")
    assert step in seen


def test_steps_are_reported_in_order(tree: Path) -> None:
    seen: list[str] = []
    prepare(tree, broker_enabled=True, between_steps=seen.append)
    assert seen == [
        "parent-opened",
        "lock-parent-made",
        "lock-parent-opened",
        "lock-parent-mode-set",
        "mountpoint-built",
        "mountpoint-placed",
        "mountpoint-sealed",
    ]
    seen.clear()
    prepare(tree, broker_enabled=True, between_steps=seen.append)
    assert seen[-3:] == ["mountpoint-opened", "mountpoint-mode-set", "mountpoint-sealed"]


# The broker mountpoint ----------------------------------------------------


def test_broker_enabled_makes_the_mountpoint(tree: Path) -> None:
    prepared = prepare(tree, broker_enabled=True)
    assert prepared.broker_mountpoint
    assert prepared.repair_count == 0
    assert_mountpoint(tree / "vgpulock" / "hostpid")
    again = prepare(tree, broker_enabled=True)
    assert again.repair_count == 0


def test_broker_disabled_makes_no_mountpoint(tree: Path) -> None:
    prepared = prepare(tree, broker_enabled=False)
    assert not prepared.broker_mountpoint
    assert not (tree / "vgpulock" / "hostpid").exists()


def _plant_file(mountpoint: Path) -> None:
    mountpoint.write_text("planted\n")


def _plant_symlink(mountpoint: Path) -> None:
    mountpoint.symlink_to(mountpoint.parent.parent / "target")


def _plant_empty_directory(mountpoint: Path) -> None:
    mountpoint.mkdir()


def _plant_full_directory(mountpoint: Path) -> None:
    mountpoint.mkdir()
    (mountpoint / "evidence").write_text("the workload's own file\n")
    (mountpoint / "sub").mkdir()
    (mountpoint / "sub" / "deeper").write_text("deeper\n")


PLANTED = {
    "regular file": (_plant_file, "regular file", "removed"),
    "symlink to a directory": (_plant_symlink, "symlink", "removed"),
    "empty directory": (_plant_empty_directory, "directory", "quarantined"),
    "non-empty directory": (_plant_full_directory, "directory", "quarantined"),
}


@pytest.fixture
def planted_tree(tree: Path) -> Path:
    """A prepared lock parent and a root-owned symlink target with a marker."""
    prepare(tree, broker_enabled=False)
    target = tree / "target"
    target.mkdir(mode=0o755)
    (target / "marker").write_text(MARKER)
    return tree


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_planted_mountpoint_repaired(planted_tree: Path, case: str) -> None:
    plant, found, action = PLANTED[case]
    mountpoint = planted_tree / "vgpulock" / "hostpid"
    run_as(WORKLOAD_UID, lambda: plant(mountpoint))
    assert os.lstat(mountpoint).st_uid == WORKLOAD_UID
    target = planted_tree / "target"
    target_before = identity(target)
    events: list[dict[str, object]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    try:
        prepared = prepare(planted_tree, broker_enabled=True)
    finally:
        globalLogPublisher.removeObserver(observer)

    assert_mountpoint(mountpoint)
    assert os.listdir(mountpoint) == []
    assert prepared.repair_count == 1
    (repair,) = prepared.repairs
    assert (repair.found, repair.owner_uid, repair.action) == (found, WORKLOAD_UID, action)
    logged = [e for e in events if e.get("log_namespace") == "hostpid.lockparent"]
    assert [(e["found"], e["owner_uid"], e["action"]) for e in logged] == [
        (found, WORKLOAD_UID, action)
    ]
    # The symlink's target and its marker are untouched, whatever was planted.
    assert identity(target) == target_before
    assert os.listdir(target) == ["marker"]
    assert (target / "marker").read_text() == MARKER

    entries = sorted(os.listdir(planted_tree / "vgpulock"))
    if action == "quarantined":
        assert repair.quarantine_name is not None
        assert repair.quarantine_name.startswith(QUARANTINE_PREFIX)
        assert entries == sorted(["hostpid", MARKER_NAME, repair.quarantine_name])
        quarantined = planted_tree / "vgpulock" / repair.quarantine_name
        assert os.lstat(quarantined).st_uid == WORKLOAD_UID
        if case == "non-empty directory":
            assert (quarantined / "evidence").read_text() == "the workload's own file\n"
            assert (quarantined / "sub" / "deeper").read_text() == "deeper\n"
        else:
            assert os.listdir(quarantined) == []
    else:
        assert repair.quarantine_name is None
        assert entries == sorted(["hostpid", MARKER_NAME])

    # Once repaired, the next preparation has nothing to do.
    assert prepare(planted_tree, broker_enabled=True).repair_count == 0


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_planted_mountpoint_untouched_when_disabled(planted_tree: Path, case: str) -> None:
    plant, _, _ = PLANTED[case]
    mountpoint = planted_tree / "vgpulock" / "hostpid"
    run_as(WORKLOAD_UID, lambda: plant(mountpoint))
    before = identity(mountpoint)
    listing = sorted(os.listdir(mountpoint)) if not mountpoint.is_symlink() and \
        mountpoint.is_dir() else None
    target_before = identity(planted_tree / "target")

    prepared = prepare(planted_tree, broker_enabled=False)

    assert prepared.repair_count == 0
    assert identity(mountpoint) == before
    assert os.listdir(planted_tree / "vgpulock") == ["hostpid"]
    if listing is not None:
        assert sorted(os.listdir(mountpoint)) == listing
    assert identity(planted_tree / "target") == target_before
    assert (planted_tree / "target" / "marker").read_text() == MARKER


def test_root_owned_mountpoint_with_wrong_mode_restored(tree: Path) -> None:
    prepare(tree, broker_enabled=True)
    mountpoint = tree / "vgpulock" / "hostpid"
    release_immutable(mountpoint)  # only root with CAP_LINUX_IMMUTABLE can chmod it
    os.chmod(mountpoint, 0o777)
    inode = os.stat(mountpoint).st_ino
    prepared = prepare(tree, broker_enabled=True)
    assert [(r.found, r.owner_uid, r.mode, r.action) for r in prepared.repairs] == [
        ("directory", 0, 0o777, "mode restored")
    ]
    assert_mountpoint(mountpoint)
    assert os.stat(mountpoint).st_ino == inode


@kernel_feature("immutable_tmp")
def test_mountpoint_replaced_after_placement_is_detected(tree: Path) -> None:
    """
    The placed directory is replaced before its immutable attribute is set
    (a rename in a 0777 lock parent can do that): the check after the flag
    sees it, the directory moved away loses the flag again (it is no longer
    the mountpoint), and the preparation tries again: the directory now
    there is kept and made immutable.
    """
    mountpoint = tree / "vgpulock" / "hostpid"
    aside = tree / "vgpulock" / "aside"
    seen: list[str] = []

    def hook(step: str) -> None:
        seen.append(step)
        if step == "mountpoint-placed" and not aside.exists():
            os.rename(mountpoint, aside)
            os.mkdir(mountpoint, 0o755)

    prepared = prepare(tree, broker_enabled=True, between_steps=hook)
    assert seen.count("mountpoint-sealed") == 2, seen
    assert_mountpoint(mountpoint)
    assert prepared.mountpoint_inode == os.stat(mountpoint).st_ino
    assert is_immutable(mountpoint) and prepared.mountpoint_immutable
    assert not is_immutable(aside)
    os.rmdir(aside)


@kernel_feature("immutable_tmp")
def test_mountpoint_mode_changed_after_placement_is_detected(tree: Path) -> None:
    """A mode changed between the placement and the flag is seen, and restored."""
    mountpoint = tree / "vgpulock" / "hostpid"
    changed: list[int] = []

    def hook(step: str) -> None:
        if step == "mountpoint-placed" and not changed:
            os.chmod(mountpoint, 0o777)
            changed.append(os.stat(mountpoint).st_ino)

    prepared = prepare(tree, broker_enabled=True, between_steps=hook)
    assert [(r.found, r.mode, r.action) for r in prepared.repairs] == [
        ("directory", 0o777, "mode restored")]
    assert_mountpoint(mountpoint)
    assert changed == [os.stat(mountpoint).st_ino] and is_immutable(mountpoint)


@kernel_feature("immutable_tmp")
def test_adopted_mountpoint_mode_changed_after_chmod_is_detected(tree: Path) -> None:
    """
    Root (with CAP_LINUX_IMMUTABLE: nobody else can) clears the flag and
    changes the mode between the restore and the flag: seen, and restored.
    """
    prepare(tree, broker_enabled=True)
    mountpoint = tree / "vgpulock" / "hostpid"
    changed: list[str] = []

    def hook(step: str) -> None:
        if step == "mountpoint-mode-set" and not changed:
            release_immutable(mountpoint)
            os.chmod(mountpoint, 0o777)
            changed.append(step)

    prepared = prepare(tree, broker_enabled=True, between_steps=hook)
    assert changed and [r.action for r in prepared.repairs] == ["mode restored"]
    assert_mountpoint(mountpoint)
    assert is_immutable(mountpoint)


@pytest.mark.parametrize("planted", ["symlink", "directory"])
def test_entry_planted_while_building_is_swapped_out(tree: Path, planted: str) -> None:
    """
    A workload plants the name after the preparation looked and before the
    finished directory is put in place: the exchange swaps it out in one step
    (the name is never free), and it is removed or quarantined, never followed.
    """
    target = tree / "target"
    target.mkdir(mode=0o755)
    (target / "marker").write_text(MARKER)
    before = identity(target)
    mountpoint = tree / "vgpulock" / "hostpid"

    def plant() -> None:
        if planted == "symlink":
            os.symlink(target, mountpoint)
        else:
            os.mkdir(mountpoint)
            (mountpoint / "evidence").write_text("mine\n")

    def hook(step: str) -> None:
        if step == "mountpoint-built":
            run_as(WORKLOAD_UID, plant)

    prepared = prepare(tree, broker_enabled=True, between_steps=hook)
    assert_mountpoint(mountpoint)
    (repair,) = prepared.repairs
    assert (repair.found, repair.owner_uid) == (planted, WORKLOAD_UID)
    assert identity(target) == before and os.listdir(target) == ["marker"]
    entries = os.listdir(tree / "vgpulock")
    if planted == "symlink":
        assert repair.action == "removed"
        assert sorted(entries) == sorted(["hostpid", MARKER_NAME])
    else:
        assert repair.action == "quarantined" and repair.quarantine_name in entries
        assert (tree / "vgpulock" / repair.quarantine_name / "evidence").read_text() == "mine\n"


def test_concurrent_allocation_directory_is_kept(tree: Path) -> None:
    """Another allocation's finished directory, placed first, is adopted, not swapped."""
    prepare(tree, broker_enabled=False)
    mountpoint = tree / "vgpulock" / "hostpid"
    inode: list[int] = []

    def hook(step: str) -> None:
        if step == "mountpoint-built" and not inode:
            inode.append(prepare(tree, broker_enabled=True).mountpoint_inode or 0)

    prepared = prepare(tree, broker_enabled=True, between_steps=hook)
    assert prepared.mountpoint_inode == inode[0] == os.lstat(mountpoint).st_ino
    assert prepared.repairs == ()
    assert sorted(os.listdir(tree / "vgpulock")) == sorted(["hostpid", MARKER_NAME])


def test_removed_mountpoint_is_reported(tree: Path) -> None:
    """
    A mountpoint an earlier allocation made, gone later
    (only root can remove it), is reported and counted when it is made again.
    """
    prepare(tree, broker_enabled=True)
    release_immutable(tree / "vgpulock" / "hostpid")
    os.rmdir(tree / "vgpulock" / "hostpid")
    events: list[dict[str, object]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    try:
        prepared = prepare(tree, broker_enabled=True)
    finally:
        globalLogPublisher.removeObserver(observer)
    assert [r.found for r in prepared.repairs] == ["missing mountpoint"]
    lines = prepared.describe_repairs()
    assert lines[0] == (
        f"repaired {tree / 'vgpulock' / 'hostpid'}: it was missing although an earlier "
        "allocation made it; made again (it had been removed since an earlier allocation "
        "made it)"
    )
    # And, on a filesystem without the immutable attribute, one line that says so.
    assert len(lines) == (1 if prepared.mountpoint_immutable else 2), lines
    assert [e["found"] for e in events if e.get("log_namespace") == "hostpid.lockparent"] == [
        "missing mountpoint"
    ]
    assert_mountpoint(tree / "vgpulock" / "hostpid")
    # A first preparation of a fresh lock parent reports nothing.
    (tree / "fresh").mkdir(mode=0o755)
    assert prepare(tree / "fresh", broker_enabled=True).repairs == ()


# The command ---------------------------------------------------------------


def _run_cli(*args: str, gate: str | None) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    env.pop("LIBVGPU_HOSTPID_BROKER", None)
    if gate is not None:
        env["LIBVGPU_HOSTPID_BROKER"] = gate
    return subprocess.run(
        hostpid_argv(*args), env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_cli_prepares(tree: Path) -> None:
    result = _run_cli("prepare-lock-parent", "--path", str(tree / "vgpulock"), gate="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{tree / 'vgpulock'}: lock parent prepared\n"
    assert_lock_parent(tree / "vgpulock")
    assert not (tree / "vgpulock" / "hostpid").exists()


def test_cli_repairs_the_mountpoint_when_enabled(planted_tree: Path) -> None:
    mountpoint = planted_tree / "vgpulock" / "hostpid"
    run_as(WORKLOAD_UID, lambda: mountpoint.write_text("planted\n"))
    result = _run_cli(
        "prepare-lock-parent", "--path", str(planted_tree / "vgpulock"), gate="1"
    )
    assert result.returncode == 0, result.stderr
    assert "found a regular file owned by UID 1000" in result.stderr
    assert_mountpoint(mountpoint)


def test_cli_refuses_an_unsafe_lock_parent(tree: Path) -> None:
    (tree / "vgpulock").symlink_to("/etc")
    result = _run_cli("prepare-lock-parent", "--path", str(tree / "vgpulock"), gate="1")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert str(tree / "vgpulock") in result.stderr
    assert "symlink" in result.stderr


# A racing tenant ----------------------------------------------------------

#: How many fresh lock parents each planter variant races.
RACE_ROUNDS = 32

#: A UID 1000 loop that re-creates the mountpoint the moment it disappears,
#: as a regular file or as a directory, until it is killed.  It never stops
#: on an error: EEXIST (something is there) and EACCES just mean "try again".
PLANTER = """
import os, sys
path, kind = sys.argv[1], sys.argv[2]
flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
ready = False
while True:
    if not ready:
        # One full turn is done: tell the test the race is on.
        ready = os.write(1, b"ready\\n") > 0
    try:
        if kind == "file":
            os.close(os.open(path, flags, 0o644))
        elif kind == "directory":
            os.mkdir(path, 0o777)
        else:  # flapping: its own entry appears and disappears all the time
            os.close(os.open(path, flags, 0o644))
            os.unlink(path)
    except OSError:
        pass
"""


@pytest.mark.parametrize("kind", ["file", "directory", "flapping"])
def test_racing_planter_never_fails_an_allocation(tree: Path, kind: str) -> None:
    """
    A real UID 1000 process re-creates C{hostpid} as soon as
    it disappears.  Over many fresh lock parents every broker-enabled
    preparation must succeed with the broker's own directory in place, and
    leave at most one quarantined entry behind.
    """
    from support import as_user_argv, wait_for

    failures: list[str] = []
    quarantined: list[int] = []
    for round_ in range(RACE_ROUNDS):
        home = tree / f"round-{round_}"
        home.mkdir(mode=0o755)
        prepare(home, broker_enabled=False)
        mountpoint = home / "vgpulock" / "hostpid"
        planter = subprocess.Popen(
            as_user_argv(WORKLOAD_UID, [sys.executable, "-c", PLANTER, str(mountpoint), kind]),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        )
        try:
            assert planter.stdout is not None
            assert planter.stdout.readline() == b"ready\n"
            if kind != "flapping":
                wait_for(lambda m=mountpoint: os.path.lexists(m), "the planter's first entry")
                assert os.lstat(mountpoint).st_uid == WORKLOAD_UID
            try:
                prepared = prepare(home, broker_enabled=True)
            except LockParentError as e:
                failures.append(str(e))
            else:
                assert_mountpoint(mountpoint)
                # Still the broker's while the planter keeps trying.
                assert os.lstat(mountpoint).st_ino == prepared.mountpoint_inode
        finally:
            planter.kill()
            planter.communicate()
        entries = os.listdir(home / "vgpulock")
        quarantined.append(sum(e.startswith(QUARANTINE_PREFIX) for e in entries))
        assert not [e for e in entries if e.startswith(BUILD_PREFIX)], entries
    print(f"\n[race] {kind}: {len(failures)} of {RACE_ROUNDS} allocations failed; "
          f"quarantined per allocation: {quarantined}")
    assert failures == []
    assert max(quarantined) <= 1


# A non-root run --------------------------------------------------------------


def _run_cli_as(uid: int, *args: str, gate: str) -> subprocess.CompletedProcess[str]:
    """C{hostpid ARGS} run by a real process of C{uid} (L{support.as_user_argv})."""
    env = subprocess_env({"LIBVGPU_HOSTPID_BROKER": gate})
    return subprocess.run(as_user_argv(uid, hostpid_argv(*args)), env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_non_root_prepare_creates_nothing_and_says_how_to_recover(tree: Path) -> None:
    """
    A UID 1000 C{hostpid prepare-lock-parent} where the lock parent does not
    exist yet, in a C{/tmp}-like 01777 directory it can write: it must not
    create it (a lock parent owned by that user is refused by root's
    preparation and by a broker with C{--cdi-dir} from then on), and its
    error says to run it as root.  Root's preparation then succeeds.
    """
    os.chmod(tree, 0o1777)
    lock_parent = tree / "vgpulock"
    refused = _run_cli_as(WORKLOAD_UID, "prepare-lock-parent", "--path", str(lock_parent),
                          gate="1")
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert not lock_parent.exists(), f"created by UID 1000: {os.lstat(lock_parent)}"
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert f"{lock_parent}: does not exist, and this process runs as UID {WORKLOAD_UID}" \
        in refused.stderr, refused.stderr
    assert "run `hostpid prepare-lock-parent` as UID 0 (root)" in refused.stderr
    prepared = _run_cli("prepare-lock-parent", "--path", str(lock_parent), gate="1")
    assert prepared.returncode == 0, prepared.stderr
    assert_lock_parent(lock_parent)
    assert_mountpoint(lock_parent / "hostpid")
    # Prepared, it can be checked by anyone: exit 0, nothing changed.
    before = identity(lock_parent)
    checked = _run_cli_as(WORKLOAD_UID, "prepare-lock-parent", "--path", str(lock_parent),
                          gate="1")
    assert checked.returncode == 0, checked.stderr
    assert identity(lock_parent) == before


def test_a_lock_parent_owned_by_a_user_names_the_recovery(tree: Path) -> None:
    """
    A lock parent a non-root run made before (an older release did) is left
    untouched, and root's refusal says how to recover: move it aside.
    """
    os.mkdir(tree / "vgpulock", 0o755)
    os.chown(tree / "vgpulock", WORKLOAD_UID, WORKLOAD_UID)
    result = _run_cli("prepare-lock-parent", "--path", str(tree / "vgpulock"), gate="1")
    assert result.returncode == 1, result
    lock_parent = tree / "vgpulock"
    assert f"is owned by UID {WORKLOAD_UID}, not the trusted UID 0" in result.stderr
    assert f"mv {lock_parent} {lock_parent}.uid{WORKLOAD_UID}" in result.stderr, result.stderr
    assert os.lstat(lock_parent).st_uid == WORKLOAD_UID and not (lock_parent / "hostpid").exists()
