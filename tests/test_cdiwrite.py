"""
Writing the CDI spec and C{hostpid cdi}, as root, in a
private tree on the real filesystem.

Foreign files are made by the kernel for a real other UID where ownership is
the point (C{chown} as root gives the same inode state a UID 1000 process
would leave, and a UID 1000 process could not write into a root 0755 spec
directory in the first place: that is the rule under test).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cdischema import schema_errors
from support import hostpid_argv, require_root, subprocess_env

from hostpid.gate import GATE_ENV
from hostpid.node import cdi
from hostpid.node.cdiwrite import (
    CdiWriteError,
    open_spec_directory,
    publish_spec,
)
from hostpid.node.lockparent import LockParentError

OTHER_UID = 1000
MARKER = "not ours\n"

pytestmark = pytest.mark.privileged


@pytest.fixture
def tree(public_tmp: Path) -> Iterator[Path]:
    """A root-owned 0755 directory standing in for C{/run} (and C{/tmp})."""
    require_root()
    yield public_tmp


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


def write(directory: Path, text: str = "{}\n", **kwargs: object) -> Path:
    with open_spec_directory(str(directory)) as spec_directory:
        written = spec_directory.write(text, **kwargs)  # type: ignore[arg-type]
    return Path(written.path)


# The file and the directory --------------------------------------------------


def test_directory_created_0755_and_file_root_0644_under_umask_077(tree: Path) -> None:
    directory = tree / "cdi"
    old = os.umask(0o077)
    try:
        path = write(directory, "spec\n")
    finally:
        os.umask(old)
    assert path == directory / cdi.SPEC_FILE_NAME
    assert (mode(directory), os.lstat(directory).st_uid) == (0o755, 0)
    st = os.lstat(path)
    assert (stat.S_ISREG(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid) == (True, 0o644, 0)
    assert path.read_text() == "spec\n"
    assert leftovers(directory) == []


def test_existing_directory_mode_is_kept(tree: Path) -> None:
    directory = tree / "cdi"
    directory.mkdir(mode=0o700)
    os.chmod(directory, 0o700)
    write(directory)
    assert mode(directory) == 0o700


def test_rewrite_replaces_by_rename(tree: Path) -> None:
    directory = tree / "cdi"
    first = write(directory, "one\n")
    held = open(first)  # a reader of the old spec keeps reading the old spec
    inode = os.fstat(held.fileno()).st_ino
    write(directory, "two\n")
    assert held.read() == "one\n"
    held.close()
    assert first.read_text() == "two\n"
    assert os.lstat(first).st_ino != inode
    assert leftovers(directory) == []


def test_symlinked_directory_refused_target_untouched(tree: Path) -> None:
    target = tree / "elsewhere"
    target.mkdir()
    (tree / "cdi").symlink_to(target)
    with pytest.raises(CdiWriteError, match=r"/cdi: is a symlink, not a directory"):
        write(tree / "cdi")
    assert os.listdir(target) == []


def test_directory_that_is_a_file_refused(tree: Path) -> None:
    (tree / "cdi").write_text(MARKER)
    with pytest.raises(CdiWriteError, match="is a regular file, not a directory"):
        write(tree / "cdi")
    assert (tree / "cdi").read_text() == MARKER


def test_foreign_owned_directory_refused(tree: Path) -> None:
    directory = tree / "cdi"
    directory.mkdir(mode=0o755)
    os.chown(directory, OTHER_UID, OTHER_UID)
    with pytest.raises(CdiWriteError, match=f"/cdi: is owned by UID {OTHER_UID}, not UID 0"):
        write(directory)
    assert os.listdir(directory) == []


@pytest.mark.parametrize("bits", [0o775, 0o757, 0o1777])
def test_directory_writable_by_others_refused(tree: Path, bits: int) -> None:
    directory = tree / "cdi"
    directory.mkdir()
    os.chmod(directory, bits)
    with pytest.raises(CdiWriteError, match="writable by group or other"):
        write(directory)
    assert os.listdir(directory) == []


def test_parent_writable_by_others_without_sticky_refused(tree: Path) -> None:
    parent = tree / "run"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(CdiWriteError, match=r"/run: has mode 0777"):
        write(parent / "cdi")
    assert not (parent / "cdi").exists()


def test_sticky_parent_is_fine(tree: Path) -> None:
    parent = tree / "tmp"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    assert write(parent / "cdi").exists()


@pytest.mark.parametrize("path", ["cdi", "/", "/run/../etc/cdi", "/run/./cdi"])
def test_unclean_directory_refused(path: str) -> None:
    with pytest.raises(CdiWriteError, match="CDI spec directory"):
        with open_spec_directory(path):
            pass


def test_symlinked_spec_file_refused_target_untouched(tree: Path) -> None:
    directory = tree / "cdi"
    directory.mkdir(mode=0o755)
    victim = tree / "victim"
    victim.write_text(MARKER)
    (directory / cdi.SPEC_FILE_NAME).symlink_to(victim)
    with pytest.raises(CdiWriteError, match="hami.io-hostpid.json: is a symlink, not a "
                       r"regular file \(left untouched\)"):
        write(directory)
    assert victim.read_text() == MARKER
    assert os.path.islink(directory / cdi.SPEC_FILE_NAME)
    assert leftovers(directory) == []


def test_foreign_owned_spec_file_refused(tree: Path) -> None:
    directory = tree / "cdi"
    directory.mkdir(mode=0o755)
    spec_file = directory / cdi.SPEC_FILE_NAME
    spec_file.write_text(MARKER)
    os.chown(spec_file, OTHER_UID, OTHER_UID)
    with pytest.raises(CdiWriteError, match=f"is owned by UID {OTHER_UID}, not UID 0"):
        write(directory)
    assert spec_file.read_text() == MARKER
    assert leftovers(directory) == []


def test_temporary_file_replaced_between_write_and_rename(tree: Path) -> None:
    """
    Whatever replaced our temporary file is not renamed into place and not
    deleted; the previous spec stays.
    """
    directory = tree / "cdi"
    write(directory, "previous\n")
    replaced: list[str] = []

    def swap(step: str) -> None:
        if step == "written":
            (name,) = leftovers(directory)
            os.unlink(directory / name)
            (directory / name).write_text(MARKER)
            os.chown(directory / name, OTHER_UID, OTHER_UID)
            replaced.append(name)

    with pytest.raises(CdiWriteError, match="was replaced by a regular file owned by UID "
                       f"{OTHER_UID} before the rename; it is left untouched"):
        write(directory, "new\n", between_steps=swap)
    assert (directory / cdi.SPEC_FILE_NAME).read_text() == "previous\n"
    assert (directory / replaced[0]).read_text() == MARKER, "not ours: not deleted"


def test_temporary_file_removed_before_rename(tree: Path) -> None:
    directory = tree / "cdi"

    def remove(step: str) -> None:
        if step == "written":
            for name in leftovers(directory):
                os.unlink(directory / name)

    with pytest.raises(CdiWriteError, match="disappeared before the rename"):
        write(directory, between_steps=remove)
    assert not (directory / cdi.SPEC_FILE_NAME).exists()


def test_spec_replaced_right_after_rename_is_reported(tree: Path) -> None:
    directory = tree / "cdi"

    def swap(step: str) -> None:
        if step == "renamed":
            spec_file = directory / cdi.SPEC_FILE_NAME
            os.unlink(spec_file)
            os.symlink("/etc/passwd", spec_file)

    with pytest.raises(CdiWriteError, match="was replaced by a symlink owned by UID 0 right "
                       "after it was written"):
        write(directory, between_steps=swap)
    assert os.readlink(directory / cdi.SPEC_FILE_NAME) == "/etc/passwd", "left untouched"


def test_failed_write_leaves_no_temporary_file(tree: Path) -> None:
    directory = tree / "cdi"

    def fail(step: str) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(CdiWriteError, match="cannot be written: No space left on device"):
        write(directory, between_steps=fail)
    assert leftovers(directory) == []


# publish_spec: lock parent first, then the spec ------------------------------


def test_publish_prepares_the_lock_parent_and_writes_a_valid_spec(tree: Path) -> None:
    lock_parent = tree / "vgpulock"
    published = publish_spec(str(tree / "cdi"), broker_enabled=True,
                             lock_parent=str(lock_parent), broker_directory="/run/hami/hostpid")
    assert published.written is not None
    on_disk = json.loads(Path(published.written.path).read_text())
    assert on_disk == published.spec
    assert schema_errors(on_disk) == []
    assert on_disk["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] == str(lock_parent)
    assert mode(lock_parent) == 0o1777
    assert mode(lock_parent / "hostpid") == 0o755


def test_publish_with_an_unsafe_lock_parent_writes_nothing(tree: Path) -> None:
    (tree / "vgpulock").symlink_to(tree)
    with pytest.raises(LockParentError, match="is a symlink"):
        publish_spec(str(tree / "cdi"), broker_enabled=True,
                     lock_parent=str(tree / "vgpulock"))
    assert os.listdir(tree / "cdi") == []


def test_publish_refuses_a_bad_version_before_touching_anything(tree: Path) -> None:
    with pytest.raises(cdi.CdiSpecError, match="cannot express"):
        publish_spec(str(tree / "cdi"), broker_enabled=True,
                     lock_parent=str(tree / "vgpulock"), version="0.3.0")
    assert os.listdir(tree) == []


# hostpid cdi -----------------------------------------------------------------


def run_cdi(tree: Path, gate: str, *options: str) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    env[GATE_ENV] = gate
    return subprocess.run(
        hostpid_argv("cdi", "--lock-parent", str(tree / "vgpulock"),
                     "--broker-dir", "/run/hami/hostpid", *options),
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.mark.parametrize("option", ["--cdi-dir", "--dir"])
@pytest.mark.parametrize(("gate", "mounts"), [("1", 2), ("0", 1), ("", 1)])
def test_cdi_command_writes_the_spec(tree: Path, gate: str, mounts: int, option: str) -> None:
    """C{--cdi-dir}, the broker's spelling, and C{--dir}, the older one, alike."""
    result = run_cdi(tree, gate, option, str(tree / "cdi"))
    assert result.returncode == 0, result.stderr
    spec_file = tree / "cdi" / cdi.SPEC_FILE_NAME
    assert result.stdout.startswith(f"{spec_file}: CDI spec written")
    written = json.loads(spec_file.read_text())
    assert written == cdi.build_spec(broker_enabled=gate == "1",
                                     lock_parent=str(tree / "vgpulock"),
                                     broker_directory="/run/hami/hostpid")
    assert len(written["devices"][0]["containerEdits"]["mounts"]) == mounts
    assert (tree / "vgpulock" / "hostpid").exists() == (gate == "1")


