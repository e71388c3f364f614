"""
Which waiting connection gives up its slot: the rule of fairness between peers.

Attackers are few processes with many connections; real clients are many
processes with one each (HAMi-core asks once per process).  So when every
slot is held, the connection to close is the oldest one of the peer that
holds the most waiting connections, and no peer may hold more than a bound
(the broker refuses its newcomers at accept).  A late sender from an
otherwise idle peer then keeps its slot for as long as any other peer holds
two or more, and one process cannot take every slot.

Before that rule, a connection whose connector has exited gives up its slot
first: no request on it can ever be answered (the liveness check refuses a
PID whose process is gone), and a PID is only a key while its process lives.
An attacker that connects every socket from a fresh child that exits at
once (C{clone(CLONE_VM | CLONE_FILES | CLONE_VFORK)}: tens of thousands a
second from one process) never holds two connections under one PID; with
those slots given up first, holding a slot costs it a process that stays
alive (or an unreaped zombie, which keeps its PID and counts against the
pod's C{pids} limit just the same).  L{Rotation} is the order in which
waiting connections are asked, a bounded few at a time.

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

    def __init__(self, bound: int | None = None) -> None:
        """
        @param bound: a share of items per peer; the peers holding that many
            or more are kept in L{atBound}, so that asking whether a peer is
            at its share is a dictionary lookup, with no call.
        """
        self._bound = bound
        #: The peers holding L{bound} items or more (empty without a bound).
        self.atBound: dict[P, None] = {}
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
        if self._bound is not None and held >= self._bound:
            self.atBound[peer] = None
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
        if self._bound is not None and held < self._bound:
            self.atBound.pop(peer, None)
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


class Rotation(Generic[T]):
    """
    Waiting items in the order they were added or last looked at: the
    round on which connections are asked whether their connector still
    exists (L{hostpid.broker.waiting.WaitingRoom}).  Looking at one moves it
    to the back, so a bounded number of looks at a time still reaches every
    item in turn, and one that was found alive is not asked again before all
    the others have been.  Adding, removing and looking are each O(1).
    """

    def __init__(self) -> None:
        self._items: OrderedDict[T, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        """C{item} starts waiting: looked at after every item already here."""
        self._items[item] = None

    def remove(self, item: T) -> None:
        """C{item} stops waiting (nothing if it was not here)."""
        self._items.pop(item, None)

    def next(self) -> T | None:
        """
        The item added or looked at longest ago, now moved to the back;
        C{None} when nothing waits.
        """
        items = self._items
        if not items:
            return None
        item = next(iter(items))
        items.move_to_end(item)
        return item


class LookBackoff:
    """
    Whether to ask about connectors this time: after a round of looks that
    found none gone, the next rounds are skipped, one, then two, four, ...
    up to L{longest}; a round that finds one asks at every newcomer again.

    The looks cost a few microseconds each (a pidfd made and closed), and a
    flood from live processes that fills every slot would otherwise pay
    them for every newcomer and find nothing; a PID spray finds one at
    almost every look and is never skipped for long.  While skipped, the
    fairness rule alone chooses, as it did before the looks.
    """

    def __init__(self, longest: int = 32) -> None:
        self.longest = longest
        self._wait = 0
        self._skip = 0

    def due(self) -> bool:
        """Whether this newcomer's round of looks is to be made."""
        if self._skip:
            self._skip -= 1
            return False
        return True

    def looked(self, found: bool) -> None:
        """A round of looks was made, and found a gone connector or not."""
        if found:
            self._wait = self._skip = 0
        else:
            self._wait = min(self._wait * 2 or 1, self.longest)
            self._skip = self._wait
