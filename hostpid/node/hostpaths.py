"""
Host paths judged by identity: the thin, impure layer under the pure patch.

A mount's host path can name the broker directory without spelling it: a
symlinked alias (C{/srv/alias -> /var/run/hami/hostpid}), C{/run} for
C{/var/run}, a second bind mount of the directory elsewhere on the host.  A
second, writable view of the broker directory in a workload lets it replace
C{broker.sock}, so L{hostpid.node.allocation.patch_response} removes every
mount of it but the canonical read-only one; this module tells it which host
paths those are, by C{stat} where the path exists in this mount namespace
(the device plugin's, which must see the host's paths at the same names, as
C{--lock-parent} already requires).
"""

from __future__ import annotations

import os

import attrs
from zope.interface import implementer

from hostpid import defaults
from hostpid.node.allocation import IHostPaths, LexicalHostPaths, clean_container_path


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


@implementer(IHostPaths)
@attrs.frozen
class FilesystemHostPaths:
    """
    A host path names the broker directory if, by spelling, it is the
    directory or inside it (as L{LexicalHostPaths} judges), or if it or one of
    its ancestors, resolved as the kernel resolves a mount source, is the
    directory itself by device and inode.

    The host path and its ancestors are only looked at (C{stat}); nothing is
    opened or changed.
    """

    broker_directory: str = defaults.BROKER_DIRECTORY

    def names_broker_directory(self, host_path: str) -> bool:
        if LexicalHostPaths(self.broker_directory).names_broker_directory(host_path):
            return True
        cleaned = clean_container_path(host_path)
        real = os.path.realpath(cleaned)
        real_broker = os.path.realpath(self.broker_directory)
        if LexicalHostPaths(real_broker).names_broker_directory(real):
            return True
        broker = _identity(real_broker)
        if broker is None:
            return False
        path = real
        while True:
            if _identity(path) == broker:
                return True
            parent = os.path.dirname(path)
            if parent == path:
                return False
            path = parent
