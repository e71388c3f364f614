"""
Rollback after a killed broker: a broker with its gate off
removes the stale socket a SIGKILLed broker left, under the startup rules
and nothing more, so that workloads still holding the broker mount find no
socket (as docs/rollout.md says) instead of failing at connect.
"""

from __future__ import annotations

import os
from pathlib import Path

from support import BrokerProcess, ask_pid, running_broker, wait_for

from hostpid.client.blocking import HostPidUnavailable, TrustPolicy, query_host_pid

GATE_ON = {"LIBVGPU_HOSTPID_BROKER": "1"}


def client_failure(directory: Path) -> HostPidUnavailable:
    policy = TrustPolicy(socket_path=os.fspath(directory / "broker.sock")).without(
        "read-only-mount"
    )
    try:
        query_host_pid(policy, GATE_ON)
    except HostPidUnavailable as failure:
        return failure
    raise AssertionError("the query succeeded")


def test_disabled_broker_removes_a_killed_brokers_stale_socket(public_tmp: Path) -> None:
    directory = public_tmp / "broker"
    with BrokerProcess(directory) as killed:
        killed.wait_listening()
        killed.kill()  # SIGKILL: no clean-up
    assert (directory / "broker.sock").is_socket()
    assert client_failure(directory).check == "connect"  # what clients saw before
    before = sorted(os.listdir(directory))
    with BrokerProcess(directory, gate="0") as rollback:
        wait_for(lambda: "stale socket removed" in rollback.output(), "the removal")
        assert sorted(os.listdir(directory)) == [n for n in before if n != "broker.sock"]
        assert client_failure(directory).check == "socket"  # no socket: the documented case
        assert rollback.process.poll() is None, "a disabled broker keeps running"
        rollback.terminate()


def test_disabled_broker_leaves_a_serving_brokers_socket(public_tmp: Path) -> None:
    directory = public_tmp / "broker"
    with running_broker(directory):
        with BrokerProcess(directory, gate="0") as second:
            wait_for(lambda: "left in place: another broker holds the lock" in second.output(),
                     "the disabled broker's verdict")
            assert ask_pid(directory / "broker.sock") == os.getpid()
            second.terminate()


def test_disabled_broker_creates_nothing(public_tmp: Path) -> None:
    directory = public_tmp / "broker"
    directory.mkdir(mode=0o711)
    with BrokerProcess(directory, gate="0") as broker:
        wait_for(lambda: "disabled" in broker.output(), "the disabled message")
        broker.terminate()
    assert os.listdir(directory) == []
