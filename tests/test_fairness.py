"""
L{hostpid.broker.fairness.PeerQueues}: the victim is always the oldest item
of the peer holding the most, whatever order items come and go in.
"""

from __future__ import annotations

import random

from hostpid.broker.fairness import LookBackoff, PeerQueues, Rotation


def reference_victim(waiting: list[tuple[str, int]], reached: dict[tuple[int, int], int]):
    """The rule written the slow way: most held, then reached that count first."""
    counts: dict[int, int] = {}
    for _, peer in waiting:
        counts[peer] = counts.get(peer, 0) + 1
    if not counts:
        return None
    most = max(counts.values())
    peer = min((p for p, n in counts.items() if n == most), key=lambda p: reached[(p, most)])
    return next(item for item, p in waiting if p == peer), peer


def test_matches_the_slow_rule_under_random_traffic() -> None:
    rng = random.Random(19)
    queues: PeerQueues[str, int] = PeerQueues()
    waiting: list[tuple[str, int]] = []
    reached: dict[tuple[int, int], int] = {}
    counts: dict[int, int] = {}
    for step in range(5000):
        if waiting and rng.random() < 0.45:
            item, peer = waiting.pop(rng.randrange(len(waiting)))
            assert queues.remove(item, peer)
            counts[peer] -= 1
            if counts[peer]:
                reached[(peer, counts[peer])] = step
        else:
            peer = rng.randrange(6)
            item = f"c{step}"
            queues.add(item, peer)
            waiting.append((item, peer))
            counts[peer] = counts.get(peer, 0) + 1
            reached[(peer, counts[peer])] = step
        assert queues.victim() == reference_victim(waiting, reached)
        assert len(queues) == len(waiting)
        assert queues.most == max(counts.values(), default=0)


def test_removing_what_is_not_there() -> None:
    queues: PeerQueues[str, int] = PeerQueues()
    assert not queues.remove("a", 1)
    queues.add("a", 1)
    assert not queues.remove("b", 1)
    assert not queues.remove("a", 2)
    assert queues.remove("a", 1)
    assert not queues.remove("a", 1)
    assert queues.victim() is None and queues.most == 0 and queues.count(1) == 0


def test_rotation_looks_at_each_item_in_turn() -> None:
    rotation: Rotation[str] = Rotation()
    assert rotation.next() is None
    for item in "abc":
        rotation.add(item)
    assert [rotation.next(), rotation.next()] == ["a", "b"]
    rotation.add("d")
    rotation.remove("c")
    rotation.remove("missing")
    assert len(rotation) == 3
    assert [rotation.next() for _ in range(4)] == ["a", "b", "d", "a"]


def test_look_backoff_skips_more_rounds_after_each_that_found_nothing() -> None:
    backoff = LookBackoff(longest=4)
    made = []
    for _ in range(20):
        due = backoff.due()
        made.append(due)
        if due:
            backoff.looked(False)
    # Rounds made, then 1, 2, 4, 4 ... skipped.
    assert made[:14] == [True, False, True, False, False, True, False, False, False, False,
                         True, False, False, False]
    backoff.looked(True)
    assert [backoff.due() for _ in range(3)] == [True] * 3, "a round that found one: every time"


def test_peers_at_their_bound_are_kept_apart() -> None:
    """C{atBound} follows every add and remove: the port's test without a call."""
    queues: PeerQueues[str, int] = PeerQueues(bound=2)
    queues.add("a1", 1)
    assert queues.atBound == {}
    queues.add("a2", 1)
    queues.add("b1", 2)
    assert queues.atBound == {1: None}
    queues.remove("a1", 1)
    assert queues.atBound == {}
    queues.add("a3", 1)
    assert list(queues.atBound) == [1]
    unbounded: PeerQueues[str, int] = PeerQueues()
    for item in ("x", "y", "z"):
        unbounded.add(item, 1)
    assert unbounded.atBound == {}, "no bound: never filled"
