"""
C{BrokerService(prepareNode=...)}: the hook through which the twistd plugin
lets the node side (the CDI spec of C{--cdi-dir}) prepare at every start,
without the broker importing the node side.  A real service, a real socket
in a private directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import pytest_twisted
from support import ask_pid
from twisted.internet.defer import maybeDeferred
from twisted.internet.threads import deferToThread

from hostpid.broker.fsrules import BrokerStartupError
from hostpid.broker.service import BrokerService
from hostpid.errors import PathRuleError

GATE_ON = {"LIBVGPU_HOSTPID_BROKER": "1"}


def service(directory: Path, environ: dict[str, str], calls: list[bool], refuse: bool = False
            ) -> BrokerService:
    from twisted.internet import reactor

    def prepare(enabled: bool) -> None:
        calls.append(enabled)
        if refuse:
            raise PathRuleError("/var/run/cdi", "is a symlink; refusing to follow it")

    return BrokerService(
        directory=str(directory), reactor=reactor, environ=environ, onFatal=lambda: None,
        watchInterval=3600, prepareNode=prepare,
    )


@pytest_twisted.ensureDeferred
async def test_called_before_listening_with_the_gate(tmp_path: Path, clean_reactor: None) -> None:
    calls: list[bool] = []
    broker = service(tmp_path / "broker", GATE_ON, calls)
    broker.startService()
    try:
        assert calls == [True]
        assert await deferToThread(ask_pid, broker.socketPath) == os.getpid()
    finally:
        await maybeDeferred(broker.stopService)


@pytest_twisted.ensureDeferred
async def test_called_when_disabled_and_nothing_served(
    tmp_path: Path, clean_reactor: None
) -> None:
    calls: list[bool] = []
    broker = service(tmp_path / "broker", {}, calls)
    broker.startService()
    try:
        assert calls == [False]
        assert not (tmp_path / "broker").exists()
    finally:
        await maybeDeferred(broker.stopService)


@pytest.mark.parametrize("environ", [GATE_ON, {}], ids=["enabled", "disabled"])
def test_its_refusal_is_the_brokers_startup_refusal(
    tmp_path: Path, environ: dict[str, str]
) -> None:
    calls: list[bool] = []
    broker = service(tmp_path / "broker", environ, calls, refuse=True)
    with pytest.raises(BrokerStartupError) as refused:
        broker.startService()
    assert (refused.value.path, refused.value.rule) == (
        "/var/run/cdi", "is a symlink; refusing to follow it"
    )
    assert not broker.running
    assert not (tmp_path / "broker" / "broker.sock").exists()
    # Nothing is held: a second broker on the same directory starts.
    calls.clear()
    again = service(tmp_path / "broker", environ, calls)
    again.startService()
    try:
        assert calls == [bool(environ)]
    finally:
        again.stopService()
