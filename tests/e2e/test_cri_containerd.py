"""
End to end through containerd's CRI, as the kubelet drives it.

A private containerd 1.7 (trixie's, CDI enabled, L{crilib}) is driven over
its CRI gRPC API with the calls the kubelet makes to run a pod: ImageStatus,
RunPodSandbox, CreateContainer (with the sandbox config), StartContainer,
ContainerStatus, then StopContainer, RemoveContainer, StopPodSandbox and
RemovePodSandbox.  The PodSandboxConfig and ContainerConfig are built from a
Pod and device plugin allocation responses as the kubelet builds them
(L{kubeletlib}).  Sandboxes use the node's network, so no CNI is needed.

The container runs as UID 1000 in a PID namespace of its own; its command is
a shell that reports what the container sees (its PID, the gate, broker
mounts) and then execs the static C contract client as the container's init
process.  The client's answer must be the host PID containerd reports for
that process (ContainerStatus verbose info), and its own C{getpid()} 1.

Two paths, each with a real broker (C{twistd hostpid-broker}) on a private
broker directory and lock parent:

- the webhook's: a Pod patched by the webhook's decision (mode C{cdi} or
  C{mounts}), with a stock device plugin's allocation (an env only);
- the device plugin's: C{hostpid allocate}'s response (mounts, or
  C{cdiDevices} with C{--cdi}, or the annotation with C{--cdi-annotations}).

The webhook's mounts and the CDI paths also run on containerd 2.4 (with runc
1.1.5 and with runc 1.5.3) and on CRI-O 1.34 (L{CRI_CELLS}, test ids naming
the runtime); the rest on containerd 1.7.

Run with C{pytest -s} to see each pod's calls, host PIDs and times.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
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
from support import (
    hostpid_argv,
    nspid,
    running_broker,
    skip_or_fail,
    subprocess_env,
    wait_for,
)
from test_runc import Node, PythonLayout, allocate, private_node

from hostpid.broker.service import RECEIVE_DESCRIPTORS_ENV
from hostpid.gate import GATE_ENV

pytestmark = pytest.mark.privileged

BROKER_DEVICE = "hami.io/hostpid=broker"
WORKLOAD_UID = 1000

#: Where each test pod's one extra volume (its own, read-only) is mounted:
#: the test creates C{go} in it once it has read the container's host PID.
BARRIER = "/e2e-barrier"

#: The Python that runs these tests, as a container sees it when its pod binds
#: it (and the host's /usr) read-only (the runc test's layout).
PYTHON = PythonLayout.of_this_process()

#: The contract clients: the static C client in the image, or C{hostpid query}.
CLIENTS = {"c": "/bin/hostpid_client",
           "python": f"{shlex.quote(PYTHON.executable)} -m hostpid.cli query"}


def script(client: str) -> str:
    """
    The container's init: facts first, then (released by the test, within a
    bound) the client as the same process.
    """
    return (
        'echo "ns-pid $$"; '
        'echo "gate ${' + GATE_ENV + '-unset}"; '
        'echo "broker-mounts $(grep -c " /tmp/vgpulock/hostpid " /proc/self/mountinfo)"; '
        'echo "uid $(id -u)"; '
        'if [ -S /tmp/vgpulock/hostpid/broker.sock ]; then echo "socket present"; '
        'else echo "socket absent"; fi; '
        f"i=0; while [ ! -e {BARRIER}/go ]; do "
        "i=$((i+1)); [ $i -gt 1200 ] && exit 3; sleep 0.05; done; "
        f"exec {CLIENTS[client]}"
    )

#: What a stock device plugin's allocation gives a GPU container.
STOCK_ALLOCATION: dict[str, Any] = {"envs": {"NVIDIA_VISIBLE_DEVICES": "0"}}


@attrs.frozen
class PodRun:
    """One pod run to completion through the CRI."""

    name: str
    exit_code: int
    host_pid: int | None
    stdout: str
    stderr: str
    seconds: float
    sandbox_annotations: dict[str, str]
    container_annotations: dict[str, str]
    cdi_devices: tuple[str, ...]
    mounts: tuple[tuple[str, str, bool], ...]

    def facts(self) -> dict[str, str]:
        found = {}
        for line in self.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key in ("ns-pid", "gate", "broker-mounts", "uid", "socket"):
                found[key] = value
        return found

    def answer(self) -> tuple[int, ...] | None:
        """
        The client's answer line, if it printed one: C{HOSTPID GETPID} from
        the C client, C{HOSTPID} from C{hostpid query}.
        """
        lines = [line.split() for line in self.stdout.splitlines()]
        numbers = [tuple(int(n) for n in fields) for fields in lines
                   if fields and len(fields) <= 2 and all(n.isdigit() for n in fields)]
        assert len(numbers) <= 1, self.stdout
        return numbers[0] if numbers else None


class Kubelet:
    """Runs pods through a containerd's CRI the way the kubelet's runtime manager does."""

    def __init__(self, daemon: Containerd | Crio) -> None:
        self.daemon = daemon
        self.cri = daemon.client
        self.pb = daemon.client.pb
        self.pods_root = daemon.workdir / "kubelet-pods"
        self.pods_root.mkdir(exist_ok=True)

    def run(self, name: str, pod: Mapping[str, Any],
            allocations: Sequence[Mapping[str, Any]] = ()) -> PodRun:
        """
        Run the pod's one container to its exit; C{allocations} are the
        device plugin responses the device manager has for that container.
        """
        pb = self.pb
        (container,) = pod["spec"]["containers"]
        options = kubeletlib.container_options(pod, container,
                                               kubeletlib.device_options(allocations))
        sandbox = kubeletlib.sandbox_config(pb, pod, self.daemon.log_dir,
                                            f"{self.daemon.cgroup_parent}/pod{pod['metadata']['uid']}")
        # The kubelet's pod and container directories (kubelet_pods.go getPodContainerDir).
        container_dir = (self.pods_root / pod["metadata"]["uid"] / "containers"
                         / container["name"])
        container_dir.mkdir(parents=True, mode=0o750)
        termination_log = container_dir / uuid.uuid4().hex[:8]
        termination_log.touch()
        config = kubeletlib.container_config(pb, pod, container, options, IMAGE,
                                             termination_log)
        # createPodSandbox (kuberuntime_sandbox.go) makes the pod's log directory first.
        Path(sandbox.log_directory).mkdir(mode=0o755, parents=True)
        # And the container's (generateContainerConfig, MkdirAll(logDir)): CRI-O's
        # conmon does not make it.
        (Path(sandbox.log_directory) / config.log_path).parent.mkdir(mode=0o755)
        started = time.monotonic()
        # EnsureImageExists (kuberuntime_image.go): the image is present, no pull.
        assert self.cri.image("ImageStatus", image=pb.ImageSpec(image=IMAGE)).image.id
        sandbox_id = self.cri.runtime("RunPodSandbox", config=sandbox).pod_sandbox_id
        try:
            container_id = self.cri.runtime(
                "CreateContainer", pod_sandbox_id=sandbox_id, config=config,
                sandbox_config=sandbox).container_id
            try:
                self.cri.runtime("StartContainer", container_id=container_id)
                # The kubelet's view of the container's init: its host PID while it runs
                # (containerd reports 0 once it has exited).
                host_pid = wait_running_pid(self.cri, container_id)
                (barrier_dir(pod) / "go").touch()
                status = wait_exited(self.cri, container_id)
                seconds = time.monotonic() - started
            finally:
                self.cri.runtime("StopContainer", container_id=container_id, timeout=0)
                self.cri.runtime("RemoveContainer", container_id=container_id)
        finally:
            self.cri.runtime("StopPodSandbox", pod_sandbox_id=sandbox_id)
            self.cri.runtime("RemovePodSandbox", pod_sandbox_id=sandbox_id)
        stdout, stderr = read_cri_log(Path(sandbox.log_directory) / config.log_path)
        run = PodRun(
            name, status.status.exit_code, host_pid, stdout, stderr, seconds,
            dict(sandbox.annotations), dict(status.status.annotations),
            tuple(d.name for d in config.CDI_devices),
            tuple((m.container_path, m.host_path, m.readonly) for m in status.status.mounts),
        )
        print(f"\n[cri] {name}: exit={run.exit_code} host_pid={run.host_pid} "
              f"answer={run.answer()} seconds={seconds:.3f} facts={run.facts()} "
              f"cdi={run.cdi_devices} stderr={stderr.strip()!r}")
        return run


#: The runtimes the broker's paths that differ between runtimes run on
#: (the webhook's mounts, CDI from the kubelet's field and from a device
#: plugin's annotation): L{crilib.RUNTIMES} ids, C{-k crio} selects one.
#: The other cases run on containerd 1.7 only.
CRI_CELLS = ["containerd17", "containerd24", "runc15", "crio"]

#: Parametrize a test over L{CRI_CELLS}.
over_runtimes = pytest.mark.parametrize("kubelet", CRI_CELLS, indirect=True)


@pytest.fixture(scope="module", params=["containerd17"])
def kubelet(request: pytest.FixtureRequest, containerds: Containerds) -> Kubelet:
    """A session runtime (L{conftest}), shared with the NRI tests: containerd 1.7 unless told."""
    return Kubelet(containerds.runtime(request.param))


@pytest.fixture
def node() -> Iterator[Node]:
    with private_node() as made:
        yield made


def write_spec(kubelet: Kubelet, node: Node, gate: str = "1") -> None:
    """C{hostpid cdi} into containerd's (private) CDI spec directory."""
    env = subprocess_env()
    env[GATE_ENV] = gate
    result = subprocess.run(
        hostpid_argv("cdi", "--dir", str(kubelet.daemon.cdi_dir),
                     "--lock-parent", str(node.lock_parent), "--broker-dir", str(node.broker_dir)),
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def broker_env(mode: str) -> dict[str, str]:
    return subprocess_env({RECEIVE_DESCRIPTORS_ENV: "1"} if mode == "received" else {})


def barrier_dir(pod: Mapping[str, Any]) -> Path:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "e2e-0"]
    return Path(volume["hostPath"]["path"])


