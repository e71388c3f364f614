"""
CRI-O driven over its CRI gRPC API, beside L{crilib.Containerd} and with the
same interface, so the CRI and NRI tests run on either.

CRI-O is built from its module at a release (L{builds.CRIO}: C{crio},
C{pinns}, and its test tool C{copyimg}); C{conmon} and C{crun} are Debian's.
Nothing is installed: each L{Crio} has its own configuration, storage root
and run root, CRI socket, NRI socket, CNI configuration, CDI spec directory,
OCI runtime root, exit, attach and namespace directories, version files and
hooks directory under one temporary directory, and it reads no drop-in
directory of the host's (C{--config-dir} is a private, empty one).

The image: CRI-O has no C{ctr images import} and no registry is reachable
here, so L{crilib.write_image}'s OCI archive is copied into this CRI-O's own
containers-storage root with C{copyimg --import-from oci-archive:...}
(CRI-O's C{test/copyimg}, the tool its own integration tests use to seed
storage), before CRI-O starts; CRI-O then finds it by name
(C{ImageStatus}).  Pods run without an infra container (CRI-O's default
C{drop_infra_ctr = true}; no pod here shares a PID namespace), so the pause
image is never run.

Teardown: the containers left behind are deleted with the OCI runtime,
CRI-O is stopped, every C{conmon} that names this run's directory is
killed, what is mounted under the directory (overlay layers, namespace
pins, shm) is unmounted, and the directory and the pods' cgroups removed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from crilib import (
    CALL_TIMEOUT,
    IMAGE,
    CriClient,
    built,
    cri_version,
    kill_leftovers,
    remove_cgroups,
    remove_workdir,
    write_network,
)
from support import require_tool, wait_for

#: CRI-O's handler name for the default runtime here.  Its
#: C{allowed_annotations} are those of the handler CRI-O's own default
#: configuration has (L{default_config}: C{crun}'s, which allow
#: C{io.kubernetes.cri-o.Devices}), so the harness behaves as a stock CRI-O.
HANDLER = "hostpid"

#: A handler that allows no annotation (what an operator can configure;
#: a pod picks it with its runtime class, RunPodSandbox's C{runtime_handler}).
STRICT_HANDLER = "hostpid-strict"


def default_config(build: Path) -> dict[str, Any]:
    """
    CRI-O's own default configuration: C{crio config --default} of the
    built binary, with no configuration file or drop-in read, parsed.
    """
    result = subprocess.run(
        [str(build / "bin" / "crio"), "--config", "", "--config-dir", "", "config",
         "--default"], capture_output=True, timeout=CALL_TIMEOUT, check=False)
    assert result.returncode == 0, result.stderr
    parsed: dict[str, Any] = tomllib.loads(result.stdout.decode())
    return parsed


def default_handler(config: dict[str, Any]) -> dict[str, Any]:
    """The default runtime handler's table in a parsed C{crio config}."""
    runtime = config["crio"]["runtime"]
    handler: dict[str, Any] = runtime["runtimes"][runtime["default_runtime"]]
    return handler

#: Accept every image: the only one is the test's own, copied in locally.
POLICY = {"default": [{"type": "insecureAcceptAnything"}]}


