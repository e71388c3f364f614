"""
Fixtures shared by every test module.

pytest-twisted installs the reactor itself (in C{pytest_configure}), so this
file must not import the reactor at module level.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# gRPC's fork support off before anything imports gRPC (a test module's import at
# collection included): the session's CRI channels and the cluster tier's device plugin keep
# gRPC's threads running, and with fork support on gRPC restarts its poller in every child
# the suite forks, where a preexec_fn that lowers RLIMIT_NOFILE or closes descriptors left it
# polling a closed epoll: the child aborted (SIGABRT, "epoll_wait error: Bad file
# descriptor") before it could exec the broker it was meant to be
# (tests/e2e/crilib.py grpc_module says the same where gRPC is imported).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

#: A downstream project's test module, run on purpose by tests/test_testing.py
#: under trial and pytest as another UID; not part of this suite's collection.
collect_ignore = ["downstream"]

#: The C{kernel} and C{kernel_feature} marks and their probes; the per-test
#: cap and C{HOSTPID_REPEAT} (tests/budget.py); the guests booted in the
#: background (tests/kernels/schedule.py).
pytest_plugins = ["kernelfeatures", "budget", "kernels.schedule"]

#: The production lock parent on the machine that runs the suite.
HOST_LOCK_PARENT = "/tmp/vgpulock"


def _host_lock_parent_state() -> tuple[int, ...] | None:
    """What must not change about the host's lock parent while the suite runs."""
    try:
        st = os.lstat(HOST_LOCK_PARENT)
    except FileNotFoundError:
        return None
    return (st.st_mode, st.st_uid, st.st_gid, st.st_dev, st.st_ino, st.st_mtime_ns)


#: The lock parent's state when the last test ended, and that test's ID:
#: what the next test must find, so a change made between two tests (a
#: module or session fixture's setup or teardown) is caught and placed too.
_last_seen: tuple[tuple[int, ...] | None, str] | None = None


def _describe(state: tuple[int, ...] | None) -> str:
    if state is None:
        return "absent"
    mode, uid, gid, dev, ino, mtime_ns = state
    return f"mode {mode:o} uid {uid} gid {gid} dev {dev} ino {ino} mtime_ns {mtime_ns}"


def _entries() -> str:
    """
    What the lock parent holds now, each entry with its owner, mode and
    change time (only on failure): a change time outside the test's own
    time points at a background process left by an earlier test.
    """
    try:
        names = sorted(os.listdir(HOST_LOCK_PARENT))
    except OSError as e:
        return f"(cannot list: {e.strerror})"
    shown = []
    for name in names:
        try:
            st = os.lstat(os.path.join(HOST_LOCK_PARENT, name))
        except OSError:
            continue
        shown.append(f"{name} (mode {st.st_mode:o} uid {st.st_uid} ctime_ns {st.st_ctime_ns})")
    return "; ".join(shown) or "(empty)"


@pytest.fixture(scope="session", autouse=True)
def host_lock_parent_untouched() -> Iterator[None]:
    """
    Fail the suite if the host's C{/tmp/vgpulock} changed while it ran
    (tests of the default paths must never touch the host's): existence,
    type and mode, owner, identity, and the
    mtime that any entry created or removed in it changes.  Tests of the
    default paths run in a private mount namespace with their own C{/tmp}
    (L{support.run_with_private_tmp}); a test that reaches the real one is a
    bug on the machine that runs the suite.  L{host_lock_parent_untouched_by_test}
    names the test; this catches what happens after the last one.
    """
    before = _host_lock_parent_state()
    yield
    after = _host_lock_parent_state()
    where = ""
    if _last_seen is not None and _last_seen[0] != after:
        where = f", after the last test, {_last_seen[1]} (a fixture's teardown)"
    assert after == before, (
        f"the host's {HOST_LOCK_PARENT} changed while the suite ran{where}: "
        f"{_describe(before)} -> {_describe(after)}; it holds {_entries()}"
    )


@pytest.fixture(autouse=True)
def host_lock_parent_untouched_by_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """
    The same check around each test (a change seen only at the end
    of a run could not be placed): one C{lstat} before and one after, and a
    failure that names the test that changed it, or the two tests between
    which it changed (a fixture of a wider scope).
    """
    global _last_seen
    test = request.node.nodeid
    before = _host_lock_parent_state()
    if _last_seen is not None and _last_seen[0] != before:
        previous, _last_seen = _last_seen, (before, test)
        pytest.fail(
            f"the host's {HOST_LOCK_PARENT} changed between {previous[1]} and {test} "
            f"(a fixture's setup or teardown): {_describe(previous[0])} -> {_describe(before)}; "
            f"it holds {_entries()}"
        )
    started = time.time_ns()
    yield
    after = _host_lock_parent_state()
    _last_seen = (after, test)
    assert after == before, (
        f"{test} changed the host's {HOST_LOCK_PARENT}: "
        f"{_describe(before)} -> {_describe(after)}; it holds {_entries()}; "
        f"the test ran from {started} to {time.time_ns()} (ns)"
    )


@pytest.fixture
def broker_dir(tmp_path: Path) -> Path:
    """A directory for a broker that the test owns (not created yet)."""
    return tmp_path / "broker"


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """
    A private-by-name but world-traversable (0755) temporary directory under
    /tmp, for tests whose other-UID processes must reach a socket in it
    (pytest's own tmp_path sits under a 0700 directory).
    """
    path = Path(tempfile.mkdtemp(prefix="hostpid-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    from support import remove_tree

    remove_tree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def immutable_mountpoints_released(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """
    Clear, at the end of the session, the immutable attribute of every broker
    mountpoint a test prepared below pytest's temporary directories, so that
    pytest can remove them in a later run (it ignores what it cannot remove,
    and an immutable directory would stay in C{/tmp} for good).
    """
    yield
    from support import release_immutable

    release_immutable(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def hamiload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HAMi-core-like load generator (tests/c/hamiload.c), compiled once."""
    from continuity import build_hamiload

    return build_hamiload(tmp_path_factory.mktemp("hamiload"))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair of real Unix stream sockets; the peer is this process."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield left, right
    left.close()
    right.close()


@pytest.fixture(params=["c", "python"])
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """
    Run the test twice: the fast path's system calls made by the C helper
    (C{_hostpid_native}, connections held as descriptors), then by the
    Python path it must match (socket objects).  Applies to every
    L{PassedDescriptors} and L{BrokerFactory} the test builds without saying
    which.  The C run fails under C{HOSTPID_REQUIRE_PRIVILEGED=1} if the
    helper was not built: CI must test what it ships.
    """
    from support import skip_or_fail

    from hostpid.broker import connections, descriptors

    if request.param == "python":
        monkeypatch.setattr(descriptors, "_native", None)
        monkeypatch.setattr(connections, "helper", None)
    elif descriptors._native is None:
        skip_or_fail(f"the C helper _hostpid_native is not built ({descriptors.NATIVE_MISSING})")
    return str(request.param)


@pytest.fixture
def clean_reactor() -> Iterator[None]:
    """
    Fail a real-reactor test that leaves a delayed call behind.

    pytest-twisted does not check this itself; a leaked C{callLater} is exactly
    the kind of bug a transaction deadline can have.
    """
    from twisted.internet import reactor

    before = set(reactor.getDelayedCalls())  # type: ignore[attr-defined]
    yield
    leaked = [
        call
        for call in reactor.getDelayedCalls()  # type: ignore[attr-defined]
        if call not in before and call.active()
    ]
    for call in leaked:
        call.cancel()
    assert not leaked, f"delayed calls left behind: {leaked}"
