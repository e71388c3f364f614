"""
Tenants against the NRI plugin's mounts, with real containers: containerd
1.7.24 and 2.1.9 driven over CRI as the kubelet drives them, C{twistd
hostpid-nri} and a real broker on a private node (the harness of
L{test_nri_containerd}, imported).

Why each check exists:

- The broker mountpoint C{<lock parent>/hostpid} is an entry of the shared,
  writable lock parent, and HAMi-family device plugins chmod the lock parent
  0777 (no sticky bit) on every allocation.  A tenant container running as
  UID 1000 that has the lock parent (its device plugin mounts it; its pod opts
  out of the NRI plugin, which its own labels allow) renames the entry and
  puts a file there: runc then failed every later GPU container the plugin
  adjusted (C{not a directory}); a symlink to C{/etc}: runc resolves the
  destination inside the next container's root and mounted the broker
  directory over its C{/etc}.  The next GPU container must START, with its
  own C{/etc}, and the broker (repaired) or, where the plugin cannot repair
  the entry, the lock parent alone: never a broker mount onto the entry.
- The lock parent is writable by every GPU container: a set-user-ID-root
  program one container's root leaves there ran as euid 0 for a UID 1000
  process of another container, because the plugin mounted it without
  C{nosuid}.  The mounts now carry C{nosuid,nodev,noexec} (the broker
  directory read-only too): the program does not run, or runs with the
  caller's own euid.

The victim containers here may escalate privileges (C{allowPrivilegeEscalation}
unset, as Pod Security C{baseline} allows): with C{no_new_privs} the kernel
ignores a set-user-ID bit anyway and the test could not fail.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubeletlib
import pytest
from crilib import IMAGE_ETC_MARKER
from support import require_tool
from test_nri_containerd import (
    GO_FILE,
    NOTHING,
    SCRIPT,
    WORKLOAD_UID,
    Adjustment,
    GpuNode,
    Kubelet,
    Plugin,
    PodRun,
    adjusted,
    daemon,
    gpu_node,
    kubelet,
    plugin,
    restricted_pod,
    run_pod,
)

from hostpid import defaults
from hostpid.nri.decision import OPT_OUT_KEY, OPT_OUT_VALUE

# The module fixtures of test_nri_containerd, used here by name: the same
# runtimes (the NRI cells), node, kubelet and plugin.
__all__ = ["daemon", "gpu_node", "kubelet", "plugin"]

pytestmark = pytest.mark.privileged

#: Set-user-ID bit and permissions the planting container's root gives its program.
SETUID_MODE = "4755"

EUID_SOURCE = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) { printf("euid %d\n", (int)geteuid()); return 0; }
"""


def run(kubelet: Kubelet, pod: Mapping[str, Any],
        allocations: Sequence[Mapping[str, Any]] = (),
        before_go: Callable[[int], object] | None = None) -> PodRun:
    """L{run_pod}, named after the pod."""
    return run_pod(kubelet, pod["metadata"]["name"], pod, allocations, before_go)


def wait_go(then: str) -> str:
    """A script that waits for the test's go-ahead, then runs C{then}."""
    return (f"i=0; while [ ! -e {GO_FILE} ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 3; "
            f"sleep 0.05; done; {then}")