def config_toml(workdir: Path, bin_dir: Path, oci: str, nri_socket: Path | None,
                allowed_annotations: list[str],
                allowed_devices: tuple[str, ...] = ("/dev/fuse", "/dev/net/tun")) -> str:
    """
    CRI-O's configuration (the tables C{crio config} prints): every path it
    would otherwise take under C{/var/lib}, C{/var/run}, C{/etc} or
    C{/var/log} is under C{workdir}; cgroupfs; the OCI runtime C{oci} with
    Debian's conmon; NRI as in L{crilib.nri_section} (on, with a private
    socket, plugin and drop-in directories, 2 s request timeout), or off.
    """
    nri = (f"""\
[crio.nri]
enable_nri = true
nri_listen = "{nri_socket}"
nri_plugin_dir = "{workdir / 'nri' / 'plugins'}"
nri_plugin_config_dir = "{workdir / 'nri' / 'conf.d'}"
nri_plugin_registration_timeout = "5s"
nri_plugin_request_timeout = "2s"
""" if nri_socket is not None else "[crio.nri]\nenable_nri = false\n")
    runtime_table = f"""\
runtime_path = "{oci}"
runtime_type = "oci"
runtime_root = "{workdir / 'oci'}"
monitor_path = "{require_tool('conmon')}"
monitor_cgroup = "pod"
"""
    return f"""\
[crio]
root = "{workdir / 'storage'}"
runroot = "{workdir / 'run'}"
storage_driver = "overlay"
log_dir = "{workdir / 'logs'}"
version_file = "{workdir / 'version'}"
version_file_persist = "{workdir / 'version-persist'}"
clean_shutdown_file = "{workdir / 'clean.shutdown'}"
internal_wipe = true
internal_repair = false

[crio.api]
listen = "{workdir / 'crio.sock'}"
stream_address = "127.0.0.1"
stream_port = "0"

[crio.runtime]
default_runtime = "{HANDLER}"
cgroup_manager = "cgroupfs"
selinux = false
container_exits_dir = "{workdir / 'exits'}"
container_attach_socket_dir = "{workdir / 'attach'}"
namespaces_dir = "{workdir / 'ns'}"
pinns_path = "{bin_dir / 'pinns'}"
hooks_dir = ["{workdir / 'hooks'}"]
cdi_spec_dirs = ["{workdir / 'cdi'}"]
decryption_keys_path = "{workdir / 'keys'}"
irqbalance_config_file = "{workdir / 'irqbalance'}"
irqbalance_config_restore_file = "disable"
allowed_devices = {json.dumps(list(allowed_devices))}
drop_infra_ctr = true
log_to_journald = false

[crio.runtime.runtimes.{HANDLER}]
{runtime_table}allowed_annotations = {json.dumps(allowed_annotations)}

[crio.runtime.runtimes.{STRICT_HANDLER}]
{runtime_table}allowed_annotations = []

[crio.image]
signature_policy = "{workdir / 'policy.json'}"
signature_policy_dir = "{workdir / 'policies'}"
pause_image = "{IMAGE}"
pause_command = "/bin/sleep"
global_auth_file = ""

[crio.network]
network_dir = "{workdir / 'cni' / 'net.d'}"
plugin_dirs = ["{workdir / 'cni' / 'bin'}"]

[crio.metrics]
enable_metrics = false

{nri}"""


