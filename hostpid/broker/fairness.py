"""
Which waiting connection gives up its slot: the rule of fairness between peers.

Attackers are few processes with many connections; real clients are many
processes with one each (HAMi-core asks once per process).  So when every
slot is held, the connection to close is the oldest one of the peer that
holds the most waiting connections, and no peer may hold more than a bound
(the broker refuses its newcomers at accept).  A late sender from an
otherwise idle peer then keeps its slot for as long as any other peer holds
two or more, and one process cannot take every slot.

The peer is the PID C{SO_PEERCRED} reports, read once when the connection
is accepted (see L{hostpid.broker.waiting} for why the PID and not the UID
or the cgroup).

L{PeerQueues} keeps, for every peer, its waiting connections in arrival
order, and the peers grouped by how many they hold, so that adding,
removing and choosing the victim are each O(1): counts change by one at a
time, so the highest non-empty group is always at hand.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)
P = TypeVar("P", bound=Hashable)


class PeerQueues(Generic[T, P]):
    """
    Waiting items grouped by peer.

    Ties between peers holding the most are broken by which reached that
    count first, so the choice is deterministic.
    """

    def __init__(self) -> None:
        #: Each peer's items, oldest first.
        self._items: dict[P, OrderedDict[T, None]] = {}
        #: Peers by how many items they hold (index 0 unused), in the order
        #: they reached that count.
        self._byCount: list[dict[P, None]] = [{}]
        self._most = 0
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def count(self, peer: P) -> int:
        """How many items C{peer} holds now."""
        items = self._items.get(peer)
        return 0 if items is None else len(items)

    @property
    def most(self) -> int:
        """How many items the peer holding the most holds (0 when empty)."""
        return self._most

    def add(self, item: T, peer: P) -> None:
        """C{item} from C{peer} starts waiting (it must not be waiting yet)."""
        items = self._items.get(peer)
        if items is None:
            items = self._items[peer] = OrderedDict()
        else:
            del self._byCount[len(items)][peer]
        items[item] = None
        held = len(items)
        byCount = self._byCount
        if held == len(byCount):
            byCount.append({})
        byCount[held][peer] = None
        if held > self._most:
            self._most = held
        self._total += 1

    def remove(self, item: T, peer: P) -> bool:
        """
        C{item} from C{peer} stops waiting.

        @return: whether it was waiting.
        """
        items = self._items.get(peer)
        if items is None or items.pop(item, 0) is not None:
            return False
        held = len(items)
        byCount = self._byCount
        del byCount[held + 1][peer]
        if held:
            byCount[held][peer] = None
        else:
            del self._items[peer]
        if held + 1 == self._most and not byCount[held + 1]:
            # Only this peer held the most; it now holds one less.
            self._most = held
        self._total -= 1
        return True

    def victim(self) -> tuple[T, P] | None:
        """
        The oldest item of the peer holding the most, and that peer; C{None}
        when nothing waits.  Nothing is removed.
        """
        if not self._most:
            return None
        peer = next(iter(self._byCount[self._most]))
        return next(iter(self._items[peer])), peer
