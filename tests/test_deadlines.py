"""
L{hostpid.broker.deadlines.ArrivalDeadlines}: many deadlines of one length
behind one delayed call, on a deterministic clock.
"""

from __future__ import annotations

from twisted.internet.testing import MemoryReactorClock

from hostpid.broker.deadlines import ArrivalDeadlines


def deadlines(timeout: float = 1.0) -> tuple[MemoryReactorClock, ArrivalDeadlines[str], list]:
    clock = MemoryReactorClock()
    expired: list[tuple[str, float]] = []
    return clock, ArrivalDeadlines(clock, timeout, lambda item: expired.append(
        (item, clock.seconds()))), expired


def test_each_expires_its_timeout_after_its_start_in_start_order() -> None:
    clock, tracked, expired = deadlines()
    tracked.start("a")
    clock.advance(0.25)
    tracked.start("b")
    clock.advance(0.25)
    tracked.start("c")
    assert len(clock.getDelayedCalls()) == 1, "one delayed call for all three"
    clock.advance(0.5)
    assert expired == [("a", 1.0)]
    clock.advance(0.24)
    assert expired == [("a", 1.0)], "b is not due yet"
    clock.advance(0.01)
    clock.advance(0.25)
    assert expired == [("a", 1.0), ("b", 1.25), ("c", 1.5)]
    assert clock.getDelayedCalls() == [] and len(tracked) == 0


def test_a_stopped_deadline_never_expires_and_the_next_is_kept() -> None:
    clock, tracked, expired = deadlines()
    tracked.start("a")
    clock.advance(0.5)
    tracked.start("b")
    tracked.stop("a")  # the oldest, which the delayed call was armed for
    clock.advance(0.5)
    assert expired == [], "a stopped; b is due at 1.5"
    [call] = clock.getDelayedCalls()
    assert call.getTime() == 1.5
    clock.advance(0.5)
    assert expired == [("b", 1.5)]


def test_no_delayed_call_once_nothing_is_tracked() -> None:
    clock, tracked, expired = deadlines()
    tracked.start("a")
    tracked.start("b")
    tracked.stop("b")
    assert len(clock.getDelayedCalls()) == 1
    tracked.stop("a")
    assert clock.getDelayedCalls() == []
    tracked.stop("a")  # twice, or never started: nothing happens
    tracked.stop("z")
    assert clock.getDelayedCalls() == [] and len(tracked) == 0
    clock.advance(10)
    assert expired == []


def test_an_expiry_callback_that_starts_another_leaves_one_call() -> None:
    clock = MemoryReactorClock()
    seen: list[str] = []

    def expired(item: str) -> None:
        seen.append(item)
        if item == "a":
            tracked.start("later")

    tracked: ArrivalDeadlines[str] = ArrivalDeadlines(clock, 1.0, expired)
    tracked.start("a")
    clock.advance(0.5)
    tracked.start("b")
    clock.advance(0.5)
    assert seen == ["a"]
    assert len(clock.getDelayedCalls()) == 1, "re-armed once, for b"
    clock.advance(0.5)
    assert seen == ["a", "b"]
    clock.advance(0.5)
    assert seen == ["a", "b", "later"]
    assert clock.getDelayedCalls() == []