def wait_running_pid(cri: Any, container_id: str) -> int:
    """The running container's init PID on the host, from ContainerStatus' verbose info."""
    def pid() -> int:
        response = cri.runtime("ContainerStatus", container_id=container_id, verbose=True)
        assert response.status.state != cri.pb.CONTAINER_EXITED, response.status
        return int(json.loads(response.info["info"]).get("pid", 0))

    found = wait_for(pid, f"container {container_id}'s host PID")
    assert isinstance(found, int)
    # The same process seen from the host: PID 1 in the container's own PID namespace.
    assert nspid(found)[-1] == 1, nspid(found)
    return found


def new_pod(kubelet: Kubelet, name: str, client: str = "c", **kwargs: Any) -> dict[str, Any]:
    """
    A GPU pod of the test's image running L{script}, with its barrier volume;
    for the Python client, also read-only hostPath volumes of the host's
    C{/usr}, this Python and this working tree, and the env to use them.
    """
    uid = str(uuid.uuid4())
    pod = kubeletlib.gpu_pod(f"{name}-{uuid.uuid4().hex[:6]}", uid,
                             command=["/bin/sh", "-c", script(client)], **kwargs)
    barrier = kubelet.pods_root / uid / "barrier"
    barrier.mkdir(parents=True, mode=0o755)
    binds = [(str(barrier), BARRIER)]
    if client == "python":
        binds += [("/usr", "/usr"), *PYTHON.binds]
        pod["spec"]["containers"][0]["env"] = [
            {"name": "PYTHONPATH", "value": ":".join(PYTHON.pythonpath)},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
            {"name": "HOME", "value": "/"},
        ]
    pod["spec"]["volumes"] = [{"name": f"e2e-{index}", "hostPath": {"path": host}}
                              for index, (host, _) in enumerate(binds)]
    pod["spec"]["containers"][0]["volumeMounts"] = [
        {"name": f"e2e-{index}", "mountPath": inside, "readOnly": True}
        for index, (_, inside) in enumerate(binds)]
    return pod


