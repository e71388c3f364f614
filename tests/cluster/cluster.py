"""
A real single-node Kubernetes for the cluster tier: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and a kubelet on containerd 2.1 with
NRI on (L{crilib.Containerd}, the CRI tests' harness), every part started
from the cache (L{components}) and torn down at the end.

Where each part listens, and why:

- etcd and the API server on loopback (the API server's clients, the
  kubeconfig of the tests and of Helm, connect to C{127.0.0.1}); the
  controllers' and the scheduler's own HTTPS ports on loopback too.
- The pods' network is a bridge of this run's (L{BRIDGE}, C{10.239.0.0/24},
  no masquerade, no route off the machine) made by Debian's CNI C{bridge}
  and C{host-local}.  Its gateway address is the node's address: the
  kubelet refuses a loopback node IP, so the kubelet listens there (the API
  server's C{exec}/C{logs} reach it), and the API server advertises it.
- The API server reaches a webhook's Service with its endpoint routing
  (C{--enable-aggregator-routing}: C{cmd/kube-apiserver/app/server.go}
  C{buildServiceResolver} gives the admission webhooks the same resolver as
  the aggregator, C{NewEndpointServiceResolver}: the Service's ready
  endpoints from its EndpointSlices, dialled directly, the certificate
  checked for C{SERVICE.NAMESPACE.svc}).  It is still the Service that is
  called, not an address: no ready endpoint, no call.  kube-proxy was the
  other way; it would program the shared host network namespace's
  iptables/nftables for every Service, on a machine other work shares.
- Pods reach the API server where the kubelet tells them it is
  (C{KUBERNETES_SERVICE_HOST}/C{PORT}: the C{kubernetes} Service,
  L{SERVICE_IP}:443) through Twisted's port forwarder (C{twistd
  portforward}, one TCP relay, the TLS end to end): L{SERVICE_IP} is an
  address of the run's bridge, so a pod's packets to it reach the node
  through the route the CNI gives pods to the Service range alone (no
  default route: still no route off the machine), and no iptables or
  nftables rule of the shared host network namespace changes.  The API server's certificate names
  L{SERVICE_IP}, so a pod verifies it with its service account's CA (the
  admission webhook's claim reads, C{webhook.deviceClasses}).
- The kubelet's device plugin directory is fixed at
  C{/var/lib/kubelet/device-plugins} (the API's C{KubeletSocket}; the
  kubelet ignores C{--root-dir} for it), so it is the one path outside the
  run's directory: made if absent and removed if this run made it; a
  kubelet socket already there (another kubelet) fails the start.

Everything else (certificates, etcd's data, the kubelet's root and pod
logs, containerd's state, the CNI's address leases, the cgroup root) lives
under one temporary directory or a cgroup named for the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import components
import yaml
from pki import Pki
from support import release_immutable, wait_for

#: The pods' bridge, its range and the node's address on it.
BRIDGE = "hpidbr0"
POD_SUBNET = "10.239.0.0/24"
NODE_IP = "10.239.0.1"
SERVICE_RANGE = "10.239.128.0/24"
SERVICE_IP = "10.239.128.1"
NODE_NAME = "hostpid-node"
#: The label the chart's default nodeSelector wants (gpu: "on").
NODE_LABELS = "gpu=on"

START_TIMEOUT = 180.0

#: The node's OCI runtime, a L{crilib.RUNTIMES} cell's: runc 1.5.3, which
#: makes idmapped mounts, so that user-namespaced pods run.
RUNC_CELL = "runc15"


def runc_binary() -> str:
    """The node's runc (built into the cache once, L{builds.RUNC})."""
    import crilib

    return crilib.RUNTIMES[RUNC_CELL].oci_binary()

