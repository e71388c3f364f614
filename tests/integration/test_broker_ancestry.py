"""
The filesystem rules for the broker directory's ancestors, each attacked for real: a UID 1000
process that owns the broker directory's parent swaps the directory for a
symlink while root starts brokers; ancestors owned by or writable to
another user; a hard-linked lock; a read-only filesystem; a socket path too
long for clients.  Each fails on the code before the fix.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import (
    REPO,
    BrokerProcess,
    as_user_argv,
    ask_pid,
    require_root,
    require_tool,
    running_broker,
    subprocess_env,
    twistd_argv,
    wait_for,
)
from twisted.internet.testing import MemoryReactorClock

from hostpid.broker.fsrules import open_broker_directory
from hostpid.broker.port import BrokerPort
from hostpid.broker.server import BrokerFactory

pytestmark = pytest.mark.privileged

#: sun_path holds 108 bytes with the NUL C clients write (hostpid.broker.fsrules).
SUN_PATH_MAX = 107


def refused(directory: Path, *args: str, argv_prefix: tuple[str, ...] = ()) -> str:
    """
    Start a broker that must refuse: exit 1, one line alone on stderr (the
    log keeps its own record), no traceback.  Returns that line.
    """
    result = subprocess.run(
        [*argv_prefix, *twistd_argv("--directory", str(directory), *args)],
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        cwd=tempfile.gettempdir(),
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hostpid-broker: cannot start: "), (
        result.stdout, result.stderr
    )
    return lines[0]


def owned_dir(path: Path, uid: int, mode: int) -> Path:
    path.mkdir()
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


# --- the swap race -----------------------------------------------------------------

ATTACKER = r"""
import ctypes, os, sys, time
parent, target, stop = sys.argv[1:4]
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
os.chdir(parent)
os.symlink(target, "swap")
print("ready", flush=True)
swaps = 0
deadline = time.monotonic() + 60
while not os.path.exists(stop) and time.monotonic() < deadline:
    # broker <-> swap: the broker directory and a symlink to the target change
    # places atomically, again and again.
    if libc.renameat2(AT_FDCWD, b"broker", AT_FDCWD, b"swap", RENAME_EXCHANGE) == 0:
        swaps += 1
print("swaps", swaps, flush=True)
"""

STARTER = r"""
import json, os, sys
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from hostpid.broker.fsrules import BrokerStartupError
from hostpid.broker.service import BrokerService
directory, target, attempts = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = {"started": 0, "refused": 0, "outside": [], "reasons": {}, "errors": []}

async def main():
    for _ in range(attempts):
        service = BrokerService(directory=directory, reactor=reactor,
                                environ={"LIBVGPU_HOSTPID_BROKER": "1"},
                                onFatal=lambda: None, watchInterval=3600)
        try:
            service.startService()
        except BrokerStartupError as e:
            seen["refused"] += 1
            reason = e.rule.split(";")[0]
            seen["reasons"][reason] = seen["reasons"].get(reason, 0) + 1
        except Exception as e:
            seen["errors"].append(repr(e))
        else:
            seen["started"] += 1
            try:
                await service.stopService()
            except Exception as e:
                seen["errors"].append(repr(e))
        for name in os.listdir(target):
            info = os.lstat(os.path.join(target, name))
            seen["outside"].append([name, oct(info.st_mode)])
            os.unlink(os.path.join(target, name))

def run():
    d = ensureDeferred(main())
    d.addBoth(lambda r: (print(json.dumps(seen), flush=True), reactor.stop(), r))

