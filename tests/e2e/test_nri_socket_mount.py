"""
The NRI plugin through a read-only bind of the runtime's socket directory,
as the chart mounts it (C{deploy/helm/hostpid-broker/templates/nri-daemonset.yaml},
C{readOnly: true}), on both containerds of L{test_nri_containerd}.

Connecting to a Unix socket needs write permission on the socket's inode,
not a writable mount: the kernel's C{unix_find_bsd} asks
C{path_permission(MAY_WRITE)}, and C{sb_permission} refuses a write on a
read-only mount only to regular files, directories and symbolic links
(C{fs/namei.c}, C{fs/inode.c}).  The test shows it with the real runtime:
C{twistd hostpid-nri} runs in a private mount namespace where the socket's
directory is bound read-only over itself, registers, adjusts a GPU
container, and does again after containerd restarts (NRI removes and
recreates the socket in the same directory: C{pkg/adaptation/adaptation.go},
C{startListener}).

It also measures what C{docs/nri.md} states of the socket: NRI creates the
directory 0700 (C{os.MkdirAll(dir, 0700)}) and listens with
C{net.ListenUnix}, which sets no mode, so the socket is 0777 less
containerd's umask: 0755 under systemd's default C{UMask=0022}.
"""

from __future__ import annotations

import os
import stat
import subprocess
import uuid

import pytest
from crilib import Containerd, Containerds
from test_nri_containerd import (
    GpuNode,
    Kubelet,
    Plugin,
    adjusted,
    gpu_node,
    kubelet,
    probe,
    wait_adjusting,
)

pytestmark = pytest.mark.privileged

__all__ = ["gpu_node", "kubelet"]  # the fixtures this module uses


@pytest.fixture(scope="module", params=["containerd17", "containerd21"])
def daemon(request: pytest.FixtureRequest, containerds: Containerds) -> Containerd:
    """The containerds whose socket the chart mounts read-only: the modes measured are theirs."""
    runtime = containerds.runtime(request.param)
    assert isinstance(runtime, Containerd)
    return runtime

#: The plugin's argv, run in a private mount namespace where the directory
#: ($0) is a read-only bind of itself.
READ_ONLY_WRAPPER = (
    "unshare", "--mount", "--propagation", "private", "--", "sh", "-euc",
    'mount --bind "$0" "$0"; mount -o remount,bind,ro "$0" "$0"; exec "$@"',
)


def umask_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise AssertionError(f"no Umask in /proc/{pid}/status")


def mount_options(pid: int, path: str) -> list[str]:
    """The per-mount options of the mount at C{path} as process C{pid} sees it."""
    found = []
    with open(f"/proc/{pid}/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if fields[4] == path:
                found = fields[5].split(",")
    assert found, f"no mount at {path} for process {pid}"
    return found


def test_plugin_connects_through_a_read_only_socket_directory(
        daemon: Containerd, kubelet: Kubelet, gpu_node: GpuNode) -> None:
    assert daemon.nri_socket is not None
    directory = str(daemon.nri_socket.parent)
    socket_mode = stat.S_IMODE(os.stat(daemon.nri_socket).st_mode)
    directory_mode = stat.S_IMODE(os.stat(directory).st_mode)
    umask = umask_of(daemon.process.pid)
    version = subprocess.run([str(daemon.bin / "containerd"), "--version"], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()[2]
    print(f"\n[nri] containerd {version}: socket {oct(socket_mode)}, directory "
          f"{oct(directory_mode)}, containerd's umask {oct(umask)}")
    assert socket_mode == 0o777 & ~umask
    assert directory_mode == 0o700 & ~umask
    plugin = Plugin(daemon, gpu_node.node,
                    daemon.workdir / f"plugin-ro-{uuid.uuid4().hex[:6]}.log",
                    wrapper=(*READ_ONLY_WRAPPER, directory))
    try:
        seconds = wait_adjusting(kubelet, gpu_node, plugin)
        assert "ro" in mount_options(plugin.process.pid, directory), "the bind is read-only"
        daemon.restart()
        again = wait_adjusting(kubelet, gpu_node, plugin)
        assert probe(kubelet, gpu_node) == adjusted(gpu_node.node)
        assert "ro" in mount_options(plugin.process.pid, directory)
    finally:
        plugin.stop()
    assert "Traceback" not in plugin.output(), plugin.output()
    print(f"[nri] through a read-only bind: adjusting after {seconds:.2f}s, "
          f"and {again:.2f}s after containerd restarted")
