"""
The NRI plugin with the real runtime: each CRI runtime of the matrix
(L{crilib.RUNTIMES}: trixie's containerd 1.7.24 with NRI enabled in its
configuration, forky's 2.1.9 and 2.4.2 built from its module where NRI is on
by default, CRI-O 1.34.0 built from its module, NRI on by default), driven
over CRI as the kubelet drives it (L{kubeletlib}), with
C{twistd hostpid-nri} connected to containerd's (private) NRI socket and a
real broker (C{twistd hostpid-broker}) on a private node.

The GPU pod is one a Pod Security C{restricted} namespace admits: no
volumes at all (so no C{hostPath}), its own network, PID and IPC
namespaces, a non-root user, no privilege escalation.  Its GPU is what a
stock device plugin's C{ContainerAllocateResponse} gives: a device node (a
character device made with C{mknod} in the private node, bound at
C{/dev/nvidia0}) and C{NVIDIA_VISIBLE_DEVICES}, folded into the CRI
CreateContainer request as the kubelet folds it.  (Namespace labels never
reach the runtime: Pod Security is enforced by the API server on the pod
spec, which is what L{assert_restricted} checks here.)

Cases, on each runtime of L{NRI_CELLS} (ids C{containerd17},
C{containerd21}, C{containerd24}, C{crio}; C{-k crio} selects one), the GPU
pod also with runc 1.5 under containerd 2.4 (C{runc15}): the GPU pod gets
the mounts and the gate from the plugin and its own host PID from the
broker; a non-GPU container, and a pod that writes the gate or
C{NVIDIA_VISIBLE_DEVICES} into its own spec without an allocation, get
nothing; with the plugin stopped (gone, or hung past the runtime's 2 s
request timeout) containers are still created; after the runtime restarts
the plugin is back and the next container is adjusted; 50 containers
created at once are all adjusted.

Run with C{pytest -s} to see each pod's facts and times.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import kubeletlib
import pytest
from crilib import (
    IMAGE,
    Containerd,
    Containerds,
    read_cri_log,
    wait_exited,
)
from criolib import Crio
from kernelfeatures import kernel_feature
from support import (
    TWISTD,
    BrokerProcess,
    nspid,
    running_broker,
    subprocess_env,
    wait_for,
)
from test_runc import Node, private_node

from hostpid import defaults
from hostpid.gate import GATE_ENV

#: A CRI runtime under test: containerd or CRI-O, the same interface.
Runtime = Containerd | Crio

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = [pytest.mark.privileged, kernel_feature("immutable_tmp")]

WORKLOAD_UID = 1000

#: Where the container waits for the test's go-ahead: in its own root
#: filesystem (the image's /tmp), which the test reaches through
#: C{/proc/PID/root} once it has read the container's host PID; the pod
#: needs no volume for it.
GO_FILE = "/tmp/e2e-go"

#: NVIDIA's device major (C{/proc/devices}: 195 nvidia-frontend): the fake
#: GPU node is never opened, only bound into the container by the runtime.
NVIDIA_MAJOR = 195

SCRIPT = (
    'echo "ns-pid $$"; '
    'echo "gate ${' + GATE_ENV + '-unset}"; '
    'echo "broker-mounts $(grep -c " /tmp/vgpulock/hostpid " /proc/self/mountinfo)"; '
    'echo "uid $(id -u)"; '
    'if [ -c /dev/nvidia0 ]; then echo "gpu present"; else echo "gpu absent"; fi; '
    'if [ -S /tmp/vgpulock/hostpid/broker.sock ]; then echo "socket present"; '
    'else echo "socket absent"; fi; '
    f"i=0; while [ ! -e {GO_FILE} ]; do "
    "i=$((i+1)); [ $i -gt 1200 ] && exit 3; sleep 0.05; done; "
    "exec /bin/hostpid_client"
)


@attrs.frozen
class GpuNode:
    """A private node: broker directory, lock parent, a fake GPU device node, a broker."""

    node: Node
    device: Path
    broker: BrokerProcess

    def allocation(self) -> dict[str, Any]:
        """A stock device plugin's C{ContainerAllocateResponse} for one GPU (JSON names)."""
        return {"envs": {"NVIDIA_VISIBLE_DEVICES": "0"},
                "devices": [{"containerPath": "/dev/nvidia0", "hostPath": str(self.device),
                             "permissions": "rw"}]}


