"""
GPU workload pods on the cluster, and what each saw.

A workload pod runs the NRI test's script (L{test_nri_containerd.SCRIPT}:
it prints its PID in its namespace, the gate, the broker mounts, its UID,
whether the GPU node and the socket are there, then waits for a go-ahead
file in its own root filesystem and execs the C contract client).  The
test reads the container's host PID from containerd (CRI
C{ContainerStatus}, as C{crictl inspect} does), checks it against the
host's C{/proc} (C{NSpid}: that host PID is PID 1 of the container's
namespace), writes the go-ahead through C{/proc/PID/root}, and reads the
client's answer with C{kubectl logs} (the API server asks the kubelet).
The client execs in place of the script, so the answer must be that very
host PID.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from cluster import Cluster
from crilib import IMAGE as TEST_IMAGE
from deviceplugin import DevicePlugin
from support import wait_for
from test_nri_containerd import GO_FILE, SCRIPT, WORKLOAD_UID, script_answer, script_facts

GPU = "nvidia.com/gpu"


def _kubernetes_script(script: str) -> str:
    """
    The NRI test's script as a pod's command: any GPU node counts (the
    device plugin hands out C{/dev/nvidiaN} for the N the kubelet chose,
    not always 0), and C{$$} written C{$$$$}, because the kubelet expands
    C{$(VAR)} in a command and turns C{$$} into C{$} (C{pkg/kubelet/container}
    C{ExpandContainerCommandOnlyStatic}, C{third_party/forked/golang/expansion}):
    the script would print C{$} as its PID.
    """
    found = script.replace("[ -c /dev/nvidia0 ]", "ls /dev/nvidia[0-9]* >/dev/null 2>&1")
    assert found != script
    return found.replace("$$", "$$$$")


C_SCRIPT = _kubernetes_script(SCRIPT)
#: The script with the project's Python client in place of the C one.
PYTHON_SCRIPT = C_SCRIPT.replace("exec /bin/hostpid_client", "exec hostpid query")
assert PYTHON_SCRIPT != C_SCRIPT


def pod(namespace: str, prefix: str, *, gpu: bool = True, image: str = TEST_IMAGE,
        script: str = C_SCRIPT, labels: Mapping[str, str] | None = None,
        restricted: bool = True, host_users: bool | None = None) -> dict[str, Any]:
    """
    A pod Pod Security C{restricted} admits: non-root (UID 1000), no
    privilege escalation, every capability dropped, the runtime's seccomp
    profile, no volume; one GPU when C{gpu}.
    """
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    container: dict[str, Any] = {
        "name": "work", "image": image, "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", script],
        "resources": {"limits": {GPU: "1"}} if gpu else {},
    }
    if restricted:
        container["securityContext"] = {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}, "runAsUser": WORKLOAD_UID,
            "runAsGroup": WORKLOAD_UID, "runAsNonRoot": True}
    spec: dict[str, Any] = {
        "restartPolicy": "Never", "containers": [container],
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
    }
    if host_users is not None:
        spec["hostUsers"] = host_users
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app": "hostpid-cluster-test", **(labels or {})}},
            "spec": spec}


@attrs.frozen
class Run:
    """What one workload pod saw."""

    name: str
    host_pid: int
    nspid: tuple[int, ...]
    phase: str
    exit_code: int
    stdout: str
    pod: Mapping[str, Any]

    def facts(self) -> dict[str, str]:
        return script_facts(self.stdout)

    def answer(self) -> tuple[int, ...] | None:
        return script_answer(self.stdout)


def container_pid(kube: Cluster, namespace: str, name: str, timeout: float = 120.0) -> int:
    """
    The host PID containerd reports (CRI C{ContainerStatus}, verbose) for
    the pod's running container, named by the pod's status.
    """
    client = kube.containerd.client

    def pid() -> int:
        status = kube.get("pod", "-n", namespace, name)["status"]
        states = status.get("containerStatuses") or [{}]
        if "running" not in states[0].get("state", {}):
            assert status.get("phase") in ("Pending", "Running"), status
            return 0
        container_id = states[0]["containerID"].split("://", 1)[1]
        response = client.runtime("ContainerStatus", container_id=container_id, verbose=True)
        return int(json.loads(response.info["info"]).get("pid", 0))
    return int(wait_for(pid, f"pod {namespace}/{name}'s container to run", timeout))  # type: ignore[call-overload]


def nspid(host_pid: int) -> tuple[int, ...]:
    """The host's C{/proc/PID/status} C{NSpid}: the PID in each nested namespace."""
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return tuple(int(n) for n in line.split()[1:])
    raise AssertionError(f"/proc/{host_pid}/status has no NSpid line")


