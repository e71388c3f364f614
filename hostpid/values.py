"""
Frozen value classes without C{attrs}, for the modules an exec probe loads.

C{hostpid probe} runs three times per 20 s on every node, as a fresh
interpreter each time; importing C{attrs} alone costs more CPU than the whole
transaction (about 40 ms of a 50 ms run: it loads C{typing} and C{inspect}).
So the few value classes on that path (a check's verdict, C{SO_PEERCRED}, a
reply) derive from L{Value} instead: slotted, immutable, compared and hashed
by their fields, with an C{attrs}-like C{repr}.  Everything else keeps
C{attrs}.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _V = TypeVar("_V", bound="Value")


class Value:
    """
    A frozen record.  A subclass names its fields in C{__slots__} (in order)
    and sets them once in C{__init__} with L{_set}; C{_compared} names the
    fields that equality and hashing use when not all of them should.
    """

    __slots__: tuple[str, ...] = ()
    _compared: tuple[str, ...] | None = None

    def _set(self, **fields: object) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def _key(self) -> tuple[object, ...]:
        names = self.__slots__ if self._compared is None else self._compared
        return tuple(getattr(self, name) for name in names)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Value)
        return self._key() == other._key()

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, *self._key()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def replace(self: _V, **changes: Any) -> _V:
        """A copy with C{changes}, through C{__init__} (so its checks run)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return type(self)(**fields)