#: The runtimes the whole NRI set runs on (L{crilib.RUNTIMES} ids; select
#: one with C{-k containerd24}).  The other OCI runtimes run the GPU pod
#: only (L{OCI_CELLS}): what the plugin adjusts is the CRI runtime's, the
#: OCI runtime only has to carry it out.
NRI_CELLS = ["containerd17", "containerd21", "containerd24", "crio"]

#: The same GPU pod with a newer OCI runtime: runc 1.5 under containerd 2.4
#: (CRI-O runs it in L{NRI_CELLS} already).
OCI_CELLS = ["runc15"]


@pytest.fixture(scope="module", params=NRI_CELLS)
def daemon(request: pytest.FixtureRequest, containerds: Containerds) -> Runtime:
    return containerds.runtime(request.param)


@pytest.fixture
def gpu_node() -> Iterator[GpuNode]:
    """
    The node as the broker leaves it: C{--cdi-dir} makes the broker prepare
    the lock parent and its C{hostpid} mountpoint at start (the layout
    C{docs/operations.md} gives), which the plugin's mounts need; the broker
    directory is the broker's own.
    """
    with private_node() as node, gpu_on(node) as gpu:
        yield gpu


@contextmanager
def gpu_on(node: Node) -> Iterator[GpuNode]:
    """C{node} with a fake GPU device node and a broker (C{--cdi-dir}) running on it."""
    home = node.broker_dir.parent.parent
    device = home / "dev" / "nvidia0"
    device.parent.mkdir(mode=0o755)
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, 0))
    with running_broker(node.broker_dir, "--lock-parent", str(node.lock_parent),
                        "--cdi-dir", str(home / "cdi")) as broker:
        yield GpuNode(node, device, broker)


