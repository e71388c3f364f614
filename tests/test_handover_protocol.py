"""
The handover's codec and the running broker's session bounds, with
L{twisted.internet.testing} (no processes: the real ones are in
C{integration/test_handover.py}).
"""

from __future__ import annotations

import socket

import pytest
from twisted.internet.testing import MemoryReactorClock

from hostpid.broker import handover


def test_the_codec_round_trips_and_refuses_anything_else() -> None:
    message = handover.encode(handover.Message(handover.Kind.OFFER, 1, 2, "x"))
    assert len(message) == handover.MESSAGE_SIZE
    assert handover.decode(message) == handover.Message(handover.Kind.OFFER, 1, 2, "x")
    with pytest.raises(handover.HandoverFailed, match="version 2"):
        handover.decode(message[:4] + b"\0\2" + message[6:])
    with pytest.raises(handover.HandoverFailed, match="magic"):
        handover.decode(b"HPID" + message[4:])
    with pytest.raises(handover.HandoverFailed, match="kind 9"):
        handover.decode(message[:6] + b"\0\x09" + message[8:])
    with pytest.raises(handover.HandoverFailed, match="128 bytes"):
        handover.decode(message[:-1])


def test_a_long_reason_is_cut_to_fit() -> None:
    message = handover.encode(handover.Message(handover.Kind.REFUSED, reason="x" * 500))
    assert len(message) == handover.MESSAGE_SIZE
    assert handover.decode(message).reason == "x" * handover.REASON_SIZE


def control(reactor: MemoryReactorClock, offered: list[str]) -> handover.ControlListener:
    return handover.ControlListener(
        -1, "/nonexistent", 0, reactor,
        offer=lambda: "not serving", handedOver=lambda pid: offered.append(f"taken {pid}"),
    )


def test_a_silent_asker_is_dropped_at_the_timeout() -> None:
    reactor = MemoryReactorClock()
    listener = control(reactor, [])
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    listener.session = session = handover._Session(listener, ours, 4242)
    session.start()
    assert session in reactor.readers
    reactor.advance(handover.TIMEOUT - 0.01)
    assert listener.session is session
    reactor.advance(0.02)
    assert listener.session is None and session not in reactor.readers
    assert ours.fileno() == -1
    assert listener.refused == ["timed out; still serving"]
    assert theirs.recv(1) == b"", "closed: the asker sees the end"
    theirs.close()


def test_nothing_is_offered_by_a_broker_that_is_not_serving() -> None:
    reactor = MemoryReactorClock()
    listener = control(reactor, [])
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    listener.session = session = handover._Session(listener, ours, 4242)
    session.start()
    theirs.sendall(handover.encode(handover.Message(handover.Kind.ASK)))
    session.doRead()
    data, fds, _, _ = socket.recv_fds(theirs, handover.MESSAGE_SIZE, 4)
    assert fds == []
    answer = handover.decode(data)
    assert (answer.kind, answer.reason) == (handover.Kind.REFUSED, "not serving")
    assert listener.session is None and not reactor.getDelayedCalls()
    theirs.close()


def test_taken_before_an_offer_ends_the_session() -> None:
    reactor = MemoryReactorClock()
    handed: list[str] = []
    listener = control(reactor, handed)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    listener.session = session = handover._Session(listener, ours, 4242)
    session.start()
    theirs.sendall(handover.encode(handover.Message(handover.Kind.TAKEN)))
    session.doRead()
    assert handed == [], "nothing was offered: nothing is handed over"
    assert listener.refused == ["unexpected TAKEN; still serving"]
    theirs.close()
