"""
hostpid: the host PID broker for GPU sharing on Kubernetes.

A root-owned Unix socket, served from the host PID namespace, that tells each
caller its own host PID as the kernel reports it (C{SO_PEERCRED}); a client
that applies HAMi-core's trust rules; and the allocation-side helpers that
prepare C{/tmp/vgpulock} and patch a kubelet allocation response.

The public API is the names in L{__all__}, the test double
C{hostpid.testing.FakeBroker} and the embedding helpers of
C{hostpid.broker.refusal} (all documented in C{docs/api.md}); every other
module and name is internal and may move.  The names are imported on first
use: C{import hostpid} loads nothing else, so a workload that only wants the
blocking client never pays for the broker's modules, and nothing here
installs a Twisted reactor.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs an exec probe 10 ms

__version__ = "0.1.0"

__all__ = [
    "BrokerService",
    "HostPidUnavailable",
    "TrustPolicy",
    "lookup_host_pid",
    "query_host_pid",
    "query_host_pid_deferred",
]

#: Where each public name lives.
_HOMES = {
    "query_host_pid": "hostpid.client.blocking",
    "lookup_host_pid": "hostpid.client.blocking",
    "query_host_pid_deferred": "hostpid.client.txclient",
    "TrustPolicy": "hostpid.client.trust",
    "HostPidUnavailable": "hostpid.client.trust",
    "BrokerService": "hostpid.broker.service",
}

if TYPE_CHECKING:
    from hostpid.broker.service import BrokerService
    from hostpid.client.blocking import lookup_host_pid, query_host_pid
    from hostpid.client.trust import HostPidUnavailable, TrustPolicy
    from hostpid.client.txclient import query_host_pid_deferred


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hostpid' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
