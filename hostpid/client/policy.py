"""
The client's trust policy as callers hold it: L{TrustPolicy}, an C{attrs}
class (callers C{attrs.evolve} it), and L{STRICT}, the production rules.

It lives apart from the checks (L{hostpid.client.trust}, which still
exports both names) so that an exec probe, which needs the checks but not
this class, never loads C{attrs}.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import attrs

from hostpid import defaults
from hostpid.client.trust import (
    CHECKS,
    CONNECT,
    DEADLINE,
    OPTIONAL_CHECKS,
    CheckResult,
    Requirements,
    check_deadline,
    require,
)


def _positive_finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    check_deadline(attribute.name, value)


def _optional_checks(
    instance: object, attribute: attrs.Attribute[frozenset[str]], value: frozenset[str]
) -> None:
    for name in sorted(value):
        if name in OPTIONAL_CHECKS:
            continue
        if name in CHECKS or name in (CONNECT, DEADLINE):
            raise ValueError(f"the {name!r} check cannot be turned off")
        raise ValueError(
            f"unknown check {name!r}; checks that can be turned off: "
            + ", ".join(sorted(OPTIONAL_CHECKS))
        )


def _names(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise TypeError("turned_off takes check names, not one string")
    return frozenset(value)


@attrs.frozen
class TrustPolicy:
    """
    Where the broker is and what makes its answer trustworthy.

    The defaults are the production rules; a test or an unusual node points
    the client elsewhere with C{socket_path} and turns a check off only by
    naming it (L{without}), so that a relaxed policy always says what it
    relaxed.

    @ivar socket_path: the broker's socket.
    @ivar trusted_uid: the UID that must own the directory and the socket and
        run the listener.
    @ivar deadline: seconds for connect, write and read together.
    @ivar turned_off: names from L{OPTIONAL_CHECKS} that are not enforced.
    """

    socket_path: str = attrs.field(default=defaults.CLIENT_SOCKET, converter=os.fspath)
    trusted_uid: int = 0
    deadline: float = attrs.field(default=defaults.DEADLINE, validator=_positive_finite)
    turned_off: frozenset[str] = attrs.field(
        default=frozenset(), converter=_names, validator=_optional_checks
    )

    def without(self, *checks: str) -> TrustPolicy:
        """
        This policy with C{checks} turned off.

        @raise ValueError: a name is unknown or names a check that cannot be
            turned off.
        """
        return attrs.evolve(self, turned_off=self.turned_off.union(checks))

    def enforces(self, check: str) -> bool:
        return check not in self.turned_off

    def require(self, result: CheckResult) -> None:
        """
        Raise for C{result} if it failed and its check is enforced.

        @raise HostPidUnavailable: it did.
        """
        require(result, self.turned_off)

    def requirements(self) -> Requirements:
        """What a transaction under this policy enforces."""
        return Requirements(self.socket_path, self.trusted_uid, self.deadline, self.turned_off)


#: The production policy.
STRICT = TrustPolicy()