def start(kube: Cluster, manifest: Mapping[str, Any]) -> None:
    created = kube.create(manifest)
    assert created.returncode == 0, created.stderr


def finish(kube: Cluster, manifest: Mapping[str, Any], timeout: float = 120.0) -> Run:
    """Let a started workload go on (the go-ahead), then read what it printed."""
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    host_pid = container_pid(kube, namespace, name, timeout)
    namespaces = nspid(host_pid)
    Path(f"/proc/{host_pid}/root{GO_FILE}").touch()

    def done() -> Any:
        current = kube.get("pod", "-n", namespace, name)
        return current if current["status"].get("phase") in ("Succeeded", "Failed") else None
    current = wait_for(done, f"pod {namespace}/{name} to finish", timeout)
    assert isinstance(current, dict)
    (state,) = current["status"]["containerStatuses"]
    stdout = kube.kubectl("logs", "-n", namespace, name)
    run = Run(name, host_pid, namespaces, current["status"]["phase"],
              state["state"]["terminated"]["exitCode"], stdout, current)
    print(f"\n[cluster] {namespace}/{name}: phase={run.phase} exit={run.exit_code} "
          f"host_pid={host_pid} NSpid={namespaces} answer={run.answer()} facts={run.facts()}")
    return run


def run(kube: Cluster, manifest: Mapping[str, Any], timeout: float = 120.0) -> Run:
    start(kube, manifest)
    return finish(kube, manifest, timeout)


def _workload_processes(uids: Mapping[str, str]) -> dict[str, int]:
    """
    Host PIDs of the workload containers' init (C{/bin/sh -c SCRIPT}, PID 1
    in its namespace) of the pods whose UIDs are given, found in the host's
    C{/proc}: the pod's cgroup (C{.../pod<UID>/...}, the kubelet's cgroupfs
    naming) and C{NSpid}; the sandbox's init (the image's C{sleep}) is not
    one.
    """
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroup = (entry / "cgroup").read_text()
            if "/pod" not in cgroup:
                continue
            uid = next((u for u in uids if f"/pod{u}/" in cgroup), None)
            if uid is None:
                continue
            if not (entry / "cmdline").read_bytes().startswith(b"/bin/sh\0-c\0"):
                continue
            if nspid(int(entry.name))[1:] == (1,):
                found[uid] = int(entry.name)
        except (OSError, AssertionError):
            continue
    return found


def release_each(uids: Mapping[str, str], timeout: float = 300.0) -> dict[str, int]:
    """
    Each pod's workload, found in the host's C{/proc} as soon as it runs,
    given its go-ahead at once; their host PIDs by pod name.
    """
    released: dict[str, int] = {}

    def all_released() -> bool:
        for uid, pid in _workload_processes(uids).items():
            if uids[uid] not in released:
                try:
                    Path(f"/proc/{pid}/root{GO_FILE}").touch()
                except OSError:
                    continue
                released[uids[uid]] = pid
        return len(released) == len(uids)
    wait_for(all_released, f"{len(uids)} workloads to start", timeout)
    return released


def mount_options(host_pid: int, mount_point: str) -> tuple[str, ...]:
    """
    The per-mount options (C{/proc/PID/mountinfo}'s sixth field, read from
    the host) of the container's mount at C{mount_point}, the topmost if
    several: C{idmapped} is there when the mount carries an idmapping
    (C{show_mnt_opts}, C{fs/proc_namespace.c}: C{is_idmapped_mnt}).
    """
    found: tuple[str, ...] | None = None
    for line in Path(f"/proc/{host_pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == mount_point:
            found = tuple(fields[5].split(","))
    assert found is not None, f"no mount at {mount_point} in /proc/{host_pid}/mountinfo"
    return found


def uid_map(host_pid: int) -> tuple[int, int, int]:
    """The container's one C{uid_map} line (inside, outside, length), read from the host."""
    (line,) = Path(f"/proc/{host_pid}/uid_map").read_text().splitlines()
    inside, outside, length = (int(n) for n in line.split())
    return inside, outside, length


def restore_session_gpus(kube: Cluster, gpus: DevicePlugin) -> None:
    """
    After a test's own device plugin stopped: the session's plugin
    registers again, and the node shows all its GPUs allocatable.
    """
    gpus._register()
    wait_for(lambda: kube.get("node", "hostpid-node")["status"]["allocatable"]
             .get("nvidia.com/gpu") == str(len(gpus.devices)),
             "the session plugin's GPUs again", 60.0)
