"""
The allocation side's public names, for a device plugin written in Python.

A device plugin that prepares the lock parent and patches each allocation
response itself (instead of running C{hostpid allocate}) needs these and
nothing else; they live in internal modules (L{hostpid.node.lockparent},
L{hostpid.node.allocation}, L{hostpid.node.hostpaths}, L{hostpid.gate}) whose
layout may change, so a plugin imports them from here.  See
C{docs/allocation.md} and C{docs/api.md}.
"""

from __future__ import annotations

from hostpid.gate import gate_enabled
from hostpid.node.allocation import patch_response, response_from_object, response_to_object
from hostpid.node.hostpaths import FilesystemHostPaths
from hostpid.node.lockparent import LockParentError, prepare_lock_parent

__all__ = [
    "FilesystemHostPaths",
    "LockParentError",
    "gate_enabled",
    "patch_response",
    "prepare_lock_parent",
    "response_from_object",
    "response_to_object",
]
