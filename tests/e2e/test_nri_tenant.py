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

- HAMi's device plugin makes the lock parent 0777 on every allocation, so
  the sticky bit that kept a UID 1000 tenant from renaming root's entry is
  gone at any moment, also between the plugin's look (and repair) and the
  runtime's mount: with a chmod every 0.2 s and a tenant looping (rename,
  remove, symlink to C{/etc}, file), 22-24 of 30 containers got the broker
  over their own C{/etc} and 1-4 lost their broker mount after starting.
  L{test_hami_node_chmod_loop_and_tenant_loop} runs that node on every cell of
  the runtime matrix, the window held open by a second NRI plugin
  (L{nriwindow}) that makes the lock parent 0777 and waits for the tenant to
  act before the runtime mounts: 0 containers with the broker anywhere but at
  its own C{/tmp/vgpulock/hostpid}, 0 broker mounts lost, every one served.

The victim containers here may escalate privileges (C{allowPrivilegeEscalation}
unset, as Pod Security C{baseline} allows): with C{no_new_privs} the kernel
ignores a set-user-ID bit anyway and the test could not fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import kubeletlib
import nriwindow
import pytest
from crilib import IMAGE_ETC_MARKER, read_cri_log, wait_exited
from kernelfeatures import kernel_feature
from support import as_user_argv, release_immutable, require_tool, subprocess_env, wait_for
from test_nri_containerd import (
    GO_FILE,
    NOTHING,
    NRI_CELLS,
    OCI_CELLS,
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
    probe,
    restricted_pod,
    run_pod,
    wait_running_pid,
)

from hostpid import defaults, fileattr
from hostpid.nri.decision import OPT_OUT_KEY, OPT_OUT_VALUE