def pod_running(name: str, script: str, *, uid: int, escalation: bool = False,
                labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A one-container pod running C{script} as C{uid}."""
    pod = kubeletlib.gpu_pod(f"{name}-{uuid.uuid4().hex[:6]}", str(uuid.uuid4()),
                             command=["/bin/sh", "-c", script], run_as_user=uid)
    pod["metadata"]["namespace"] = "tenants"
    pod["metadata"]["labels"] = dict(labels or {})
    pod["spec"]["hostNetwork"] = False
    if escalation:
        del pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    return pod


def hami_allocation(gpu_node: GpuNode) -> dict[str, Any]:
    """What a HAMi-family device plugin returns: the GPU and the lock parent, writable."""
    allocation = gpu_node.allocation()
    allocation["mounts"] = [{"containerPath": defaults.LOCK_PARENT,
                             "hostPath": str(gpu_node.node.lock_parent), "readOnly": False}]
    return allocation


def device_plugin_allocates(gpu_node: GpuNode) -> None:
    """What HAMi's device plugin does to the lock parent on every allocation."""
    os.chmod(gpu_node.node.lock_parent, 0o777)


def tenant_replaces_mountpoint(kubelet: Kubelet, gpu_node: GpuNode, replace: str) -> None:
    """
    A UID 1000 tenant with the lock parent (opted out of the plugin, its
    device plugin mounting the lock parent) moves C{hostpid} away and runs
    C{replace} in the lock parent.
    """
    device_plugin_allocates(gpu_node)
    moved = f"moved-{uuid.uuid4().hex[:8]}"  # a new name: mv into a directory is no rename
    script = wait_go(f"cd {defaults.LOCK_PARENT} && /bin/busybox mv -T hostpid {moved} && "
                     f"{replace} && echo replaced && ls -la {defaults.LOCK_PARENT}")
    tenant = pod_running("tenant", script, uid=WORKLOAD_UID,
                         labels={OPT_OUT_KEY: OPT_OUT_VALUE})
    done = run(kubelet, tenant, [hami_allocation(gpu_node)])
    assert done.exit_code == 0 and done.lines("replaced") == [""], (done.stdout, done.stderr)
    entry = gpu_node.node.lock_parent / "hostpid"
    assert entry.is_symlink() or not entry.is_dir(), "the tenant's entry is in place"


#: The victim's facts: what its /etc holds, whether the broker's socket is
#: where the broker mount puts it; then the usual script (the host PID).
VICTIM = ('echo "etc-socket $(if [ -e /etc/broker.sock ]; then echo yes; else echo no; fi)"; '
          f'echo "etc-image $(if [ -e {IMAGE_ETC_MARKER} ]; then echo yes; else echo no; fi)"; '
          + SCRIPT)


def victim(kubelet: Kubelet, gpu_node: GpuNode, name: str) -> PodRun:
    pod = restricted_pod(name)
    pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", VICTIM]
    return run(kubelet, pod, [gpu_node.allocation()])


def assert_sound(done: PodRun, gpu_node: GpuNode) -> None:
    """Started and ran; its own /etc; the broker (answering) or no broker mount."""
    assert done.lines("etc-socket") == ["no"], done.stdout
    assert done.lines("etc-image") == ["yes"], done.stdout
    lock_only = Adjustment(((defaults.LOCK_PARENT, str(gpu_node.node.lock_parent), False),),
                           ())
    assert done.adjustment in (adjusted(gpu_node.node), lock_only, NOTHING), done.adjustment
    if done.adjustment == adjusted(gpu_node.node):
        assert done.exit_code == 0, (done.stdout, done.stderr)
        assert done.lines("socket") == ["present"]
        answer = [line for line in done.stdout.splitlines() if line.split()[:1]
                  and all(f.isdigit() for f in line.split())]
        assert answer == [f"{done.host_pid} 1"], done.stdout
    else:
        assert done.lines("broker-mounts") == ["0"], done.stdout


def test_tenant_cannot_break_the_next_gpu_container(
        kubelet: Kubelet, gpu_node: GpuNode, plugin: Plugin) -> None:
    """
    A file, then a symlink to C{/etc}, at C{<lock parent>/hostpid}: the next
    GPU container starts each time, with its own C{/etc}; the plugin
    repaired the entry (it is root's directory again) and says so.
    """
    tenant_replaces_mountpoint(kubelet, gpu_node, "echo planted > hostpid")
    after_file = victim(kubelet, gpu_node, "after-file")
    assert_sound(after_file, gpu_node)

    tenant_replaces_mountpoint(kubelet, gpu_node, "/bin/busybox ln -s /etc hostpid")
    after_link = victim(kubelet, gpu_node, "after-link")
    assert_sound(after_link, gpu_node)

    # Repaired, not only avoided: the broker again, and the entry root's.
    assert after_file.adjustment == after_link.adjustment == adjusted(gpu_node.node)
    entry = os.lstat(gpu_node.node.lock_parent / "hostpid")
    assert not (gpu_node.node.lock_parent / "hostpid").is_symlink()
    assert entry.st_uid == 0 and oct(entry.st_mode & 0o7777) == oct(0o755)
    assert oct(os.stat(gpu_node.node.lock_parent).st_mode & 0o7777) == oct(0o1777)
    assert plugin.output().count("repaired the broker mountpoint") == 2, plugin.output()


def test_unrepairable_mountpoint_gives_the_lock_parent_alone(
        kubelet: Kubelet, gpu_node: GpuNode, plugin: Plugin) -> None:
    """
    Where the plugin cannot repair the entry (here the lock parent's parent
    belongs to UID 1000, which preparation refuses: that user could swap the
    lock parent itself), the next GPU container still starts, with its own
    C{/etc}, and gets the lock parent alone: no broker mount, no gate.
    """
    parent = gpu_node.node.lock_parent.parent
    os.chown(parent, WORKLOAD_UID, WORKLOAD_UID)
    try:
        tenant_replaces_mountpoint(kubelet, gpu_node, "/bin/busybox ln -s /etc hostpid")
        done = victim(kubelet, gpu_node, "unrepairable")
    finally:
        os.chown(parent, 0, 0)
    assert_sound(done, gpu_node)
    assert done.adjustment == Adjustment(
        ((defaults.LOCK_PARENT, str(gpu_node.node.lock_parent), False),), ())
    assert (gpu_node.node.lock_parent / "hostpid").is_symlink(), "left as it was"
    assert "cannot be repaired" in plugin.output(), plugin.output()


@pytest.fixture(scope="module")
def euid_program() -> Iterator[Path]:
    """A static program that prints its effective UID (the image has no C library)."""
    cc = require_tool("cc")
    build = Path(tempfile.mkdtemp(prefix="hostpid-euid-"))
    try:
        (build / "euid.c").write_text(EUID_SOURCE)
        subprocess.run([cc, "-static", "-O2", "-o", str(build / "euid"), str(build / "euid.c")],
                       check=True, timeout=120)
        yield build / "euid"
    finally:
        subprocess.run(["rm", "-rf", str(build)], check=False)


def mount_options(stdout: str, target: str) -> set[str]:
    """The per-mount options of C{target} in the container's own mountinfo (printed)."""
    for line in stdout.splitlines():
        fields = line.split()
        if fields[:1] == ["mountinfo"] and len(fields) > 6 and fields[5] == target:
            return set(fields[6].split(","))
    raise AssertionError(f"no mount at {target}:\n{stdout}")


def test_setuid_program_planted_in_the_lock_parent(
        kubelet: Kubelet, gpu_node: GpuNode, plugin: Plugin, euid_program: Path) -> None:
    """
    One GPU container's root plants a set-user-ID-root copy of a program in
    the lock parent; a UID 1000 process of another GPU container (no
    C{no_new_privs}) runs it: refused (C{noexec}), or with its own euid;
    never 0.  Both of the plugin's mounts carry C{nosuid,nodev,noexec}.
    """
    planted = f"{defaults.LOCK_PARENT}/euid-{uuid.uuid4().hex[:6]}"

    def hand_over(host_pid: int) -> None:
        target = Path(f"/proc/{host_pid}/root/tmp/euid-src")
        target.write_bytes(euid_program.read_bytes())

    planter = pod_running("planter", wait_go(
        f"/bin/cat /tmp/euid-src > {planted} && /bin/busybox chmod {SETUID_MODE} {planted} "
        f"&& echo planted && /bin/ls -ln {planted}"), uid=0)
    planted_run = run(kubelet, planter, [gpu_node.allocation()], before_go=hand_over)
    assert planted_run.adjustment == adjusted(gpu_node.node)
    assert planted_run.exit_code == 0 and planted_run.lines("planted") == [""], planted_run
    on_host = os.stat(gpu_node.node.lock_parent / Path(planted).name)
    assert on_host.st_uid == 0 and on_host.st_mode & 0o4000, "a set-user-ID-root file"

    caller = pod_running("caller", wait_go(
        f"{planted}; echo \"status $?\"; "
        f"grep {defaults.LOCK_PARENT} /proc/self/mountinfo | "
        "while read -r line; do echo \"mountinfo $line\"; done"),
        uid=WORKLOAD_UID, escalation=True)
    called = run(kubelet, caller, [gpu_node.allocation()])
    assert called.adjustment == adjusted(gpu_node.node)
    print(f"[tenant] planted program: euid {called.lines('euid')}, "
          f"status {called.lines('status')}, stderr {called.stderr.strip()!r}")
    assert called.lines("euid") in ([], [str(WORKLOAD_UID)]), called.stdout
    if not called.lines("euid"):
        assert called.lines("status") == ["126"], (called.stdout, called.stderr)
    lock_parent = mount_options(called.stdout, defaults.LOCK_PARENT)
    broker = mount_options(called.stdout, defaults.CONTAINER_BROKER_DIRECTORY)
    assert {"rw", "nosuid", "nodev", "noexec"} <= lock_parent, lock_parent
    assert {"ro", "nosuid", "nodev", "noexec"} <= broker, broker