class Plugin:
    """C{twistd hostpid-nri} on the daemon's NRI socket, for the node's paths."""

    def __init__(self, daemon: Runtime, node: Node, log: Path,
                 options: Sequence[str] = (), wrapper: Sequence[str] = ()) -> None:
        """@param wrapper: a command that execs the plugin's argv it is given after its own."""
        assert daemon.nri_socket is not None
        self.argv = [*wrapper, *TWISTD, "--nodaemon", "--pidfile=", "hostpid-nri",
                     "--nri-socket", str(daemon.nri_socket),
                     "--lock-parent", str(node.lock_parent),
                     "--broker-dir", str(node.broker_dir), *options]
        self.log_path = log
        self.log = open(log, "ab")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            self.argv, env=subprocess_env({GATE_ENV: "1"}), stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class Kubelet:
    """The kubelet's CRI calls for one-container pods, on one containerd."""

    def __init__(self, daemon: Runtime, userns_base: int | None = None) -> None:
        self.daemon = daemon
        #: Run every pod with C{hostUsers: false}, its mapping from this host ID.
        self.userns_base = userns_base
        self.cri = daemon.client
        self.pb = daemon.client.pb
        self.pods_root = daemon.workdir / "kubelet-pods"
        self.pods_root.mkdir(exist_ok=True)

    def sandbox(self, pod: Mapping[str, Any]) -> tuple[str, Any]:
        sandbox = kubeletlib.sandbox_config(
            self.pb, pod, self.daemon.log_dir,
            f"{self.daemon.cgroup_parent}/pod{pod['metadata']['uid']}")
        Path(sandbox.log_directory).mkdir(mode=0o755, parents=True, exist_ok=True)
        if self.userns_base is not None:
            kubeletlib.apply_user_namespace(self.pb, sandbox, self.userns_base)
        sandbox_id = self.cri.runtime("RunPodSandbox", config=sandbox).pod_sandbox_id
        return sandbox_id, sandbox

    def remove_sandbox(self, sandbox_id: str) -> None:
        self.cri.runtime("StopPodSandbox", pod_sandbox_id=sandbox_id)
        self.cri.runtime("RemovePodSandbox", pod_sandbox_id=sandbox_id)

    def create(self, pod: Mapping[str, Any], sandbox_id: str, sandbox: Any,
               allocations: Sequence[Mapping[str, Any]] = (), name: str = "workload"
               ) -> tuple[str, Any]:
        """CreateContainer for the pod's container (renamed C{name}); its id and config."""
        (container,) = pod["spec"]["containers"]
        container = {**container, "name": name}
        options = kubeletlib.container_options(pod, container,
                                               kubeletlib.device_options(allocations))
        container_dir = self.pods_root / pod["metadata"]["uid"] / "containers" / name
        container_dir.mkdir(parents=True, mode=0o750)
        termination_log = container_dir / uuid.uuid4().hex[:8]
        termination_log.touch()
        config = kubeletlib.container_config(self.pb, pod, container, options, IMAGE,
                                             termination_log)
        # The container's log directory: the kubelet makes it (kuberuntime_container.go
        # generateContainerConfig, MkdirAll(logDir)); CRI-O's conmon does not.
        (Path(sandbox.log_directory) / config.log_path).parent.mkdir(mode=0o755, exist_ok=True)
        if self.userns_base is not None:
            kubeletlib.apply_user_namespace(self.pb, config, self.userns_base)
        container_id = self.cri.runtime("CreateContainer", pod_sandbox_id=sandbox_id,
                                        config=config, sandbox_config=sandbox).container_id
        return container_id, config

    def spec(self, container_id: str) -> dict[str, Any]:
        """The OCI spec containerd created the container with (verbose ContainerStatus)."""
        response = self.cri.runtime("ContainerStatus", container_id=container_id, verbose=True)
        spec: dict[str, Any] = json.loads(response.info["info"])["runtimeSpec"]
        return spec

    def remove(self, container_id: str) -> None:
        self.cri.runtime("StopContainer", container_id=container_id, timeout=0)
        self.cri.runtime("RemoveContainer", container_id=container_id)

    @contextmanager
    def pod_sandbox(self, pod: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        sandbox_id, sandbox = self.sandbox(pod)
        try:
            yield sandbox_id, sandbox
        finally:
            self.remove_sandbox(sandbox_id)


@attrs.frozen
class Adjustment:
    """What of the plugin's adjustment a container's OCI spec carries."""

    mounts: tuple[tuple[str, str, bool], ...]
    gate: tuple[str, ...]

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> Adjustment:
        mounts = tuple((m["destination"], m.get("source", ""), "ro" in m.get("options", ()))
                       for m in spec.get("mounts", ())
                       if m["destination"] in (defaults.LOCK_PARENT,
                                               defaults.CONTAINER_BROKER_DIRECTORY))
        gate = tuple(e.partition("=")[2] for e in spec["process"].get("env", ())
                     if e.partition("=")[0] == GATE_ENV)
        return cls(mounts, gate)


def adjusted(node: Node) -> Adjustment:
    """The plugin's adjustment: the canonical mounts, in order, and the gate."""
    return Adjustment(((defaults.LOCK_PARENT, str(node.lock_parent), False),
                       (defaults.CONTAINER_BROKER_DIRECTORY, str(node.broker_dir), True)),
                      ("1",))


NOTHING = Adjustment((), ())


def restricted_pod(name: str, *, gpu: bool = True,
                   env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A pod a Pod Security C{restricted} namespace admits, running L{SCRIPT}."""
    pod = kubeletlib.gpu_pod(f"{name}-{uuid.uuid4().hex[:6]}", str(uuid.uuid4()),
                             resources=None if gpu else {},
                             command=["/bin/sh", "-c", SCRIPT], run_as_user=WORKLOAD_UID)
    pod["metadata"]["namespace"] = "gpu-restricted"
    pod["spec"]["hostNetwork"] = False
    pod["spec"]["securityContext"]["runAsNonRoot"] = True
    container = pod["spec"]["containers"][0]
    container["securityContext"]["capabilities"] = {"drop": ["ALL"]}
    container["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    assert_restricted(pod)
    return pod


def assert_restricted(pod: Mapping[str, Any]) -> None:
    """
    The Pod Security Standards' checks this pod could fail (C{baseline}:
    host namespaces, C{hostPath} volumes, privileged; C{restricted}:
    volume types, privilege escalation, non-root, capabilities, seccomp).
    """
    spec = pod["spec"]
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert not spec.get("volumes"), "no volume at all, hostPath least of all"
    assert spec["securityContext"]["runAsNonRoot"] is True
    for container in spec["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert not context.get("privileged")
        assert context["capabilities"]["drop"] == ["ALL"]
        assert context["seccompProfile"]["type"] == "RuntimeDefault"
        assert not container.get("volumeMounts")


def script_facts(stdout: str) -> dict[str, str]:
    """The facts L{SCRIPT} prints, one C{KEY VALUE} line each."""
    found = {}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("ns-pid", "gate", "broker-mounts", "uid", "gpu", "socket"):
            found[key] = value
    return found


def script_answer(stdout: str) -> tuple[int, ...] | None:
    """The client's answer L{SCRIPT} prints (one line of one or two numbers), or None."""
    lines = [line.split() for line in stdout.splitlines()]
    numbers = [tuple(int(n) for n in fields) for fields in lines
               if fields and len(fields) <= 2 and all(n.isdigit() for n in fields)]
    assert len(numbers) <= 1, stdout
    return numbers[0] if numbers else None


@attrs.frozen
class PodRun:
    name: str
    exit_code: int
    host_pid: int
    stdout: str
    stderr: str
    adjustment: Adjustment

    def facts(self) -> dict[str, str]:
        return script_facts(self.stdout)

    def lines(self, key: str) -> list[str]:
        """What follows C{key} on each line of the output that starts with it."""
        return [line.partition(" ")[2] for line in self.stdout.splitlines()
                if line.partition(" ")[0] == key]

    def answer(self) -> tuple[int, ...] | None:
        return script_answer(self.stdout)


def run_pod(kubelet: Kubelet, name: str, pod: Mapping[str, Any],
            allocations: Sequence[Mapping[str, Any]] = (),
            before_go: Callable[[int], object] | None = None) -> PodRun:
    """
    The kubelet's calls for one pod, its container run to its exit.  A
    failed StartContainer is the failure it is (raised), never retried.
    C{before_go(host_pid)} runs before the go-ahead (L{GO_FILE}) is written.
    """
    with kubelet.pod_sandbox(pod) as (sandbox_id, sandbox):
        container_id, config = kubelet.create(pod, sandbox_id, sandbox, allocations)
        try:
            adjustment = Adjustment.of(kubelet.spec(container_id))
            kubelet.cri.runtime("StartContainer", container_id=container_id)
            host_pid = wait_running_pid(kubelet, container_id)
            if before_go is not None:
                before_go(host_pid)
            # The go-ahead, written into the container's own root filesystem.
            Path(f"/proc/{host_pid}/root{GO_FILE}").touch()
            status = wait_exited(kubelet.cri, container_id)
        finally:
            kubelet.remove(container_id)
    stdout, stderr = read_cri_log(Path(sandbox.log_directory) / config.log_path)
    run = PodRun(name, status.status.exit_code, host_pid, stdout, stderr, adjustment)
    print(f"\n[nri] {name}: exit={run.exit_code} host_pid={host_pid} answer={run.answer()} "
          f"facts={run.facts()} adjustment={adjustment} stderr={stderr.strip()!r}")
    return run


def wait_running_pid(kubelet: Kubelet, container_id: str) -> int:
    def pid() -> int:
        response = kubelet.cri.runtime("ContainerStatus", container_id=container_id,
                                       verbose=True)
        assert response.status.state != kubelet.pb.CONTAINER_EXITED, response.status
        return int(json.loads(response.info["info"]).get("pid", 0))

    found = wait_for(pid, f"container {container_id}'s host PID")
    assert isinstance(found, int)
    assert nspid(found)[-1] == 1, nspid(found)
    return found


@pytest.fixture
def kubelet(daemon: Runtime) -> Kubelet:
    return Kubelet(daemon)


@pytest.fixture
def plugin(daemon: Runtime, gpu_node: GpuNode, kubelet: Kubelet) -> Iterator[Plugin]:
    """The plugin, connected: a GPU container created after this is adjusted."""
    with adjusting_plugin(daemon, gpu_node, kubelet) as started:
        yield started


@contextmanager
def adjusting_plugin(daemon: Runtime, gpu_node: GpuNode, kubelet: Kubelet,
                     options: Sequence[str] = ()) -> Iterator[Plugin]:
    """
    A plugin given C{options}, yielded once a GPU container is adjusted;
    stopped after, and its log must hold no traceback.
    """
    started = Plugin(daemon, gpu_node.node, daemon.workdir / f"plugin-{uuid.uuid4().hex[:6]}.log",
                     options)
    try:
        wait_adjusting(kubelet, gpu_node, started)
        yield started
    finally:
        started.stop()
    assert "Traceback" not in started.output(), started.output()


def probe(kubelet: Kubelet, gpu_node: GpuNode, name: str = "probe") -> Adjustment:
    """What a GPU container created now gets (created, inspected, removed; never started)."""
    pod = restricted_pod(name)
    with kubelet.pod_sandbox(pod) as (sandbox_id, sandbox):
        container_id, _ = kubelet.create(pod, sandbox_id, sandbox, [gpu_node.allocation()])
        try:
            return Adjustment.of(kubelet.spec(container_id))
        finally:
            kubelet.remove(container_id)


def wait_adjusting(kubelet: Kubelet, gpu_node: GpuNode, plugin: Plugin,
                   timeout: float = 30.0) -> float:
    """
    Wait until a GPU container is created adjusted (the plugin registered,
    configured and synchronized: the runtime calls it); the seconds it took.
    """
    started = time.monotonic()
    want = adjusted(gpu_node.node)

    def ready() -> bool:
        if plugin.process.poll() is not None:
            raise AssertionError(f"the plugin exited {plugin.process.returncode}:\n"
                                 f"{plugin.output()}")
        return probe(kubelet, gpu_node) == want

    wait_for(ready, "a GPU container adjusted by the plugin", timeout)
    return time.monotonic() - started


# -- the cases ----------------------------------------------------------------------------


def test_gpu_pod_gets_its_host_pid_without_hostpath(kubelet: Kubelet, gpu_node: GpuNode,
                                                    plugin: Plugin) -> None:
    """
    The restricted GPU pod: the plugin's mounts and gate, and the broker's
    answer is the host PID the runtime reports for the container's init
    (PID 1 in its own namespace, UID 1000).
    """
    assert_gpu_pod_gets_its_host_pid(kubelet, gpu_node, plugin)


@pytest.mark.parametrize("daemon", OCI_CELLS, indirect=True)
def test_gpu_pod_on_a_newer_oci_runtime(kubelet: Kubelet, gpu_node: GpuNode,
                                        plugin: Plugin) -> None:
    """The same GPU pod, with runc 1.5 as the OCI runtime (L{OCI_CELLS})."""
    assert_gpu_pod_gets_its_host_pid(kubelet, gpu_node, plugin)


def assert_gpu_pod_gets_its_host_pid(kubelet: Kubelet, gpu_node: GpuNode,
                                     plugin: Plugin) -> None:
    run = run_pod(kubelet, "gpu restricted", restricted_pod("gpu"), [gpu_node.allocation()])
    assert run.adjustment == adjusted(gpu_node.node)
    assert run.exit_code == 0, (run.stdout, run.stderr, plugin.output())
    assert run.facts() == {"ns-pid": "1", "gate": "1", "broker-mounts": "1",
                           "uid": str(WORKLOAD_UID), "gpu": "present",
                           "socket": "present"}, run.stdout
    assert run.answer() == (run.host_pid, 1)
    assert gpu_node.broker.pid != run.host_pid


def test_containers_without_an_allocation_get_nothing(kubelet: Kubelet, gpu_node: GpuNode,
                                                      plugin: Plugin) -> None:
    """
    A non-GPU container, and pods that write the gate or a GPU env into
    their own spec (no device plugin allocation), get no mount and no gate:
    the client stops at the gate.  The GPU container in the same run is
    adjusted, so the plugin is there.
    """
    forged = {GATE_ENV: "1", "NVIDIA_VISIBLE_DEVICES": "all"}
    runs = [
        run_pod(kubelet, "non-GPU", restricted_pod("cpu", gpu=False)),
        run_pod(kubelet, "forged gate and GPU env", restricted_pod("forged", env=forged)),
        run_pod(kubelet, "forged GPU env only",
                restricted_pod("forged-gpu", env={"NVIDIA_VISIBLE_DEVICES": "0"})),
    ]
    # No mount; the gate only as the pod itself wrote it (once, its own value).
    assert [run.adjustment for run in runs] == [NOTHING, Adjustment((), ("1",)), NOTHING]
    for run in runs:
        assert run.facts()["broker-mounts"] == "0" and run.facts()["socket"] == "absent"
        assert run.facts()["gpu"] == "absent"
        assert run.answer() is None
    assert runs[0].exit_code == 1 and runs[0].stderr.startswith("hostpid_client: gate: ")
    # The forged gate reaches the client, which then finds no broker.
    assert runs[1].facts()["gate"] == "1" and runs[1].exit_code != 0 and not runs[1].answer()
    assert probe(kubelet, gpu_node) == adjusted(gpu_node.node)


def test_containers_are_created_with_the_plugin_stopped(kubelet: Kubelet, gpu_node: GpuNode,
                                                        plugin: Plugin) -> None:
    """
    A hung plugin (SIGSTOP) is dropped by the runtime after its request
    timeout (2 s) and the container is created unadjusted; resumed, the
    plugin reconnects and adjusts again.  A plugin that is gone costs
    nothing: the container is created at once.
    """
    os.kill(plugin.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        hung = probe(kubelet, gpu_node, "hung")
        hung_seconds = time.monotonic() - started
    finally:
        os.kill(plugin.process.pid, signal.SIGCONT)
    assert hung == NOTHING
    assert hung_seconds < 15, hung_seconds
    back = wait_adjusting(kubelet, gpu_node, plugin)
    plugin.stop()
    started = time.monotonic()
    gone = probe(kubelet, gpu_node, "gone")
    gone_seconds = time.monotonic() - started
    assert gone == NOTHING
    print(f"\n[nri] hung plugin: created unadjusted in {hung_seconds:.2f}s; adjusting again "
          f"{back:.2f}s after SIGCONT; plugin gone: created in {gone_seconds:.2f}s")


def test_plugin_is_back_after_containerd_restarts(daemon: Runtime, kubelet: Kubelet,
                                                  gpu_node: GpuNode, plugin: Plugin) -> None:
    daemon.restart()
    seconds = wait_adjusting(kubelet, gpu_node, plugin)
    assert plugin.process.poll() is None
    print(f"\n[nri] containerd restarted: a GPU container adjusted again after {seconds:.2f}s")
    run = run_pod(kubelet, "gpu after restart", restricted_pod("gpu-after"),
                  [gpu_node.allocation()])
    assert run.exit_code == 0 and run.answer() == (run.host_pid, 1), (run.stdout, run.stderr)


CONCURRENT = 50


def test_fifty_containers_created_at_once_are_all_adjusted(
        kubelet: Kubelet, gpu_node: GpuNode, plugin: Plugin) -> None:
    """
    One sandbox, 50 GPU containers created by 50 concurrent CreateContainer
    calls (the kubelet starts pods in parallel): every one is adjusted, and
    the plugin's metrics-free log shows no error.
    """
    pod = restricted_pod("many")
    want = adjusted(gpu_node.node)
    with kubelet.pod_sandbox(pod) as (sandbox_id, sandbox):
        barrier = threading.Barrier(CONCURRENT)

        def create(index: int) -> tuple[str, float]:
            barrier.wait(30)
            started = time.monotonic()
            container_id, _ = kubelet.create(pod, sandbox_id, sandbox,
                                             [gpu_node.allocation()], name=f"c{index}")
            return container_id, time.monotonic() - started

        with ThreadPoolExecutor(CONCURRENT) as pool:
            created = list(pool.map(create, range(CONCURRENT)))
        try:
            got = [Adjustment.of(kubelet.spec(container_id)) for container_id, _ in created]
        finally:
            for container_id, _ in created:
                kubelet.cri.runtime("RemoveContainer", container_id=container_id)
    seconds = sorted(s for _, s in created)
    print(f"\n[nri] {CONCURRENT} concurrent CreateContainer: median {seconds[len(seconds)//2]:.3f}s"
          f" max {seconds[-1]:.3f}s")
    assert [g == want for g in got] == [True] * CONCURRENT, got


@pytest.fixture
def unprepared_node() -> Iterator[GpuNode]:
    """
    A broker started without C{--cdi-dir} (the chart's C{broker.cdi.enabled:
    false}): it makes its own directory and nothing else, so the lock
    parent does not exist on the host.
    """
    with private_node() as node:
        home = node.broker_dir.parent.parent
        device = home / "dev" / "nvidia0"
        device.parent.mkdir(mode=0o755)
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, 0))
        with running_broker(node.broker_dir) as broker:
            assert not node.lock_parent.exists()
            yield GpuNode(node, device, broker)