#: The file naming the process (PID and start time) that owns a run's directory.
OWNER = "owner"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def network() -> dict[str, Any]:
    """The pods' CNI network: a bridge with its gateway on the node, host-local addresses."""
    return {
        "cniVersion": "0.4.0", "name": "hostpid-cluster",
        "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
            "hairpinMode": False,
            # No default route (no route off the machine); the Service
            # range's through the node, where the kubernetes Service's
            # address is served (the module docstring).
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET,
                                                         "gateway": NODE_IP}]],
                     "routes": [{"dst": SERVICE_RANGE}]},
        }],
    }


def kubeconfig(server: str, ca: Path, cert: Path, key: Path) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "hostpid", "cluster": {"server": server,
                                                     "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": {"client-certificate": str(cert),
                                            "client-key": str(key)}}],
        "contexts": [{"name": "hostpid", "context": {"cluster": "hostpid", "user": "user"}}],
        "current-context": "hostpid",
    })


@attrs.define
class Process:
    """One component: its command line, its log, its process."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = attrs.Factory(dict)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", **self.env}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.process.returncode}:\n"
                                 f"{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Cluster:
    """The running node: start with L{start}, stop with L{close}."""

    def __init__(self, cri_image: Path, cri_messages: ModuleType,
                 version: str = components.KUBERNETES_VERSION) -> None:
        self.version = version
        self.cri_image = cri_image
        self.cri_messages = cri_messages
        self.workdir = Path(tempfile.mkdtemp(prefix="hostpid-cluster-", dir="/tmp"))
        os.chmod(self.workdir, 0o711)
        self.processes: dict[str, Process] = {}
        self.containerd: Any = None
        self._made: list[Path] = []
        self._bridge_made = False
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.versions: Mapping[str, str] = {}
        self.closed = False
        (self.workdir / OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")

    # -- start ---------------------------------------------------------------

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import crilib

        reap_stale(current=self.workdir)
        self.bin = components.kubernetes(self.version) / "bin"
        etcd_bin = components.etcd() / "usr" / "bin" / "etcd"
        self.versions = components.versions(self.bin, etcd_bin)
        for name, text in self.versions.items():
            print(f"cluster component {name}: {text}")
        self._claim_device_plugin_dir()
        pki = Pki(self.workdir / "pki")
        self.pki = pki
        service_account = pki.service_account_key()
        apiserver_port, etcd_port, peer_port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{apiserver_port}"

        def identity(name: str, cn: str, *groups: str) -> Path:
            pair = pki.issue(name, cn, groups, client=True)
            path = self.workdir / f"{name}.kubeconfig"
            path.write_text(kubeconfig(self.server, pki.ca.cert, pair.cert, pair.key))
            return path

        admin = identity("admin", "hostpid-admin", "system:masters")
        assert admin == self.kubeconfig
        controllers = identity("controller-manager", "system:kube-controller-manager")
        scheduler = identity("scheduler", "system:kube-scheduler")
        kubelet = identity("kubelet", f"system:node:{NODE_NAME}", "system:nodes")
        serving = pki.issue("apiserver", "kube-apiserver",
                            dns=("localhost", "kubernetes", "kubernetes.default",
                                 "kubernetes.default.svc",
                                 "kubernetes.default.svc.cluster.local"),
                            ips=("127.0.0.1", SERVICE_IP, NODE_IP), server=True)
        kubelet_client = pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                   ("system:masters",), client=True)
        kubelet_serving = pki.issue("kubelet-serving", NODE_NAME, dns=(NODE_NAME,),
                                    ips=(NODE_IP,), server=True)

        etcd_dir = self.workdir / "etcd"
        self._add("etcd", [
            str(etcd_bin), "--name", "hostpid", "--data-dir", str(etcd_dir),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"hostpid=http://127.0.0.1:{peer_port}",
            # A test cluster: durability is not the question, speed is.
            "--unsafe-no-fsync"])
        self._add("kube-apiserver", [
            str(self.bin / "kube-apiserver"),
            "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address", "127.0.0.1", "--secure-port", str(apiserver_port),
            "--advertise-address", NODE_IP,
            "--tls-cert-file", str(serving.cert), "--tls-private-key-file", str(serving.key),
            "--client-ca-file", str(pki.ca.cert),
            "--service-account-key-file", str(service_account.cert),
            "--service-account-signing-key-file", str(service_account.key),
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-cluster-ip-range", SERVICE_RANGE,
            "--authorization-mode", "Node,RBAC",
            # PodSecurity, MutatingAdmissionWebhook and the rest are on by default.
            "--enable-admission-plugins", "NodeRestriction",
            "--allow-privileged=true",
            "--kubelet-client-certificate", str(kubelet_client.cert),
            "--kubelet-client-key", str(kubelet_client.key),
            "--kubelet-certificate-authority", str(pki.ca.cert),
            "--kubelet-preferred-address-types", "InternalIP",
            "--enable-aggregator-routing=true",
            "--cert-dir", str(self.workdir / "apiserver"),
            "--profiling=false"])
        self._wait_apiserver()
        self._add("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"),
            "--kubeconfig", str(controllers),
            "--authentication-kubeconfig", str(controllers),
            "--authorization-kubeconfig", str(controllers),
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--service-account-private-key-file", str(service_account.key),
            "--root-ca-file", str(pki.ca.cert),
            "--use-service-account-credentials=true",
            "--leader-elect=false",
            "--cert-dir", str(self.workdir / "controller-manager"),
            "--profiling=false"])
        self._add("kube-scheduler", [
            str(self.bin / "kube-scheduler"),
            "--kubeconfig", str(scheduler),
            "--authentication-kubeconfig", str(scheduler),
            "--authorization-kubeconfig", str(scheduler),
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--leader-elect=false", "--profiling=false"])
        self._make_bridge()
        # The API server at SERVICE_IP:443 for pods (the module docstring).
        # Its log file names the run's directory in its command line, as every
        # other component's arguments do, so that reap_stale finds it after a
        # killed run (it holds SERVICE_IP:443, which the next run needs).
        self._add("apiserver-forward", [
            sys.executable, "-m", "twisted",
            f"--log-file={self.workdir / 'apiserver-forward.twist.log'}", "portforward",
            "--port", f"tcp:443:interface={SERVICE_IP}", "--host", "127.0.0.1",
            "--dest_port", str(apiserver_port)])
        self._make_node_root()
        package = crilib.unpacked_containerd(crilib.RELEASES["2.1"].suite)
        containerd_dir = self.workdir / "containerd"
        containerd_dir.mkdir(mode=0o711)
        # runc 1.5.3 (built, L{crilib.RUNTIMES}C{["runc15"]}), not the
        # host's 1.1.5: a C{hostUsers: false} pod needs a runtime whose
        # C{runc features} reports idmapped mounts, or containerd reports no
        # user-namespace support for the handler (containerd 2.1
        # C{internal/cri/server/service.go} C{supportsCRIUserns}: the "user"
        # namespace and C{mountExtensions.idmap.enabled}) and the kubelet
        # refuses the pod (C{pkg/kubelet/userns} C{GetOrCreateUserNamespaceMappings}).
        self.containerd = crilib.Containerd(
            containerd_dir, package, self.cri_image, self.cri_messages,
            crilib.RELEASES["2.1"].config_version, nri=True, network=network(),
            cni_plugins=("bridge", "host-local"), runc=runc_binary())
        (self.workdir / "cgroup-root").write_text(self.containerd.cgroup_parent)
        self._prepare_cgroup_root(self.containerd.cgroup_parent)
        self.kubelet_root = self.workdir / "kubelet"
        self.kubelet_root.mkdir(mode=0o711)
        config = self.workdir / "kubelet-config.yaml"
        config.write_text(yaml.safe_dump(self.kubelet_config(kubelet_serving)))
        self.kubelet_kubeconfig = kubelet
        self._add("kubelet", [
            str(self.bin / "kubelet"), "--config", str(config),
            "--kubeconfig", str(kubelet), "--root-dir", str(self.kubelet_root),
            "--hostname-override", NODE_NAME, "--node-ip", NODE_IP,
            "--node-labels", NODE_LABELS, "--cert-dir", str(self.workdir / "kubelet-pki"),
            "--v", "2"])
        self.wait_node_ready()

    def kubelet_config(self, serving: Any) -> dict[str, Any]:
        """
        The kubelet's KubeletConfiguration: cgroupfs as containerd's runc
        (this machine has cgroup v1, which a 1.35+ kubelet refuses unless
        told otherwise: C{failCgroupV1}), no swap check, everything private.
        """
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": NODE_IP, "port": free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
            "tlsCertFile": str(serving.cert), "tlsPrivateKeyFile": str(serving.key),
            "authentication": {"x509": {"clientCAFile": str(self.pki.ca.cert)},
                               "webhook": {"enabled": True},
                               "anonymous": {"enabled": False}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{self.containerd.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.containerd.cgroup_parent,
            "failCgroupV1": False,
            "failSwapOn": False,
            "podLogsDir": str(self.workdir / "pod-logs"),
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "resolvConf": "",
            "clusterDomain": "cluster.local",
            "maxPods": 110,
            "protectKernelDefaults": False,
        }

    def _add(self, name: str, argv: list[str]) -> Process:
        process = Process(name, argv, self.workdir / f"{name}.log")
        self.processes[name] = process
        process.start()
        return process

    def _wait_apiserver(self) -> None:
        def ready() -> bool:
            for name in ("etcd", "kube-apiserver"):
                self.processes[name].check()
            result = self.kubectl_run("get", "--raw", "/readyz")
            return result.returncode == 0
        wait_for(ready, "the API server's /readyz", START_TIMEOUT)

    def wait_node_ready(self, timeout: float = START_TIMEOUT) -> None:
        def ready() -> bool:
            for process in self.processes.values():
                process.check()
            result = self.kubectl_run("get", "node", NODE_NAME, "-o", "json")
            if result.returncode != 0:
                return False
            node = json.loads(result.stdout)
            return any(c["type"] == "Ready" and c["status"] == "True"
                       for c in node.get("status", {}).get("conditions", []))
        wait_for(ready, f"node {NODE_NAME} to be Ready", timeout)

    def _claim_device_plugin_dir(self) -> None:
        from deviceplugin import DEVICE_PLUGIN_DIR, KUBELET_SOCKET

        if KUBELET_SOCKET.exists():
            raise AssertionError(f"{KUBELET_SOCKET} exists: another kubelet runs on this "
                                 "machine; the cluster tier needs the device plugin directory")
        missing = []
        for path in (DEVICE_PLUGIN_DIR, *DEVICE_PLUGIN_DIR.parents):
            if path.exists():
                break
            missing.append(path)
        DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        self._made = list(missing)  # deepest first
        # For reap_stale, should this run end before its teardown.
        (self.workdir / "made").write_text("".join(f"{path}\n" for path in missing))

    def _make_bridge(self) -> None:
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
            raise AssertionError(f"a link named {BRIDGE} exists already (another run?)")
        for argv in (["ip", "link", "add", BRIDGE, "type", "bridge"],
                     ["ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE],
                     ["ip", "addr", "add", f"{SERVICE_IP}/32", "dev", BRIDGE],
                     ["ip", "link", "set", BRIDGE, "up"]):
            subprocess.run(argv, check=True, capture_output=True)
            self._bridge_made = True

    def _make_node_root(self) -> None:
        """
        The directory the node's host paths live in (the chart's broker
        directory, lock parent): a shared mount, as every path is on a
        systemd node (systemd makes C{/} shared at boot).  This machine's
        C{/} is private, and there containerd refuses the NRI DaemonSet's
        C{mountPropagation: HostToContainer} volume ("path ... is mounted on
        / but it is not a shared or slave mount",
        containerd 2.1 C{internal/cri/opts/spec_linux_opts.go} C{ensureSharedOrSlave}).
        """
        self.node_root = self.workdir / "node"
        self.node_root.mkdir(mode=0o755)
        subprocess.run(["mount", "--bind", str(self.node_root), str(self.node_root)],
                       check=True, capture_output=True)
        subprocess.run(["mount", "--make-rshared", str(self.node_root)], check=True,
                       capture_output=True)

    @staticmethod
    def _prepare_cgroup_root(parent: str) -> None:
        """
        The kubelet's C{cgroupRoot} must exist in every hierarchy
        (C{cm/container_manager_linux.go}: "invalid configuration:
        cgroup-root ... doesn't exist"); cpuset's needs its CPUs and memory
        nodes copied from its parent before anything can join it.
        """
        root = Path("/sys/fs/cgroup")
        for hierarchy in root.iterdir():
            if not (hierarchy / "cgroup.procs").exists():
                continue
            directory = hierarchy / parent.lstrip("/")
            directory.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (directory / name).exists() and not (directory / name).read_text().strip():
                    (directory / name).write_text((hierarchy / name).read_text())

    # -- use -----------------------------------------------------------------

    def kubectl_run(self, *args: str, input: str | None = None,
                    timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin / "kubectl"), "--kubeconfig", str(self.kubeconfig),
                               *args], capture_output=True, text=True, input=input,
                              timeout=timeout, check=False)

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120.0) -> str:
        result = self.kubectl_run(*args, input=input, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stderr}")
        return result.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, *objects: Mapping[str, Any]) -> str:
        return self.kubectl("apply", "-f", "-", input="\n---\n".join(
            json.dumps(o) for o in objects))

    def create(self, obj: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
        """C{kubectl create}; the caller reads a refusal from the result."""
        return self.kubectl_run("create", "-f", "-", input=json.dumps(obj))

    def namespace(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        """A namespace, and its default service account (pods need it to be admitted)."""
        self.apply({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": name, "labels": dict(labels or {})}})
        wait_for(lambda: self.kubectl_run("-n", name, "get", "serviceaccount",
                                          "default").returncode == 0,
                 f"namespace {name}'s default service account", 60.0)

    def import_image(self, archive: Path) -> None:
        """An image archive (OCI layout or docker-archive) into the CRI's namespace."""
        self.containerd.ctr("images", "import", "--platform", "linux/amd64", str(archive))

    def restart_node(self) -> None:
        """Stop the kubelet and containerd (SIGTERM), start containerd then the kubelet."""
        kubelet = self.processes["kubelet"]
        kubelet.stop()
        self.containerd.restart()
        kubelet.start()
        self.wait_node_ready()

    # -- stop ----------------------------------------------------------------

    def close(self) -> None:
        """Stop everything, unmount, remove (once: a second call does nothing)."""
        if self.closed:
            return
        self.closed = True
        kubelet = self.processes.pop("kubelet", None)
        if kubelet is not None:
            kubelet.stop()
        if self.containerd is not None:
            # Its close deletes what runs, kills the shims and unmounts the
            # pods' network namespaces: each veth goes with its namespace.
            self.containerd.close()
        for name in reversed(list(self.processes)):
            self.processes[name].stop()
        for point in sorted(_mountpoints_under(self.workdir), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", BRIDGE], check=False, capture_output=True)
        from deviceplugin import DEVICE_PLUGIN_DIR

        if self._made:
            shutil.rmtree(DEVICE_PLUGIN_DIR, ignore_errors=True)
            for path in self._made[1:]:
                try:
                    path.rmdir()
                except OSError:
                    pass
        # The node's lock parent (release.Paths, under node/tmp) holds a prepared
        # broker mountpoint, immutable: released first, or rm cannot remove it
        # and the work directory stays.
        release_immutable(self.workdir / "node" / "tmp")
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(self.workdir)],
                       check=False, timeout=120)


