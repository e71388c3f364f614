"""
hostpid: the host PID broker for GPU sharing on Kubernetes.

A root-owned Unix socket, served from the host PID namespace, that tells each
caller its own host PID as the kernel reports it (C{SO_PEERCRED}); a client
that applies HAMi-core's trust rules; and the allocation-side helpers that
prepare C{/tmp/vgpulock} and patch a kubelet allocation response.
"""

__version__ = "0.1.0"
