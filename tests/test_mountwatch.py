"""
The broker's watch of its mountpoint in the lock parent:
a root workload's C{rmdir} or replacement is logged and counted once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import pytest_twisted
from kernelfeatures import kernel_feature
from support import release_immutable, require_root
from twisted.internet.defer import maybeDeferred
from twisted.logger import ILogObserver, globalLogPublisher

from hostpid import fileattr
from hostpid.broker.metrics import BrokerCollector
from hostpid.broker.mountwatch import MountpointWatch
from hostpid.broker.service import BrokerService
from hostpid.node.lockparent import prepare_lock_parent


def test_missing_and_replaced_are_logged_once(public_tmp: Path) -> None:
    require_root()
    lock_parent = public_tmp / "vgpulock"
    watch = MountpointWatch(str(lock_parent))
    prepare_lock_parent(str(lock_parent), broker_enabled=False)
    assert watch.check() is None and watch.state == "unseen"  # not made yet: quiet
    prepare_lock_parent(str(lock_parent), broker_enabled=True)
    assert watch.check() is None and watch.state == "ok"
    # What root with CAP_LINUX_IMMUTABLE can do (the prepared mountpoint is
    # immutable: a root workload without that capability no longer can).
    release_immutable(lock_parent / "hostpid")
    os.rmdir(lock_parent / "hostpid")
    message = watch.check()
    assert message is not None and "missing" in message
    assert watch.check() is None, "logged once, not every interval"
    (lock_parent / "hostpid").symlink_to("/etc")  # and plant this for the next containers
    replaced = watch.check()
    assert replaced is not None and "replaced: it is not a directory owned by UID 0" in replaced
    os.unlink(lock_parent / "hostpid")
    prepare_lock_parent(str(lock_parent), broker_enabled=True)
    # A directory made again is another directory: that is a replacement too.
    assert watch.check() is not None
    assert watch.check() is None and watch.state == "ok"
    assert watch.events == 3


@kernel_feature("immutable_tmp")
def test_the_mountpoint_made_immutable_later_is_no_replacement(public_tmp: Path) -> None:
    """
    The broker's pod has no CAP_LINUX_IMMUTABLE: the mountpoint it prepares
    at start is made immutable later by the NRI plugin, which changes its
    change time.  The same directory sealed is not a replacement (no event,
    no alarm on every node at install); a directory made anew in its place
    still is.
    """
    require_root()
    lock_parent = public_tmp / "vgpulock"
    prepare_lock_parent(str(lock_parent), broker_enabled=True)
    release_immutable(lock_parent / "hostpid")  # as the broker's pod leaves it
    watch = MountpointWatch(str(lock_parent))
    assert watch.check() is None and watch.state == "ok"
    held = os.open(lock_parent / "hostpid", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert fileattr.set_immutable(held).immutable  # what the NRI plugin's look does
    finally:
        os.close(held)
    assert watch.check() is None and watch.state == "ok" and watch.events == 0
    release_immutable(lock_parent / "hostpid")
    os.rmdir(lock_parent / "hostpid")
    os.mkdir(lock_parent / "hostpid", 0o755)
    prepare_lock_parent(str(lock_parent), broker_enabled=True)
    assert watch.check() is not None and watch.events == 1


def test_a_replacement_that_stays_is_logged_and_counted_once(public_tmp: Path) -> None:
    """
    A planted symlink left in place: one event, not one per look (a review
    once saw 1, 2, 3, 4 over four looks: a line a second).
    """
    require_root()
    lock_parent = public_tmp / "vgpulock"
    watch = MountpointWatch(str(lock_parent))
    prepare_lock_parent(str(lock_parent), broker_enabled=True)
    assert watch.check() is None
    release_immutable(lock_parent / "hostpid")
    os.rmdir(lock_parent / "hostpid")
    (lock_parent / "hostpid").symlink_to("/etc")
    assert watch.check() is not None
    assert [watch.check() for _ in range(5)] == [None] * 5
    assert watch.events == 1
    os.unlink(lock_parent / "hostpid")
    os.mkdir(lock_parent / "hostpid")  # root-owned again, but not the one first seen
    assert watch.check() is not None, "a different problem is a new event"
    assert watch.events == 2


@pytest_twisted.ensureDeferred
async def test_broker_logs_a_removed_mountpoint(public_tmp: Path, clean_reactor: None) -> None:
    require_root()
    from twisted.internet import reactor

    lock_parent = public_tmp / "vgpulock"
    prepare_lock_parent(str(lock_parent), broker_enabled=True)
    broker = BrokerService(
        directory=str(public_tmp / "broker"), reactor=reactor, environ={
            "LIBVGPU_HOSTPID_BROKER": "1"}, onFatal=lambda: None,
        lockParent=str(lock_parent),
    )
    events: list[dict[str, object]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    broker.startService()
    try:
        broker.checkSocketPath()
        release_immutable(lock_parent / "hostpid")
        os.rmdir(lock_parent / "hostpid")
        broker.checkSocketPath()
    finally:
        globalLogPublisher.removeObserver(observer)
        await maybeDeferred(broker.stopService)
    assert broker.mountpointWatch.events == 1
    (family,) = [
        f for f in BrokerCollector(broker).collect() if f.name == "hostpid_broker_mountpoint_events"
    ]
    assert [sample.value for sample in family.samples] == [1]
    assert [e["state"] for e in events
            if e.get("log_namespace") == "hostpid.broker.mountwatch"] == ["missing"]
