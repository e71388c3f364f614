"""
Many deadlines of one length behind a single delayed call.

Every transaction on the broker's general path has the same deadline,
counted from its accept.  So the deadlines expire in the order the
transactions started, and one delayed call, armed for the oldest, serves
them all: starting and stopping one is an C{OrderedDict} insert and delete,
where a delayed call each would cost a C{callLater} and a C{cancel} plus
the reactor's heap work on every one.  Under a reconnecting flood, where
each accepted connection evicts the oldest waiting one, that heap work was
the largest single cost per connection (profiled: a million Python-level
comparisons of delayed calls for 57,000 evictions).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from twisted.internet.interfaces import IDelayedCall, IReactorTime

T = TypeVar("T", bound=Hashable)


class ArrivalDeadlines(Generic[T]):
    """
    Deadlines of C{timeout} seconds from each L{start}, in start order; when
    one passes, C{expired(item)} is called (once, after the item is
    forgotten).  At most one delayed call is pending, and none once nothing
    is tracked, so a reactor left idle holds no timer of ours.
    """

    def __init__(self, clock: IReactorTime, timeout: float, expired: Callable[[T], None]) -> None:
        self._clock = clock
        self._timeout = timeout
        self._expired = expired
        self._expires: OrderedDict[T, float] = OrderedDict()
        self._call: IDelayedCall | None = None

    def __len__(self) -> int:
        return len(self._expires)

    def start(self, item: T) -> float:
        """Start C{item}'s deadline now; return now (one clock read for both)."""
        now = self._clock.seconds()
        self._expires[item] = now + self._timeout
        if self._call is None:
            self._call = self._clock.callLater(self._timeout, self._fire)
        return now

    def stop(self, item: T) -> None:
        """Forget C{item} (nothing happens if it is not tracked)."""
        if self._expires.pop(item, None) is not None and not self._expires:
            self._cancel()

    def _cancel(self) -> None:
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()

    def _fire(self) -> None:
        self._call = None
        now = self._clock.seconds()
        expires = self._expires
        while expires:
            item, when = next(iter(expires.items()))
            if when > now:
                # Armed for the oldest, which may have stopped since: re-arm
                # for the oldest still tracked (replacing any call that an
                # expired item's callback made by starting another).
                self._cancel()
                self._call = self._clock.callLater(when - now, self._fire)
                return
            del expires[item]
            self._expired(item)