def assert_host_pid_answered(run: PodRun) -> None:
    assert run.exit_code == 0, (run.stdout, run.stderr)
    assert run.facts() == {"ns-pid": "1", "gate": "1", "broker-mounts": "1",
                           "uid": str(WORKLOAD_UID), "socket": "present"}, run.stdout
    assert run.host_pid is not None and run.host_pid > 1
    # The broker's answer is the host PID; the C client's own getpid() is 1.
    assert run.answer() in ((run.host_pid, 1), (run.host_pid,)), (run.answer(), run.host_pid)


def assert_no_broker(run: PodRun) -> None:
    """The workload's fallback: no gate, no broker mount, the client stops at the gate."""
    assert run.facts() == {"ns-pid": "1", "gate": "unset", "broker-mounts": "0",
                           "uid": str(WORKLOAD_UID), "socket": "absent"}, run.stdout
    assert run.exit_code == 1
    assert run.answer() is None
    assert run.stderr.startswith("hostpid_client: gate: "), run.stderr


# -- the device plugin's path: hostpid allocate -------------------------------------------


@pytest.mark.parametrize("client", ["c", "python"])
@pytest.mark.parametrize("mode", ["refused", "received"])
def test_allocate_mounts_become_cri_mounts(kubelet: Kubelet, node: Node, mode: str,
                                           client: str) -> None:
    with running_broker(node.broker_dir, env=broker_env(mode)) as broker:
        mounts, envs, _ = allocate(node, "1", STOCK_ALLOCATION)
        response = {"envs": envs, "mounts": [
            {"containerPath": m.container_path, "hostPath": m.host_path,
             "readOnly": m.read_only} for m in mounts]}
        name = f"allocate mounts, broker {mode}, {client} client"
        run = kubelet.run(name, new_pod(kubelet, "alloc", client), [response])
        second = kubelet.run(f"{name}, again", new_pod(kubelet, "alloc", client), [response])
    assert_host_pid_answered(run)
    assert_host_pid_answered(second)
    assert second.host_pid != run.host_pid
    assert broker.pid not in (run.host_pid, second.host_pid)
    assert [m[0] for m in run.mounts[:2]] == ["/tmp/vgpulock", "/tmp/vgpulock/hostpid"]


