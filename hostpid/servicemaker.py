"""
A twistd plugin whose part of the package may lack its extra.

twistd imports a plugin's module only when its command is parsed
(C{ServiceMaker.options}); a dependency that only an extra installs is then
an C{ImportError} with a traceback, its one useful line last.  This
C{ServiceMaker} turns L{MissingExtra} into twistd's exit with that line
alone, naming the command and the extra.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import ServiceMaker

from hostpid.errors import MissingExtra


class ExtraServiceMaker(ServiceMaker):
    """A L{ServiceMaker} that stops twistd with one line when its module lacks its extra."""

    @property
    def options(self) -> Any:
        try:
            return ServiceMaker.options.fget(self)  # type: ignore[attr-defined]
        except MissingExtra as missing:
            raise SystemExit(f"twistd {self.tapname}: {missing}") from None
