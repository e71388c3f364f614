"""
The environment gate: C{LIBVGPU_HOSTPID_BROKER}.

The server, the client and the allocation side all obey one rule, kept here
so that it cannot drift: only the exact string C{"1"} enables the broker.
C{""}, C{"0"}, C{"true"}, C{"01"}, C{" 1"}, C{"1 "} and everything else mean
disabled, because a lenient parse in one component and a strict one in another
is how a node ends up half-enabled.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: an exec probe loads this module
if TYPE_CHECKING:
    from collections.abc import Mapping

GATE_ENV = "LIBVGPU_HOSTPID_BROKER"
ENABLED_VALUE = "1"


def gate_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether C{environ} (default: this process's environment) enables the broker."""
    if environ is None:
        environ = os.environ
    return environ.get(GATE_ENV) == ENABLED_VALUE