reactor.callWhenRunning(run)
reactor.run()
"""


#: Broker starts under the race.  The code before the fix lost about 1 in 300.
STARTS = 1000


def test_swapping_the_directory_for_a_symlink_never_puts_a_socket_elsewhere(
    public_tmp: Path,
) -> None:
    """
    The attack: the broker directory's parent belongs to UID
    1000, who swaps the (root-owned) directory with a symlink to a root-only
    directory as fast as it can while root starts and stops brokers.  Root
    must never create anything in the root-only directory.  (The broker now
    refuses such a parent outright; were the parent trusted, the bind through
    the directory descriptor would still land in the opened directory: see
    the next test.)
    """
    require_root()
    parent = owned_dir(public_tmp / "home", 1000, 0o755)
    target = public_tmp / "rootonly"
    target.mkdir(mode=0o700)
    # The broker directory exists, root's, as a previous broker left it: the
    # attacker cannot create it (it would be theirs) but can move it.
    (parent / "broker").mkdir(mode=0o711)
    stop = public_tmp / "stop"
    attacker = subprocess.Popen(
        as_user_argv(1000, [sys.executable, "-c", ATTACKER, str(parent), str(target), str(stop)]),
        stdout=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline().strip() == "ready"
        starter = subprocess.run(
            [sys.executable, "-c", STARTER, str(parent / "broker"), str(target), str(STARTS)],
            capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO,
        )
    finally:
        stop.touch()
        out, _ = attacker.communicate(timeout=60)
    assert starter.returncode == 0, starter.stderr
    seen = json.loads(starter.stdout.strip().splitlines()[-1])
    swaps = int(out.split()[-1])
    assert swaps > 1000, f"the attacker raced ({swaps} swaps)"
    assert seen["outside"] == [], (
        f"root created {len(seen['outside'])} files in the root-only directory in {STARTS} starts "
        f"({swaps} swaps): {seen['outside'][:3]}; {seen}"
    )
    assert seen["started"] == 0, seen
    assert os.listdir(target) == []


def test_bind_goes_through_the_directory_descriptor(tmp_path: Path) -> None:
    """
    Deterministically, with no ancestor rule in the way: the directory is
    opened, then its path is made a symlink to another directory before the
    bind.  The socket is created in the opened directory, never the target.
    """
    directory = tmp_path / "broker"
    fd = open_broker_directory(str(directory), os.geteuid())
    try:
        moved = tmp_path / "moved"
        directory.rename(moved)
        target = tmp_path / "target"
        target.mkdir()
        directory.symlink_to(target)
        clock = MemoryReactorClock()
        port = BrokerPort(
            str(directory / "broker.sock"), fd, BrokerFactory(clock, 0.5, 4), clock,
            onFatal=lambda failure: None,
        )
        try:
            port.startListening()
            assert os.listdir(target) == [], "nothing through the symlink"
            assert stat.S_ISSOCK(os.lstat(moved / "broker.sock").st_mode)
            assert port.identity is not None
        finally:
            listener = getattr(port, "socket", None)
            if listener is not None:
                listener.close()
    finally:
        os.close(fd)


# --- ancestors -----------------------------------------------------------------------


def test_parent_owned_by_another_user_is_refused(public_tmp: Path) -> None:
    require_root()
    parent = owned_dir(public_tmp / "home", 1000, 0o755)
    line = refused(parent / "broker")
    assert f"{parent}: is owned by UID 1000; every ancestor of the broker directory" in line
    assert os.listdir(parent) == [], "nothing created below it"


def test_grandparent_owned_by_another_user_is_refused(public_tmp: Path) -> None:
    require_root()
    home = owned_dir(public_tmp / "home", 1000, 0o755)
    inner = home / "inner"
    inner.mkdir(mode=0o755)  # root's, but inside UID 1000's directory
    line = refused(inner / "broker")
    assert f"{home}: is owned by UID 1000" in line
    assert os.listdir(inner) == []


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_parent_writable_by_others_without_sticky_is_refused(public_tmp: Path, mode: int) -> None:
    require_root()
    parent = owned_dir(public_tmp / "shared", 0, mode)
    line = refused(parent / "broker")
    assert f"{parent}: has mode {mode:04o}: writable by group or others" in line
    assert os.listdir(parent) == []


def test_missing_components_below_an_untrusted_parent_are_not_created(public_tmp: Path) -> None:
    require_root()
    parent = owned_dir(public_tmp / "home", 1000, 0o755)
    line = refused(parent / "a" / "b" / "broker")
    assert f"{parent}: is owned by UID 1000" in line
    assert os.listdir(parent) == []


def test_sticky_root_parent_with_a_foreign_entry_below_is_refused(public_tmp: Path) -> None:
    """Like /tmp: anyone may create an entry there; an entry of UID 1000 is refused."""
    require_root()
    sticky = owned_dir(public_tmp / "tmp", 0, 0o1777)
    entry = owned_dir(sticky / "entry", 1000, 0o755)
    line = refused(entry / "broker")
    assert f"{entry}: is owned by UID 1000" in line
    assert os.listdir(entry) == []


def test_sticky_root_parent_with_a_foreign_broker_directory_is_refused(public_tmp: Path) -> None:
    require_root()
    sticky = owned_dir(public_tmp / "tmp", 0, 0o1777)
    squatted = owned_dir(sticky / "broker", 1000, 0o755)
    line = refused(squatted)
    assert f"{squatted}: is owned by UID 1000" in line


def test_sticky_root_parent_with_our_own_entries_is_allowed(public_tmp: Path) -> None:
    require_root()
    sticky = owned_dir(public_tmp / "tmp", 0, 0o1777)
    with running_broker(sticky / "ours" / "broker") as broker:
        assert ask_pid(broker.socket_path) == os.getpid()


def test_non_root_broker_below_its_own_directory_is_allowed(public_tmp: Path) -> None:
    """Ancestors owned by the expected UID (here 1000) are trusted, as root's are."""
    require_root()
    home = owned_dir(public_tmp / "home", 1000, 0o755)
    with BrokerProcess(home / "broker", argv_prefix=tuple(as_user_argv(1000, []))) as broker:
        broker.wait_listening()
        broker.terminate()


