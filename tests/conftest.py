"""
Fixtures shared by every test module.

pytest-twisted installs the reactor itself (in C{pytest_configure}), so this
file must not import the reactor at module level.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: A downstream project's test module, run on purpose by tests/test_testing.py
#: under trial and pytest as another UID; not part of this suite's collection.
collect_ignore = ["downstream"]

#: The C{kernel} and C{kernel_feature} marks and their probes.
pytest_plugins = ["kernelfeatures"]

#: The production lock parent on the machine that runs the suite.
HOST_LOCK_PARENT = "/tmp/vgpulock"


def _host_lock_parent_state() -> tuple[int, ...] | None:
    """What must not change about the host's lock parent while the suite runs."""
    try:
        st = os.lstat(HOST_LOCK_PARENT)
    except FileNotFoundError:
        return None
    return (st.st_mode, st.st_uid, st.st_gid, st.st_dev, st.st_ino, st.st_mtime_ns)


@pytest.fixture(scope="session", autouse=True)
def host_lock_parent_untouched() -> Iterator[None]:
    """
    Fail the suite if the host's C{/tmp/vgpulock} changed while it ran
    (issue 13 item 6): existence, type and mode, owner, identity, and the
    mtime that any entry created or removed in it changes.  Tests of the
    default paths run in a private mount namespace with their own C{/tmp}
    (L{support.run_with_private_tmp}); a test that reaches the real one is a
    bug on the machine that runs the suite.
    """
    before = _host_lock_parent_state()
    yield
    after = _host_lock_parent_state()
    assert after == before, (
        f"the host's {HOST_LOCK_PARENT} changed while the suite ran "
        f"(mode, uid, gid, dev, ino, mtime_ns): {before} -> {after}"
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
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair of real Unix stream sockets; the peer is this process."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield left, right
    left.close()
    right.close()


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