def allocate_json(node: Node, gate: str, *flags: str) -> dict[str, Any]:
    env = subprocess_env()
    env[GATE_ENV] = gate
    result = subprocess.run(
        hostpid_argv("allocate", "--lock-parent", str(node.lock_parent),
                     "--broker-dir", str(node.broker_dir), *flags),
        input=json.dumps(STOCK_ALLOCATION), env=env, capture_output=True, text=True,
        timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    response: dict[str, Any] = json.loads(result.stdout)
    return response


@over_runtimes
@pytest.mark.parametrize("client", ["c", "python"])
def test_allocate_cdi_device_reaches_containerd(kubelet: Kubelet, node: Node,
                                                client: str) -> None:
    """C{hostpid allocate --cdi}: the kubelet's C{CDI_devices} field, containerd's CDI."""
    with running_broker(node.broker_dir):
        write_spec(kubelet, node)
        response = allocate_json(node, "1", "--cdi")
        assert response["cdiDevices"] == [{"name": BROKER_DEVICE}]
        run = kubelet.run(f"allocate --cdi, {client} client", new_pod(kubelet, "cdi", client),
                          [response])
    assert run.cdi_devices == (BROKER_DEVICE,)
    assert_host_pid_answered(run)


@over_runtimes
def test_allocate_cdi_annotation_reaches_containerd(kubelet: Kubelet, node: Node) -> None:
    """
    C{hostpid allocate --cdi --cdi-annotations} as a kubelet before 1.29
    sees it (no C{cdiDevices} field): the device plugin's annotation becomes
    a container annotation (C{newContainerAnnotations}), which containerd's
    C{WithCDI} reads.
    """
    with running_broker(node.broker_dir):
        write_spec(kubelet, node)
        response = allocate_json(node, "1", "--cdi", "--cdi-annotations")
        response.pop("cdiDevices")
        run = kubelet.run("allocate --cdi-annotations, no CDI_devices", new_pod(kubelet, "cdiann"),
                          [response])
    assert run.cdi_devices == ()
    assert run.container_annotations["cdi.k8s.io/hami.io.hostpid_broker"] == BROKER_DEVICE
    assert_host_pid_answered(run)


def test_allocate_gate_off_gives_no_broker(kubelet: Kubelet, node: Node) -> None:
    with running_broker(node.broker_dir):
        mounts, envs, _ = allocate(node, "0", STOCK_ALLOCATION)
        response = {"envs": envs, "mounts": [
            {"containerPath": m.container_path, "hostPath": m.host_path,
             "readOnly": m.read_only} for m in mounts]}
        run = kubelet.run("allocate, gate off", new_pod(kubelet, "off"), [response])
    assert_no_broker(run)


# -- the webhook's path: a patched Pod -----------------------------------------------------


def admitted(pod: dict[str, Any], node: Node, mode: str, gate: bool) -> dict[str, Any]:
    """
    The pod as the API server stores it after the mutating webhook: the
    webhook's own decision applied as a real JSON Patch.
    """
    try:
        from hostpid.admission.decision import Config, decide
    except ImportError as error:
        skip_or_fail(f"the webhook's decision (hostpid.admission.decision) is missing: {error}")
        raise AssertionError("unreachable") from error
    config = Config(resources=("nvidia.com/gpu",), mode=mode, gate=gate,
                    lock_parent=str(node.lock_parent), broker_dir=str(node.broker_dir))
    decision = decide(pod, config)
    patched: dict[str, Any] = jsonpatch.apply_patch(pod, list(decision.patch))
    print(f"\n[webhook] {mode} gate={gate}: {decision.outcome} {list(decision.patch)}")
    return patched


def prepare_node(node: Node) -> None:
    """What the broker's node setup does before any pod: the lock parent and mountpoint."""
    allocate(node, "1")


@over_runtimes
@pytest.mark.parametrize("client", ["c", "python"])
@pytest.mark.parametrize("mode", ["refused", "received"])
def test_webhook_mounts_mode_reaches_the_broker(kubelet: Kubelet, node: Node,
                                                mode: str, client: str) -> None:
    with running_broker(node.broker_dir, env=broker_env(mode)):
        prepare_node(node)
        pod = admitted(new_pod(kubelet, "wh-mounts", client), node, "mounts", gate=True)
        run = kubelet.run(f"webhook mounts, broker {mode}, {client} client", pod,
                          [STOCK_ALLOCATION])
    assert_host_pid_answered(run)


@over_runtimes
def test_webhook_cdi_annotation_stops_at_the_sandbox(kubelet: Kubelet, node: Node) -> None:
    """
    Mode C{cdi}: the pod annotation reaches the PodSandboxConfig and nothing
    else.  The kubelet gives a container only device plugin annotations and
    its own (C{newContainerAnnotations}), and containerd 1.7's CDI injection
    reads the container's annotations and C{CDI_devices} only
    (C{container_create_linux.go}: C{WithCDI(config.Annotations,
    config.CDIDevices)}).  So the broker device is never injected.  The
    control runs the same annotation as a device plugin's annotation: then
    containerd does inject it, with the same spec and broker.
    """
    with running_broker(node.broker_dir):
        write_spec(kubelet, node)
        pod = admitted(new_pod(kubelet, "wh-cdi"), node, "cdi", gate=True)
        ((key, value),) = [(k, v) for k, v in pod["metadata"]["annotations"].items()
                           if k.startswith("cdi.k8s.io/")]
        assert value == BROKER_DEVICE
        run = kubelet.run("webhook cdi (pod annotation)", pod, [STOCK_ALLOCATION])
        control = kubelet.run("control: the same annotation from a device plugin",
                              new_pod(kubelet, "wh-cdi-control"),
                              [{**STOCK_ALLOCATION, "annotations": {key: value}}])
    assert run.sandbox_annotations[key] == BROKER_DEVICE
    assert key not in run.container_annotations
    assert_no_broker(run)
    assert control.container_annotations[key] == BROKER_DEVICE
    assert_host_pid_answered(control)


@pytest.mark.parametrize("mode", ["cdi", "mounts"])
def test_webhook_gate_off_and_non_gpu_pods_get_no_broker(kubelet: Kubelet, node: Node,
                                                         mode: str) -> None:
    with running_broker(node.broker_dir):
        write_spec(kubelet, node)
        prepare_node(node)
        gpu, cpu = new_pod(kubelet, "wh-off"), new_pod(kubelet, "wh-cpu", resources={})
        off = admitted(gpu, node, mode, gate=False)
        plain = admitted(cpu, node, mode, gate=True)
        assert (off, plain) == (gpu, cpu), "neither pod is patched"
        runs = [kubelet.run(f"webhook {mode}, gate off", off, [STOCK_ALLOCATION]),
                kubelet.run(f"webhook {mode}, non-GPU pod", plain)]
    for run in runs:
        assert_no_broker(run)