# --- the lock, read-only filesystems, long paths ------------------------------------


def test_hard_linked_lock_is_refused_and_its_target_untouched(public_tmp: Path) -> None:
    require_root()
    directory = public_tmp / "broker"
    directory.mkdir(mode=0o711)
    precious = public_tmp / "precious"
    precious.write_text("keep me")
    precious.chmod(0o600)
    os.link(precious, directory / "broker.lock")
    line = refused(directory)
    assert f"{directory}/broker.lock: has 2 hard links" in line
    assert precious.read_text() == "keep me"
    assert os.lstat(precious).st_nlink == 2, "left untouched"
    assert not (directory / "broker.sock").exists()


def in_private_mount_namespace(script: str) -> tuple[str, ...]:
    """An argv prefix: C{script}, then the broker (C{exec "$@"}), in a new mount namespace."""
    unshare = require_tool("unshare")
    return (unshare, "--mount", "--propagation", "private", "sh", "-euc",
            script + '\nexec "$@"', "sh")


def test_directory_on_a_read_only_filesystem_is_a_one_line_refusal(public_tmp: Path) -> None:
    require_root()
    mountpoint = public_tmp / "ro"
    mountpoint.mkdir()
    directory = mountpoint / "broker"
    prefix = in_private_mount_namespace(
        f"mount -t tmpfs -o mode=0755 tmpfs {mountpoint}\n"
        f"mkdir -m 0755 {directory}\n"
        f"mount -o remount,ro {mountpoint}"
    )
    line = refused(directory, argv_prefix=prefix)
    assert f"{directory}: cannot set mode 0711 (Read-only file system)" in line
    assert os.listdir(mountpoint) == [], "the mount never left its namespace"


def test_read_only_filesystem_with_the_right_mode_names_the_lock(public_tmp: Path) -> None:
    require_root()
    mountpoint = public_tmp / "ro"
    mountpoint.mkdir()
    directory = mountpoint / "broker"
    prefix = in_private_mount_namespace(
        f"mount -t tmpfs -o mode=0755 tmpfs {mountpoint}\n"
        f"mkdir -m 0711 {directory}\n"
        f"mount -o remount,ro {mountpoint}"
    )
    line = refused(directory, argv_prefix=prefix)
    assert f"{directory}/broker.lock: cannot open the lock file: Read-only file system" in line


def test_socket_path_too_long_for_clients_is_refused_before_anything_is_created(
    tmp_path: Path,
) -> None:
    base = len(os.fsencode(str(tmp_path))) + len("/") + len("/broker.sock")
    directory = tmp_path / ("d" * (SUN_PATH_MAX + 1 - base))
    socket_path = f"{directory}/broker.sock"
    assert len(socket_path) == SUN_PATH_MAX + 1
    line = refused(directory)
    assert (
        f"{socket_path}: is {SUN_PATH_MAX + 1} bytes long; a Unix socket path must be at most "
        f"{SUN_PATH_MAX} bytes" in line
    )
    assert not directory.exists()


def test_socket_path_of_exactly_the_limit_serves(tmp_path: Path) -> None:
    base = len(os.fsencode(str(tmp_path))) + len("/") + len("/broker.sock")
    directory = tmp_path / ("d" * (SUN_PATH_MAX - base))
    with running_broker(directory) as broker:
        assert len(str(broker.socket_path)) == SUN_PATH_MAX
        wait_for(lambda: ask_pid(broker.socket_path) == os.getpid(), "an answer")