def _mountpoints_under(directory: Path) -> list[str]:
    from crilib import _mountpoints_under as under

    return under(directory)


def wait_pods(cluster: Cluster, namespace: str, selector: str, count: int,
              timeout: float = 180.0) -> list[Any]:
    """The pods matching C{selector} once C{count} of them are Ready."""
    def ready() -> list[Any] | None:
        pods = cluster.get("pods", "-n", namespace, "-l", selector)["items"]
        good = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in p.get("status", {}).get("conditions", []))]
        return good if len(good) >= count else None
    result = wait_for(ready, f"{count} ready pods {selector} in {namespace}", timeout)
    return list(result)  # type: ignore[call-overload]


def elapsed(since: float) -> float:
    return time.monotonic() - since


def iter_logs(cluster: Cluster) -> Iterator[tuple[str, str]]:
    for name, process in cluster.processes.items():
        yield name, process.tail(80)


def _start_time(pid: int) -> str:
    """A process's start time (C{/proc/PID/stat} field 22): with its PID, its identity."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(workdir: Path) -> bool:
    try:
        pid, started = (workdir / OWNER).read_text().split()
        return _start_time(int(pid)) == started
    except (OSError, ValueError):
        return False


def reap_stale(root: Path = Path("/tmp"), current: Path | None = None) -> list[Path]:
    """
    Tear down what a run killed before its teardown left (the per-test cap
    ends the process with C{os._exit}): for each of this tier's directories
    whose owner is gone, its components and containers are killed, its
    mounts unmounted, its directory removed, and the bridge and device
    plugin directory it made are removed.  A live run's directory is left
    alone (C{current}: the calling run's own).
    """
    from deviceplugin import DEVICE_PLUGIN_DIR, KUBELET_SOCKET

    reaped = []
    stale_made: list[Path] = []
    for workdir in sorted(root.glob("hostpid-cluster-*")):
        if not (workdir / OWNER).is_file() or _owner_alive(workdir):
            continue
        marker = str(workdir)
        runc_root = workdir / "containerd" / "runc" / "k8s.io"
        runc = runc_binary()
        for container_id in os.listdir(runc_root) if runc_root.is_dir() and runc else []:
            subprocess.run([str(runc), "--root", str(runc_root), "delete", "--force",
                            container_id], capture_output=True, timeout=60, check=False)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _pids_naming(marker):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:
                wait_for(lambda marker=marker: not _pids_naming(marker),  # type: ignore[misc]
                         f"{marker}'s processes to exit", 15.0)
                break
            except AssertionError:
                continue
        cgroup = workdir / "cgroup-root"
        made = workdir / "made"
        made_paths = made.read_text().split() if made.is_file() else []
        for point in sorted(_mountpoints_under(workdir), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        if cgroup.is_file():
            _remove_cgroup_tree(cgroup.read_text().strip())
        release_immutable(workdir / "node" / "tmp")  # as close() does
        subprocess.run(["rm", "-rf", "--one-file-system", "--", marker], check=False,
                       timeout=120)
        reaped.append(workdir)
        stale_made.extend(Path(p) for p in made_paths)
    if reaped:
        if not any(_owner_alive(w) for w in root.glob("hostpid-cluster-*") if w != current):
            subprocess.run(["ip", "link", "del", BRIDGE], check=False, capture_output=True)
            if KUBELET_SOCKET.exists() or KUBELET_SOCKET.is_symlink():
                shutil.rmtree(DEVICE_PLUGIN_DIR, ignore_errors=True)
            for path in stale_made:  # what a stale run made, deepest first, if empty
                try:
                    path.rmdir()
                except OSError:
                    pass
        print(f"cluster: reaped the stale runs {[str(w) for w in reaped]}")
    return reaped


def _pids_naming(marker: str) -> list[int]:
    from crilib import _pids_naming as naming

    return naming(marker)


def _remove_cgroup_tree(parent: str) -> None:
    from crilib import remove_cgroups

    remove_cgroups(parent)