def test_gpu_pod_starts_when_the_lock_parent_is_missing(
        daemon: Runtime, kubelet: Kubelet, unprepared_node: GpuNode) -> None:
    """
    The plugin never fails a container: a mount whose source does not exist
    fails the container's start (runc: C{error mounting ... stat ...: no
    such file or directory}), so with the broker's directory present but
    the lock parent missing on the host (a broker without C{--cdi-dir}, or
    a cleaned C{/tmp}) the plugin leaves the container as it is: it starts,
    with its GPU and without the broker.  (A plugin that looked at the
    broker directory only failed this container's StartContainer.)
    """
    plugin = Plugin(daemon, unprepared_node.node,
                    daemon.workdir / f"plugin-{uuid.uuid4().hex[:6]}.log")
    try:
        wait_for(lambda: plugin_registered(daemon, plugin), "the plugin to register", 30.0)
        run = run_pod(kubelet, "gpu, lock parent missing", restricted_pod("nolock"),
                      [unprepared_node.allocation()])
    finally:
        plugin.stop()
    assert run.adjustment == NOTHING
    assert run.facts()["gpu"] == "present"
    assert run.exit_code == 1 and run.stderr.startswith("hostpid_client: gate: "), run.stderr


def plugin_registered(runtime: Runtime, plugin: Plugin) -> bool:
    """containerd's log names the plugin as connected (NRI's adaptation logs it)."""
    if plugin.process.poll() is not None:
        raise AssertionError(plugin.output())
    return f'plugin \\"{PLUGIN_NAME}\\" connected' in runtime.output() or (
        f'plugin "{PLUGIN_NAME}" connected' in runtime.output())


PLUGIN_NAME = "90-hostpid"