class Crio:
    """One private CRI-O, started and torn down by the test (L{crilib.Containerd}'s interface)."""

    def __init__(self, workdir: Path, build: Path, image_tar: Path, messages: ModuleType,
                 oci: str, nri: bool = True,
                 allowed_devices: tuple[str, ...] = ("/dev/fuse", "/dev/net/tun")) -> None:
        self.workdir = workdir
        self.bin = build / "bin"
        self.socket = workdir / "crio.sock"
        self.nri_socket = workdir / "nri" / "nri.sock" if nri else None
        self.cdi_dir = workdir / "cdi"
        self.log_dir = workdir / "pods"
        self.cgroup_parent = f"/hostpid-cri-e2e-{uuid.uuid4().hex[:8]}"
        #: The OCI runtime (the name L{crilib.Containerd} gives it too).
        self.runc = oci
        for sub in ("cdi", "pods", "hooks", "keys", "policies", "conf.d", "nri/plugins",
                    "nri/conf.d", "logs"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        write_network(workdir / "cni")
        (workdir / "policy.json").write_text(json.dumps(POLICY))
        # containers/storage and containers/image read these instead of
        # /etc/containers' (CONTAINERS_STORAGE_CONF, CONTAINERS_REGISTRIES_CONF).
        (workdir / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{workdir / "storage"}"\n'
            f'runroot = "{workdir / "run"}"\n')
        (workdir / "registries.conf").write_text("unqualified-search-registries = []\n")
        #: CRI-O's own defaults (C{crio config --default}).
        self.defaults = default_config(build)
        (workdir / "crio.conf").write_text(config_toml(
            workdir, self.bin, oci, self.nri_socket,
            default_handler(self.defaults).get("allowed_annotations", []), allowed_devices))
        self.log = open(workdir / "crio.log", "ab")  # noqa: SIM115 (closed in close())
        self.client = CriClient(self.socket, messages)
        self.process: subprocess.Popen[bytes] | None = None
        try:
            self._import(image_tar)
            self.process = self._start()
            wait_for(self._answers, "CRI-O's CRI Version call", 120.0)
        except BaseException:
            self.close()
            raise

    def _import(self, image_tar: Path) -> None:
        """
        The test image into this CRI-O's storage, under L{IMAGE}.  containers/image
        keeps a blob-info cache, for root in C{/var/lib/containers/cache}
        (C{pkg/blobinfocache/default.go}), with no option in C{copyimg}: it
        runs in a mount namespace of its own with a tmpfs over C{/var/lib},
        so the host's is never written.
        """
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs hostpid-copyimg /var/lib && exec "$@"', "copyimg",
             str(self.bin / "copyimg"), "--root", str(self.workdir / "storage"),
             "--runroot", str(self.workdir / "run"), "--storage-driver", "overlay",
             "--signature-policy", str(self.workdir / "policy.json"),
             "--image-name", IMAGE, "--import-from", f"oci-archive:{image_tar}"],
            capture_output=True, text=True, timeout=CALL_TIMEOUT * 2, check=False)
        assert result.returncode == 0, (result.stdout, result.stderr)

    def argv(self) -> list[str]:
        """CRI-O's command line (C{HOSTPID_CRIO_LOG_LEVEL=debug} shows conmon's arguments)."""
        return [str(self.bin / "crio"), "--config", str(self.workdir / "crio.conf"),
                "--config-dir", str(self.workdir / "conf.d"),
                "--log-level", os.environ.get("HOSTPID_CRIO_LOG_LEVEL", "info")]

    def _start(self) -> subprocess.Popen[bytes]:
        env = {"PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               "CONTAINERS_REGISTRIES_CONF": str(self.workdir / "registries.conf"),
               "CONTAINERS_STORAGE_CONF": str(self.workdir / "storage.conf")}
        return subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=self.log,
                                stderr=subprocess.STDOUT, env=env, cwd=self.workdir)

    def _stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        """Stop CRI-O (SIGTERM) and start it again; conmon keeps the containers running."""
        self._stop()
        self.process = self._start()
        wait_for(self._answers, "CRI-O's CRI Version call after a restart", 120.0)

    def _answers(self) -> bool:
        assert self.process is not None
        version = cri_version("crio", self.process, self.socket, self.client, self.output)
        if version is None:
            return False
        self.version = version
        return True

    def output(self) -> str:
        return (self.workdir / "crio.log").read_text(errors="replace")

    def close(self) -> None:
        """Stop CRI-O and its conmons, unmount and remove what they left."""
        self.client.close()
        root = self.workdir / "oci"
        if root.is_dir():
            for container_id in os.listdir(root):
                if (root / container_id).is_dir():
                    subprocess.run([self.runc, "--root", str(root), "delete", "--force",
                                    container_id], capture_output=True, timeout=60,
                                   check=False)
        self._stop()
        self.log.close()
        # conmon is started with this run's paths (its exit directory) and outlives CRI-O.
        kill_leftovers(str(self.workdir), "conmons")
        remove_workdir(self.workdir)
        remove_cgroups(self.cgroup_parent)


@contextmanager
def running_crio(image_tar: Path, messages: ModuleType, oci: str, nri: bool = True,
                 allowed_devices: tuple[str, ...] = ("/dev/fuse", "/dev/net/tun")
                 ) -> Iterator[Crio]:
    build = built("crio")  # before the directory: a build that fails leaves none behind
    workdir = Path(tempfile.mkdtemp(prefix="hostpid-crio-", dir="/tmp"))
    os.chmod(workdir, 0o711)
    try:
        daemon = Crio(workdir, build, image_tar, messages, oci, nri, allowed_devices)
    except BaseException:
        # Crio cleans up once it has started anything; before that, only the directory.
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(workdir)], check=False,
                       timeout=120)
        raise
    try:
        yield daemon
    finally:
        daemon.close()
