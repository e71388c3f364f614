"""
Is this process in the kernel's initial ("host") PID namespace?

C{SO_PEERCRED} translates the peer's PID into the reader's PID namespace.  A
broker started in any other namespace (a pod without C{hostPID: true}, a
nested container, a systemd unit with C{PrivatePIDs=}) would hand out PIDs of
that namespace: plausible numbers, wrong for NVML.  The initial PID namespace
has a fixed identity: its nsfs inode is C{PROC_PID_INIT_INO}.
"""

from __future__ import annotations

import os

from hostpid.broker.fsrules import BrokerStartupError

#: C{PROC_PID_INIT_INO} (include/linux/proc_ns.h): the initial PID namespace.
PROC_PID_INIT_INO = 0xEFFFFFFC
PID_NAMESPACE_PATH = "/proc/self/ns/pid"

OVERRIDE_OPTION = "--allow-non-host-pid-namespace"


def pid_namespace_inode(path: str = PID_NAMESPACE_PATH) -> int:
    """The inode that identifies this process's PID namespace."""
    return os.stat(path).st_ino


def check_host_pid_namespace(allow_other: bool, default_directory: bool) -> int:
    """
    Refuse to serve outside the initial PID namespace, unless the operator
    explicitly allowed it for a directory other than the default one.

    @return: the PID namespace inode found.
    @raise BrokerStartupError: the namespace cannot be confirmed and the
        override does not apply.
    """
    if allow_other and default_directory:
        raise BrokerStartupError(
            PID_NAMESPACE_PATH,
            f"{OVERRIDE_OPTION} is refused with the default broker directory: production "
            "brokers must serve host PIDs",
        )
    try:
        inode = pid_namespace_inode()
    except OSError as e:
        if allow_other:
            return 0
        raise BrokerStartupError(
            PID_NAMESPACE_PATH,
            f"cannot tell which PID namespace the broker is in ({e.strerror}); mount /proc",
        ) from None
    if inode != PROC_PID_INIT_INO and not allow_other:
        raise BrokerStartupError(
            PID_NAMESPACE_PATH,
            f"the broker runs in PID namespace pid:[{inode}], not the host's "
            f"pid:[{PROC_PID_INIT_INO}]; the PIDs it would report are not host PIDs. Run it in "
            "the host PID namespace (Kubernetes: hostPID: true; systemd: no PrivatePIDs=)",
        )
    return inode