def test_cdi_command_prints_with_dir_dash(tree: Path) -> None:
    result = run_cdi(tree, "1", "--cdi-dir", "-", "--cdi-version", "0.6.0")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["cdiVersion"] == "0.6.0"
    assert schema_errors(printed) == []
    assert sorted(os.listdir(tree)) == ["vgpulock"], "the lock parent, and no spec file"


@pytest.mark.parametrize(("options", "expected"), [
    (["--cdi-version", "0.3.0"], "hostpid: cdi: cdiVersion 0.3.0 cannot express the edits"),
    (["--cdi-version", "9"], "hostpid: cdi: cdiVersion '9' is not a released"),
    (["--broker-dir", "run/hami"],
     "hostpid: cdi: run/hami: the broker directory must be an absolute, clean path"),
])
def test_cdi_command_refuses(tree: Path, options: list[str], expected: str) -> None:
    result = run_cdi(tree, "1", "--cdi-dir", str(tree / "cdi"), *options)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1
    assert os.listdir(tree) == [], "nothing prepared, nothing written"


def test_cdi_command_refuses_a_symlinked_directory(tree: Path) -> None:
    (tree / "cdi").symlink_to("/etc")
    result = run_cdi(tree, "1", "--dir", str(tree / "cdi"))
    assert result.returncode == 1
    assert result.stderr == f"hostpid: {tree}/cdi: is a symlink, not a directory (left untouched)\n"
    assert not os.path.exists(f"/etc/{cdi.SPEC_FILE_NAME}")
