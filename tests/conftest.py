"""
Fixtures shared by every test module.

pytest-twisted installs the reactor itself (in C{pytest_configure}), so this
file must not import the reactor at module level.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: A downstream project's test module, run on purpose by tests/test_testing.py
#: under trial and pytest as another UID; not part of this suite's collection.
collect_ignore = ["downstream"]


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