# The module fixtures of test_nri_containerd, used here by name: the same
# runtimes (the NRI cells), node, kubelet and plugin.
__all__ = ["daemon", "gpu_node", "kubelet", "plugin"]

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = [pytest.mark.privileged, kernel_feature("immutable_tmp")]

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
    # As an older release left it: without the immutable attribute, which would refuse
    # the tenant's rename (test_hami_node_chmod_loop_and_tenant_loop).
    release_immutable(gpu_node.node.lock_parent / "hostpid")
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
    A file, then a symlink to C{/etc}, at C{<lock parent>/hostpid} (made
    without the immutable attribute, as an older release left it): the next
    GPU container starts each time, with its own C{/etc}; the plugin
    repaired the entry (it is root's immutable directory again) and says so.
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
    held = os.open(gpu_node.node.lock_parent / "hostpid", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert fileattr.is_immutable(held), "repaired and made immutable"
    finally:
        os.close(held)
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


# -- a HAMi node: the lock parent made 0777 again and again, a tenant in a loop -------------

#: GPU containers created on each cell while the loops run.
HAMI_CONTAINERS = 12
#: Seconds between two chmods of the lock parent to 0777 (HAMi's device plugin
#: does one at every allocation).
CHMOD_EVERY = 0.2
#: The window plugin's index: after hostpid's (L{PLUGIN_NAME}'s 90).
WINDOW_INDEX = "95"

#: A container that stays up until the go-ahead: its own C{/etc} at start,
#: then, after the loops ran on, the broker mount and the broker's answer.
HELD = ('echo "etc-socket $(if [ -e /etc/broker.sock ]; then echo yes; else echo no; fi)"; '
        f'echo "etc-image $(if [ -e {IMAGE_ETC_MARKER} ]; then echo yes; else echo no; fi)"; '
        f"i=0; while [ ! -e {GO_FILE} ]; do i=$((i+1)); [ $i -gt 12000 ] && exit 3; "
        "sleep 0.05; done; "
        'echo "broker-mounts $(grep -c " /tmp/vgpulock/hostpid " /proc/self/mountinfo)"; '
        'if [ -S /tmp/vgpulock/hostpid/broker.sock ]; then echo "socket present"; '
        'else echo "socket absent"; fi; '
        "exec /bin/hostpid_client")


@attrs.define
class Held:
    """One GPU container of the HAMi run, from creation to its exit."""

    pod: str
    sandbox_id: str
    sandbox: Any
    container_id: str = ""
    config: Any = None
    adjustment: Adjustment | None = None
    host_pid: int = 0
    start_error: str = ""
    #: Mount points of the broker directory in the container (from the host),
    #: once started and once the loops ran on.
    broker_at_start: tuple[str, ...] = ()
    broker_at: tuple[str, ...] = ()
    stdout: str = ""
    exit_code: int | None = None

    def lines(self, key: str) -> list[str]:
        return [line.partition(" ")[2] for line in self.stdout.splitlines()
                if line.partition(" ")[0] == key]


def broker_mountpoints(host_pid: int, broker_dir: Path) -> tuple[str, ...]:
    """
    Where the container of C{host_pid} has the broker directory mounted: its
    mountinfo's bind mounts whose root is the broker directory (same device,
    root path ending as the broker directory's does).
    """
    device = os.stat(broker_dir).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    found = []
    for line in Path(f"/proc/{host_pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[2] == wanted and (fields[3] == str(broker_dir)
                                    or fields[3].endswith("/" + "/".join(broker_dir.parts[-3:]))):
            found.append(fields[4])
    return tuple(found)


@contextmanager
def hami_node(gpu_node: GpuNode, daemon: Any, workdir: Path) -> Iterator[dict[str, Any]]:
    """
    The loops of a HAMi node on C{gpu_node}: the device plugin's chmod every
    L{CHMOD_EVERY} s, a UID 1000 tenant (L{nriwindow.TENANT}), and the window
    plugin at L{WINDOW_INDEX}.  Yields what they report (the tenant's counts
    once stopped, in C{"tenant"}; the window log's path, C{"windows"}).
    """
    lock_parent = gpu_node.node.lock_parent
    share = Path(tempfile.mkdtemp(prefix="hostpid-tenant-", dir=workdir))
    os.chmod(share, 0o755)
    rounds = share / "rounds"
    rounds.write_bytes(b"\0" * 8)
    os.chown(rounds, WORKLOAD_UID, WORKLOAD_UID)
    stop = share / "stop"
    report: dict[str, Any] = {"windows": share / "windows.log"}
    halt = threading.Event()

    def device_plugin() -> None:
        while not halt.wait(CHMOD_EVERY):
            os.chmod(lock_parent, 0o777)

    chmods = threading.Thread(target=device_plugin, daemon=True)
    tenant = subprocess.Popen(
        as_user_argv(WORKLOAD_UID, [sys.executable, "-c", nriwindow.TENANT, str(lock_parent),
                                    str(rounds), str(stop)]),
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(report["windows"], "wb") as window_log:
        assert daemon.nri_socket is not None
        window = subprocess.Popen(
            [sys.executable, str(Path(nriwindow.__file__)), str(daemon.nri_socket), WINDOW_INDEX,
             str(lock_parent), str(rounds)], env=subprocess_env(), stdout=window_log,
            stderr=subprocess.STDOUT)
    chmods.start()
    try:
        yield report
    finally:
        halt.set()
        chmods.join()
        stop.touch()
        out, err = tenant.communicate(timeout=60)
        window.terminate()
        window.wait(15)
        assert tenant.returncode == 0, err
        report["tenant"] = json.loads(out)


def windows(log: Path) -> dict[str, tuple[int, int]]:
    """The window plugin's windows by pod name: the tenant's rounds before and after."""
    found = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            window = json.loads(line)
            found[window["pod"]] = (window["before"], window["after"])
    return found


@pytest.mark.parametrize("daemon", [*NRI_CELLS, *OCI_CELLS], indirect=True)
def test_hami_node_chmod_loop_and_tenant_loop(
        request: pytest.FixtureRequest, daemon: Any, kubelet: Kubelet, gpu_node: GpuNode,
        plugin: Plugin) -> None:
    """
    A node whose device plugin makes the lock parent 0777 every 0.2 s, a UID
    1000 tenant renaming, removing and replacing C{<lock parent>/hostpid} in a
    loop (symlink to C{/etc}, file), and L{HAMI_CONTAINERS} GPU containers
    created meanwhile, each through a window (L{nriwindow}) in which the lock
    parent was made 0777 and the tenant finished a round after hostpid's
    answer and before the runtime's mount; then the loops run on while every
    container is up.  No container has the broker anywhere but at its own
    C{/tmp/vgpulock/hostpid}, none fails to start, none loses its broker
    mount, and each is served (its client gets its host PID).
    """
    started = time.monotonic()
    broker_dir = gpu_node.node.broker_dir
    held: list[Held] = []
    with hami_node(gpu_node, daemon, daemon.workdir) as report:
        def called() -> dict[str, tuple[int, int]]:
            # Only a call to the window plugin: where the tenant wins the window
            # (the old code), CRI-O fails the probe's creation, which is no matter here.
            with contextlib.suppress(Exception):
                probe(kubelet, gpu_node, "window-probe")
            return windows(report["windows"])

        # The window plugin is called once the runtime has synchronized it.
        wait_for(called, "the window plugin to be called", 30.0)
        try:
            for index in range(HAMI_CONTAINERS):
                pod = restricted_pod(f"hami-{index}")
                pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", HELD]
                sandbox_id, sandbox = kubelet.sandbox(pod)
                one = Held(pod["metadata"]["name"], sandbox_id, sandbox)
                held.append(one)
                try:
                    # CRI-O runs the OCI runtime's create at CreateContainer, containerd
                    # at StartContainer: a mount the runtime refuses fails either.
                    one.container_id, one.config = kubelet.create(pod, sandbox_id, sandbox,
                                                                  [gpu_node.allocation()])
                    one.adjustment = Adjustment.of(kubelet.spec(one.container_id))
                    kubelet.cri.runtime("StartContainer", container_id=one.container_id)
                    one.host_pid = wait_running_pid(kubelet, one.container_id)
                    one.broker_at_start = broker_mountpoints(one.host_pid, broker_dir)
                except Exception as error:  # noqa: BLE001 - a failed start is what is counted
                    one.start_error = str(error).splitlines()[0][:300]
            # The loops run on over every running container: one more window's worth.
            os.chmod(gpu_node.node.lock_parent, 0o777)
            before = nriwindow.rounds(str(report["windows"].parent / "rounds"))
            wait_for(lambda: nriwindow.rounds(str(report["windows"].parent / "rounds"))
                     >= before + 2, "the tenant to finish a round after the last start", 30.0)
            for one in held:
                if one.host_pid:
                    one.broker_at = broker_mountpoints(one.host_pid, broker_dir)
                    Path(f"/proc/{one.host_pid}/root{GO_FILE}").touch()
        finally:
            for one in held:
                if one.host_pid:
                    with contextlib.suppress(Exception):
                        one.exit_code = wait_exited(kubelet.cri, one.container_id).status.exit_code
                if one.container_id:
                    with contextlib.suppress(Exception):
                        kubelet.remove(one.container_id)
                        one.stdout = read_cri_log(
                            Path(one.sandbox.log_directory) / one.config.log_path)[0]
                kubelet.remove_sandbox(one.sandbox_id)
    seen = windows(report["windows"])
    acted = [one.pod for one in held if seen.get(one.pod, (0, 0))[1] >= seen[one.pod][0] + 2]
    canonical = (defaults.CONTAINER_BROKER_DIRECTORY,)
    over_own_files = [(one.pod, one.broker_at_start) for one in held
                      if set(one.broker_at_start + one.broker_at) - set(canonical)
                      or one.lines("etc-socket") == ["yes"]]
    failed = [(one.pod, one.start_error) for one in held if one.start_error]
    adjusted_ones = [one for one in held if one.adjustment == adjusted(gpu_node.node)]
    # Started with the broker where it belongs, and without it once the loops ran on.
    lost = [one.pod for one in adjusted_ones if one.broker_at_start == canonical and (
        one.broker_at != canonical or one.lines("socket") != ["present"])]
    served = [one.pod for one in adjusted_ones
              if one.exit_code == 0 and one.lines("socket") == ["present"]
              and one.lines("etc-image") == ["yes"]]
    print(f"\n[hami] {request.node.callspec.id}: "
          f"{len(held)} containers, windows the tenant acted in {len(acted)}, "
          f"broker over their own files {len(over_own_files)}, failed to start {len(failed)}, "
          f"broker mounts lost after start {len(lost)}, served {len(served)}; "
          f"tenant {report['tenant']}; {time.monotonic() - started:.1f} s")
    assert len(acted) == HAMI_CONTAINERS, (seen, [one.pod for one in held])
    assert over_own_files == [], over_own_files
    assert failed == [], failed
    assert lost == [], lost
    assert report["tenant"]["renamed_root_dir"] == 0, report["tenant"]
    assert len(served) == HAMI_CONTAINERS, [(one.pod, one.adjustment, one.stdout)
                                            for one in held if one.pod not in served]
