"""
The user-namespace rule as pure decisions over what the kernel reports
(L{hostpid.client.userns}, the owner and peer checks of
L{hostpid.client.trust}): where it applies, and that the initial user
namespace keeps "peer UID 0" exactly.  The real namespaces are in
tests/integration/test_userns_pod.py.
"""

from __future__ import annotations

import os
import stat

import pytest

from hostpid.client import trust, userns
from hostpid.ucred import PeerCredentials

INITIAL = userns.UserNamespace(userns.IDENTITY_MAP, 65534)
POD = userns.UserNamespace(((0, 100000, 65536),), 65534)
#: A namespace that maps the host's root (to 0): the host's rule applies.
MAPS_ROOT = userns.UserNamespace(((0, 0, 1), (1, 100000, 65535)), 65534)
UNKNOWN = userns.UserNamespace(None, 65534)


def _stat(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 1, 2, 1, uid, 0, 0, 0, 0, 0))


DIRECTORY = stat.S_IFDIR | 0o711
SOCKET = stat.S_IFSOCK | 0o666


def test_where_the_rule_applies() -> None:
    assert not INITIAL.unmaps(0)
    assert POD.unmaps(0)
    assert not MAPS_ROOT.unmaps(0)
    assert not UNKNOWN.unmaps(0), "an unreadable map never applies the rule"


def test_this_process_is_in_the_initial_user_namespace() -> None:
    namespace = userns.read_user_namespace()
    assert namespace.initial is True
    assert not namespace.unmaps(0)


@pytest.mark.parametrize("namespace", [INITIAL, MAPS_ROOT, UNKNOWN])
def test_host_rule_keeps_peer_uid_zero_exactly(namespace: userns.UserNamespace) -> None:
    assert trust.check_peer(PeerCredentials(0, 0, 0), 0, namespace).ok
    assert trust.check_peer(PeerCredentials(1234, 0, 0), 0, namespace).ok
    for uid in (65534, 1, 100000):
        for pid in (0, 1234):
            assert not trust.check_peer(PeerCredentials(pid, uid, uid), 0, namespace).ok
    for uid in (65534, 100000):
        assert not trust.check_directory(_stat(DIRECTORY, uid), 0, namespace).ok
        assert not trust.check_socket(_stat(SOCKET, uid), 0, namespace).ok


def test_user_namespace_peer_needs_the_overflow_uid_and_pid_zero() -> None:
    ok = trust.check_peer(PeerCredentials(0, 65534, 65534), 0, POD)
    assert ok.ok
    assert ok.observed.startswith("uid 65534 (pid 0): the overflow uid outside this PID namespace")
    nobody_here = trust.check_peer(PeerCredentials(17, 65534, 65534), 0, POD)
    assert not nobody_here.ok
    assert "only pid 0 (outside this PID namespace)" in nobody_here.observed
    refused = trust.check_peer(PeerCredentials(0, 1000, 1000), 0, POD)
    assert not refused.ok
    assert "uid 1000 is one this namespace maps" in refused.observed


def test_user_namespace_trusted_uid_as_shown_leaves_the_pid_to_peer_pid() -> None:
    """
    The pod's own root (or a test double it runs) shows as the trusted UID:
    peer-uid passes it as the host's rule would, and peer-pid refuses it
    when it is a process of this PID namespace.
    """
    here = trust.check_peer(PeerCredentials(17, 0, 0), 0, POD)
    assert here.ok and "as this user namespace shows it" in here.observed
    caller = trust.peerpid.CallerProcess(5, 4026532000)
    assert not trust.check_peer_pid(PeerCredentials(17, 0, 0), caller).ok


def test_user_namespace_owner_as_a_mount_shows_the_hosts_root() -> None:
    for uid, words in ((0, "through an idmapped mount"), (65534, "without an idmapping")):
        directory = trust.check_directory(_stat(DIRECTORY, uid), 0, POD)
        assert directory.ok and words in directory.observed
        assert trust.check_socket(_stat(SOCKET, uid), 0, POD).ok
    refused = trust.check_directory(_stat(DIRECTORY, 1000), 0, POD)
    assert not refused.ok
    assert "the host's root shows here as uid 0" in refused.observed
    assert not trust.check_socket(_stat(SOCKET, 1000), 0, POD).ok
    writable = trust.check_directory(_stat(stat.S_IFDIR | 0o777, 65534), 0, POD)
    assert not writable.ok and "group or other may write" in writable.observed
    assert not trust.check_directory(_stat(stat.S_IFLNK | 0o777, 0), 0, POD).ok
    assert not trust.check_socket(_stat(stat.S_IFREG | 0o644, 0), 0, POD).ok


def test_parsing_the_map() -> None:
    assert userns._parse("         0          0 4294967295\n") == userns.IDENTITY_MAP
    assert userns._parse("0 100000 65536\n65536 300000 10\n") == (
        (0, 100000, 65536), (65536, 300000, 10)
    )
    with pytest.raises(ValueError):
        userns._parse("0 1\n")
