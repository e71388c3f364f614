"""
hostpid: the host PID broker for GPU sharing on Kubernetes.

A root-owned Unix socket, served from the host PID namespace, that tells each
caller its own host PID as the kernel reports it (C{SO_PEERCRED}); a client
that applies HAMi-core's trust rules; and the allocation-side helpers that
prepare C{/tmp/vgpulock} and patch a kubelet allocation response.

The public API is the names in L{__all__}, and the C{__all__} of each module
in L{PUBLIC_MODULES}: the test double (C{hostpid.testing}), the allocation
helpers for a device plugin (C{hostpid.allocation}) and the embedding helpers
(C{hostpid.broker.refusal}), all documented in C{docs/api.md}.  Every other
module and name is internal and may move; the documentation's examples import
only public names, and a test holds them to it.  The names are imported on first
use: C{import hostpid} loads nothing else, so a workload that only wants the
blocking client never pays for the broker's modules, and nothing here
installs a Twisted reactor.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs an exec probe 10 ms

__version__ = "0.1.0"

#: The public names of the package itself: the source of truth for
#: C{docs/api.md} and for the test that checks every documented example.
__all__ = [
    "STRICT",
    "BrokerService",
    "CheckResult",
    "HostPidUnavailable",
    "TrustPolicy",
    "doctor",
    "lookup_host_pid",
    "lookup_host_pid_deferred",
    "query_host_pid",
    "query_host_pid_deferred",
]

#: The modules besides this one whose C{__all__} is public.
PUBLIC_MODULES = ("hostpid.testing", "hostpid.allocation", "hostpid.broker.refusal")

#: Where each public name lives.
_HOMES = {
    "query_host_pid": "hostpid.client.blocking",
    "lookup_host_pid": "hostpid.client.blocking",
    "doctor": "hostpid.client.blocking",
    "lookup_host_pid_deferred": "hostpid.client.txclient",
    "STRICT": "hostpid.client.trust",
    "CheckResult": "hostpid.client.trust",
    "query_host_pid_deferred": "hostpid.client.txclient",
    "TrustPolicy": "hostpid.client.trust",
    "HostPidUnavailable": "hostpid.client.trust",
    "BrokerService": "hostpid.broker.service",
}

if TYPE_CHECKING:
    from hostpid.broker.service import BrokerService
    from hostpid.client.blocking import doctor, lookup_host_pid, query_host_pid
    from hostpid.client.trust import STRICT, CheckResult, HostPidUnavailable, TrustPolicy
    from hostpid.client.txclient import lookup_host_pid_deferred, query_host_pid_deferred


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hostpid' has no attribute {name!r}")
    import importlib  # here, not above: it loads warnings, which an exec probe need not pay for

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
