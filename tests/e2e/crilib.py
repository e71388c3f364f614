"""
containerd driven over its CRI gRPC API, for the CRI end-to-end test.

Debian bookworm's containerd is 1.6, whose CRI plugin has no CDI (its
C{enable_cdi} arrived in 1.7).  So the test runs trixie's containerd 1.7,
fetched the way the kernel matrix fetches kernels (L{kernels.debian}: a
private apt configuration for the other suite, C{apt-get download},
C{dpkg-deb -x}, cached) and run from where it was unpacked.  Nothing is
installed: each L{Containerd} has its own config, root, state directory,
gRPC socket, CDI spec directory and log directory under one temporary
directory, and runs the host's C{runc} (the podman and runc tests' runtime)
through the unpacked C{containerd-shim-runc-v2}.  Teardown kills containerd
and every shim started for its socket, unmounts what is left under the
directory and removes it, with the cgroups its containers' parent made.

The CRI client is generated at test time: C{grpc_tools.protoc} compiles the
subset of C{runtime.v1} in C{cri/runtime_v1.proto} into a temporary
directory, and each call is a plain unary gRPC call on a Unix socket, as the
kubelet's remote runtime service makes it.

The images come from no registry: L{write_image} builds an OCI image layout
tarball (one layer: Debian's static busybox and the static C contract client)
that C{ctr images import} loads into the C{k8s.io} namespace, the one the CRI
plugin uses.  The same image serves as the sandbox (C{sandbox_image}) image.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
from support import require_tool, skip_or_fail, wait_for

if TYPE_CHECKING:
    from criolib import Crio

PROTO = Path(__file__).resolve().parent / "cri" / "runtime_v1.proto"

#: The Debian suite and package: containerd 1.7 with CDI in its CRI plugin.
CONTAINERD_SUITE = "trixie"
CONTAINERD_PACKAGE = "containerd"


@attrs.frozen
class Release:
    """
    A containerd release line the tests run: the Debian suite that carries
    it and the configuration format it reads (1.7 reads version 2, where
    the CRI plugin is C{io.containerd.grpc.v1.cri}; 2.x reads version 3,
    where it is split into C{io.containerd.cri.v1.runtime} and
    C{io.containerd.cri.v1.images}, as C{containerd config default} of each
    prints).
    """

    name: str
    suite: str
    config_version: int
    #: The L{builds.BUILDS} entry it is built from, for a release no Debian
    #: suite ships (C{suite} is then empty).
    build: str = ""

    def package(self) -> Path:
        """Where its binaries are: C{usr/bin} of the unpacked package, or C{bin} of the build."""
        return built("containerd") if self.build else unpacked_containerd(self.suite)


#: trixie's 1.7.24 (NRI off unless configured), and forky's 2.1.9 (NRI on by
#: default; its binary needs glibc 2.34 and runs here beside bookworm's runc);
#: 2.4.2 built from its module (L{builds.CONTAINERD}), configuration version 3
#: as 2.1's.
RELEASES = {
    "1.7": Release("1.7", "trixie", 2),
    "2.1": Release("2.1", "forky", 3),
    "2.4": Release("2.4", "", 3, build="containerd"),
}


def built(name: str) -> Path:
    """
    The cache directory of L{builds.BUILDS}C{[name]}, built now if it is not
    there; skips (fails in CI) when it cannot be built here.
    """
    import builds

    try:
        return builds.obtain(builds.BUILDS[name])
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        skip_or_fail(f"{name} could not be built: {error}")
        raise AssertionError("unreachable") from error


@attrs.frozen
class Runtime:
    """
    One cell of the runtime matrix: a CRI runtime (C{daemon}: containerd at
    one of L{RELEASES}, or CRI-O) and the OCI runtime it runs containers
    with (C{oci}: Debian's C{runc}, the built C{runc15}, or Debian's
    C{crun}).  C{id} is the test id that names it (C{pytest -k ID}).
    """

    id: str
    daemon: str
    release: str
    oci: str

    def oci_binary(self) -> str:
        """The OCI runtime's executable."""
        if self.oci == "runc15":
            return str(built("runc") / "bin" / "runc")
        return os.path.realpath(require_tool(self.oci))

    def describe(self) -> str:
        return f"{self.daemon} {self.release} with {self.oci}"


#: The matrix.  Debian's runc is bookworm's 1.1.5 (no idmapped mounts);
#: C{runc15} is runc 1.5.3 built from its module (L{builds.RUNC}); CRI-O
#: 1.34.0 is built (L{builds.CRIO}) and runs with runc 1.5.3.  CRI-O with
#: bookworm's crun 1.8.1 (C{criocrun}) creates no container: CRI-O 1.34
#: writes runtime-spec 1.2.1, which crun 1.8.1 refuses ("unknown version
#: specified"; trixie's crun 1.21 needs glibc 2.38), as
#: C{test_crio.test_crio_with_bookworms_crun_creates_no_container} shows.
#: C{containerd21runc15} is the cluster tier's node (containerd 2.1 with
#: runc 1.5.3, tests/cluster/cluster.py), for the user-namespace tests.
RUNTIMES: dict[str, Runtime] = {r.id: r for r in (
    Runtime("containerd17", "containerd", "1.7", "runc"),
    Runtime("containerd21", "containerd", "2.1", "runc"),
    Runtime("containerd24", "containerd", "2.4", "runc"),
    Runtime("runc15", "containerd", "2.4", "runc15"),
    Runtime("containerd21runc15", "containerd", "2.1", "runc15"),
    Runtime("crio", "crio", "1.34", "runc15"),
    Runtime("criocrun", "crio", "1.34", "crun"),
)}

#: The cell each containerd release line is when a test names the release
#: only (L{Containerds.get}C{("2.1")}).
RELEASE_CELLS = {"1.7": "containerd17", "2.1": "containerd21", "2.4": "containerd24"}

#: The CRI plugin's containerd namespace.
K8S_NAMESPACE = "k8s.io"

#: The test image's name, fully qualified so the CRI plugin looks it up as is.
IMAGE = "hostpid.test/cri-e2e:1"

CALL_TIMEOUT = 60.0

SHIM_SOCKET_ROOT = Path("/run/containerd/s")

#: Debian's CNI plugins (containernetworking-plugins): its C{loopback}.
CNI_BIN = Path("/usr/lib/cni")

#: The pod network: a network namespace of the pod's own, with only its
#: loopback up.  A pod that must not use the node's network (Pod Security
#: C{baseline} and C{restricted} refuse C{hostNetwork}) runs with no route
#: anywhere, which is all the tests need.  containerd attaches its own
#: loopback network (Debian's CNI C{loopback} plugin) and then one more
#: configured network, from whose result it takes the pod's IP
#: (C{eth0}'s): L{NETWORK_PLUGIN} reports one and creates nothing, so a run
#: makes no interface, bridge or route on the node.
NETWORK = {"cniVersion": "0.4.0", "name": "hostpid-e2e",
           "plugins": [{"type": "hostpid-e2e-net"}]}

NETWORK_PLUGIN = """\
#!/bin/sh
# A CNI plugin that reports an address and creates nothing (tests only).
case "$CNI_COMMAND" in
  ADD) printf '{"cniVersion":"0.4.0","interfaces":[{"name":"eth0","sandbox":"%s"}],\
"ips":[{"version":"4","address":"192.0.2.2/32","interface":0}]}' "$CNI_NETNS" ;;
  VERSION) printf '{"cniVersion":"0.4.0","supportedVersions":["0.3.0","0.3.1","0.4.0"]}' ;;
esac
"""


def unpacked_package(suite: str, package: str) -> Path:
    """
    The directory C{suite}'s C{package} is unpacked in (fetched once,
    cached with the kernel matrix's packages); skips (fails in CI) when
    Debian's archive cannot be reached.
    """
    from kernels import debian

    try:
        apt = debian.PrivateApt.create(suite, debian.machine_source())
        apt.update()
        return debian.unpack(apt, package)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        skip_or_fail(f"{package} from {suite} could not be fetched: {error}")
        raise AssertionError("unreachable") from error


def unpacked_containerd(suite: str = CONTAINERD_SUITE) -> Path:
    """The directory C{suite}'s containerd package is unpacked in."""
    return unpacked_package(suite, CONTAINERD_PACKAGE)


def compile_messages(out_dir: Path) -> ModuleType:
    """The C{runtime_v1_pb2} module protoc makes from L{PROTO}, imported from C{out_dir}."""
    from grpc_tools import protoc

    status = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={out_dir}", str(PROTO)])
    if status != 0:
        raise AssertionError(f"protoc failed on {PROTO} ({status})")
    spec = importlib.util.spec_from_file_location("runtime_v1_pb2", out_dir / "runtime_v1_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["runtime_v1_pb2"] = module
    spec.loader.exec_module(module)
    return module


def grpc_module() -> ModuleType:
    """
    gRPC, with its fork support off.  The session's containerds keep a
    channel open, and with it gRPC's threads, while the rest of the suite
    runs; with fork support on, gRPC restarts its poller in every child
    this process forks, where a C{preexec_fn} that closes descriptors left
    it polling a closed epoll: the child aborted (SIGABRT, "epoll_wait
    error: Bad file descriptor") before it could exec the broker it was
    meant to be.  No child of the tests uses gRPC.
    """
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import grpc

    return grpc


class CriClient:
    """
    Unary calls on C{runtime.v1.RuntimeService} and C{ImageService}, as the
    kubelet's remote runtime makes them (gRPC over the runtime's Unix socket).
    """

    def __init__(self, socket_path: Path, messages: ModuleType) -> None:
        grpc = grpc_module()
        self.pb = messages
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")

    def call(self, service: str, method: str, request: Any,
             timeout: float = CALL_TIMEOUT) -> Any:
        response_type = getattr(self.pb, f"{method}Response")
        stub = self.channel.unary_unary(
            f"/runtime.v1.{service}/{method}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        return stub(request, timeout=timeout)

    def runtime(self, method: str, **fields: Any) -> Any:
        return self.call("RuntimeService", method, getattr(self.pb, f"{method}Request")(**fields))

    def image(self, method: str, **fields: Any) -> Any:
        return self.call("ImageService", method, getattr(self.pb, f"{method}Request")(**fields))

    def close(self) -> None:
        self.channel.close()


def _tar_entry(tar: tarfile.TarFile, name: str, kind: bytes, mode: int,
               data: bytes = b"", link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    info.mtime, info.uid, info.gid = 0, 0, 0
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


#: Busybox applets the containers' scripts use.
APPLETS = ("sh", "sleep", "grep", "cat", "echo", "ls", "id", "test")


#: A file of the image's own C{/etc}: whether a container sees its image's
#: C{/etc} does not depend on what a runtime adds there (containerd binds
#: C{/etc/hosts}, CRI-O leaves it to the kubelet).
IMAGE_ETC_MARKER = "/etc/hostpid-e2e-image"


def image_layer(busybox: Path, client: Path) -> bytes:
    """
    One uncompressed layer: busybox and its applets in /bin, the C client,
    L{IMAGE_ETC_MARKER}, /tmp, and an empty /usr with the merged-/usr links, for a pod that binds
    the host's /usr to run Python.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory, mode in (("bin", 0o755), ("dev", 0o755), ("proc", 0o755),
                                ("sys", 0o755), ("etc", 0o755), ("usr", 0o755),
                                ("tmp", 0o1777)):
            _tar_entry(tar, directory, tarfile.DIRTYPE, mode)
        for link in ("lib", "lib64"):
            _tar_entry(tar, link, tarfile.SYMTYPE, 0o777, link=f"usr/{link}")
        _tar_entry(tar, "bin/busybox", tarfile.REGTYPE, 0o755, busybox.read_bytes())
        for applet in APPLETS:
            _tar_entry(tar, f"bin/{applet}", tarfile.SYMTYPE, 0o777, link="busybox")
        _tar_entry(tar, "bin/hostpid_client", tarfile.REGTYPE, 0o755, client.read_bytes())
        _tar_entry(tar, IMAGE_ETC_MARKER.lstrip("/"), tarfile.REGTYPE, 0o644, b"image\n")
    return buffer.getvalue()


def write_image(path: Path, busybox: Path, client: Path, name: str = IMAGE) -> None:
    """
    An OCI image layout tarball (image-spec C{image-layout.md}) of one image
    named C{name} (the C{io.containerd.image.name} annotation, which C{ctr
    images import} takes as the image's name).  Its default command sleeps,
    as a sandbox's pause process does.
    """
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    layer = image_layer(busybox, client)
    layer_ref = blob(layer)
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sleep", "1000000"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_ref["digest"]]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **blob(json.dumps(config).encode())},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_ref}],
    }
    index = {
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            **blob(json.dumps(manifest).encode()),
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]},
        }],
    }
    with tarfile.open(path, "w") as tar:
        _tar_entry(tar, "oci-layout", tarfile.REGTYPE, 0o644,
                   json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _tar_entry(tar, "index.json", tarfile.REGTYPE, 0o644, json.dumps(index).encode())
        for digest, data in blobs.items():
            _tar_entry(tar, f"blobs/sha256/{digest.split(':', 1)[1]}", tarfile.REGTYPE,
                       0o644, data)


def nri_section(table: str, workdir: Path, nri_socket: Path | None) -> str:
    """
    The NRI plugin's table (C{pkg/nri/config.go} in containerd 1.7 and
    C{internal/nri/config.go} in 2.x: the same keys): on with C{nri_socket}
    as its socket, so that no run ever touches C{/var/run/nri}; its
    pre-launched plugin and drop-in directories private (and empty).  Off
    without a socket.
    """
    if nri_socket is None:
        return f"[{table}]\n  disable = true\n"
    return f"""\
[{table}]
  disable = false
  disable_connections = false
  socket_path = "{nri_socket}"
  plugin_path = "{workdir / 'nri' / 'plugins'}"
  plugin_config_path = "{workdir / 'nri' / 'conf.d'}"
  plugin_registration_timeout = "5s"
  plugin_request_timeout = "2s"
"""


def config_toml(workdir: Path, runc: str, config_version: int = 2,
                nri_socket: Path | None = None) -> str:
    """
    containerd's configuration: everything private to C{workdir}; the CRI
    plugin with CDI on, reading specs from C{workdir/cdi} only; the test
    image as the sandbox image; runc through the v2 shim, cgroupfs driver;
    NRI as L{nri_section} says.  The pod network is L{NETWORK}.
    """
    if config_version == 3:
        return config_toml_v3(workdir, runc, nri_socket)
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    nri = nri_section('plugins."io.containerd.nri.v1.nri"', workdir, nri_socket)
    return f"""\
version = 2
root = "{workdir / 'root'}"
state = "{workdir / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{workdir / 'containerd.sock'}"

[ttrpc]
  address = "{workdir / 'containerd.sock.ttrpc'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{workdir / 'opt'}"

[{cri}]
  sandbox_image = "{IMAGE}"
  enable_cdi = true
  cdi_spec_dirs = ["{workdir / 'cdi'}"]
  disable_apparmor = true
  enable_selinux = false
  # The sandbox's oom_score_adj (-998) clamped to containerd's own: this
  # machine (itself a container) does not let root lower it.
  restrict_oom_score_adj = true
  # A pod network's namespace is mounted under the state directory, not the
  # node's /var/run/netns, so that a run leaves nothing outside its own.
  netns_mounts_under_state_dir = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  Root = "{workdir / 'runc'}"
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{workdir / 'cni' / 'bin'}"
  conf_dir = "{workdir / 'cni' / 'net.d'}"

{nri}"""


def config_toml_v3(workdir: Path, runc: str, nri_socket: Path | None) -> str:
    """
    L{config_toml} in containerd 2.x's format (version 3, as its C{config
    default} prints it): the runtime half of the CRI plugin under
    C{io.containerd.cri.v1.runtime}, the sandbox image pinned under
    C{io.containerd.cri.v1.images}.
    """
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    images = "plugins.'io.containerd.cri.v1.images'"
    nri = nri_section("plugins.'io.containerd.nri.v1.nri'", workdir, nri_socket)
    return f"""\
version = 3
root = "{workdir / 'root'}"
state = "{workdir / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs",
                    "io.containerd.snapshotter.v1.blockfile", "io.containerd.differ.v1.erofs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{workdir / 'containerd.sock'}"

[ttrpc]
  address = "{workdir / 'containerd.sock.ttrpc'}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{workdir / 'opt'}"

[{images}]
  snapshotter = "overlayfs"

[{images}.pinned_images]
  sandbox = "{IMAGE}"

[{runtime}]
  enable_cdi = true
  cdi_spec_dirs = ["{workdir / 'cdi'}"]
  disable_apparmor = true
  enable_selinux = false
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true

[{runtime}.containerd]
  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{runtime}.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  Root = "{workdir / 'runc'}"
  SystemdCgroup = false

[{runtime}.cni]
  bin_dirs = ["{workdir / 'cni' / 'bin'}"]
  conf_dir = "{workdir / 'cni' / 'net.d'}"

{nri}"""


def write_network(cni: Path, network: dict[str, Any] | None = None,
                  cni_plugins: tuple[str, ...] = ()) -> None:
    """
    C{network} (L{NETWORK} unless told) and its plugin, with Debian's
    C{loopback} and C{cni_plugins}, under C{cni} (C{net.d}, C{bin}).
    """
    for sub in ("bin", "net.d"):
        (cni / sub).mkdir(parents=True, exist_ok=True)
    (cni / "net.d" / "10-hostpid-e2e.conflist").write_text(json.dumps(network or NETWORK))
    plugin = cni / "bin" / "hostpid-e2e-net"
    plugin.write_text(NETWORK_PLUGIN)
    plugin.chmod(0o755)
    for name in ("loopback", *cni_plugins):
        (cni / "bin" / name).symlink_to(CNI_BIN / name)


def _mountpoints_under(directory: Path) -> list[str]:
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = line.split()[4].replace("\\040", " ")
            if point == str(directory) or point.startswith(str(directory) + "/"):
                found.append(point)
    return found


def _pids_naming(marker: str) -> list[int]:
    """Processes whose command line contains C{marker} (this run's socket path)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if marker.encode() in cmdline.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def cri_version(name: str, process: subprocess.Popen[bytes], socket: Path, client: CriClient,
                output: Callable[[], str]) -> Any:
    """
    The runtime's CRI Version answer, or None while it does not answer yet
    (no socket, or an RPC error: CRI answers nothing before it is
    initialized); fails at once, with its log, if the runtime exited.
    """
    if process.poll() is not None:
        raise AssertionError(f"{name} exited {process.returncode}:\n{output()}")
    if not socket.exists():
        return None
    grpc = grpc_module()
    try:
        return client.call("RuntimeService", "Version", client.pb.VersionRequest(version="v1"), 2.0)
    except grpc.RpcError:
        return None


def kill_leftovers(marker: str, what: str) -> None:
    """
    After a runtime stopped: kill the helpers it started that outlive it
    (shims, conmons: every process whose command line names C{marker}).
    """
    for pid in _pids_naming(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not _pids_naming(marker), f"the {what} to exit", 15.0)


def remove_workdir(workdir: Path) -> None:
    """Unmount what a runtime left under C{workdir}, deepest first, and remove it."""
    for point in sorted(_mountpoints_under(workdir), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(workdir)],
                   check=False, timeout=120)


class Containerd:
    """One private containerd with its CRI plugin, started and torn down by the test."""

    def __init__(self, workdir: Path, package: Path, image_tar: Path,
                 messages: ModuleType, config_version: int = 2, nri: bool = False,
                 runc: str | None = None, network: dict[str, Any] | None = None,
                 cni_plugins: tuple[str, ...] = ()) -> None:
        """
        C{runc}: the OCI runtime (the host's runc unless told); C{network}
        replaces L{NETWORK} (the cluster tier's pods get a bridge), and each
        of C{cni_plugins} is linked from Debian's L{CNI_BIN} beside
        C{loopback}.
        """
        self.workdir = workdir
        #: An unpacked Debian package's C{usr/bin}, or a build's C{bin}.
        self.bin = package / "usr" / "bin" if (package / "usr").is_dir() else package / "bin"
        self.socket = workdir / "containerd.sock"
        #: The runtime's NRI socket (private to this run), when NRI is on.
        self.nri_socket = workdir / "nri" / "nri.sock" if nri else None
        #: NRI's C{plugin_path} (L{nri_section}): plugins containerd launches at its start.
        self.nri_plugin_dir = workdir / "nri" / "plugins"
        self.cdi_dir = workdir / "cdi"
        self.log_dir = workdir / "pods"
        #: The cgroup parent the test's pods get, one per run (removed at teardown).
        self.cgroup_parent = f"/hostpid-cri-e2e-{uuid.uuid4().hex[:8]}"
        for sub in ("cdi", "pods"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        write_network(workdir / "cni", network, cni_plugins)
        #: The OCI runtime containerd runs (the host's runc unless told).
        self.runc = runc or os.path.realpath(require_tool("runc"))
        #: containerd's shims listen under C{/run/containerd/s} whatever the
        #: configuration says (runtime/v2/shim/util_unix.go C{socketRoot});
        #: what this run creates there is removed at teardown.
        self._created = [d for d in (SHIM_SOCKET_ROOT.parent, SHIM_SOCKET_ROOT)
                         if not d.exists()]
        (workdir / "config.toml").write_text(
            config_toml(workdir, self.runc, config_version, self.nri_socket))
        self.log = open(workdir / "containerd.log", "ab")  # noqa: SIM115 (closed in close())
        self.client = CriClient(self.socket, messages)
        self.process = self._start()
        try:
            wait_for(self._answers, "containerd's CRI Version call", 60.0)
            self.ctr("images", "import", "--platform", "linux/amd64", str(image_tar))
        except BaseException:
            self.close()
            raise

    def _start(self) -> subprocess.Popen[bytes]:
        env = {"PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
        return subprocess.Popen(
            [str(self.bin / "containerd"), "--config", str(self.workdir / "config.toml"),
             "--log-level", "info"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env,
            cwd=self.workdir,
        )

    def _stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        """
        Stop containerd (SIGTERM, as systemd stops it) and start it again on
        the same configuration and state; its shims, and so the running
        containers, outlive it as they do in production.
        """
        self.stop()
        self.start()

    def stop(self) -> None:
        """Stop containerd (SIGTERM); L{start} starts it again (a node start)."""
        self._stop()

    def start(self, wait: bool = True) -> None:
        """Start the stopped containerd; with C{wait}, return once its CRI answers."""
        self.process = self._start()
        if wait:
            wait_for(self._answers, "containerd's CRI Version call after a restart", 60.0)

    def serving(self) -> bool:
        """CRI answers (it answers nothing before it is initialized); fails if containerd exited."""
        return self._answers()

    def _answers(self) -> bool:
        version = cri_version("containerd", self.process, self.socket, self.client, self.output)
        if version is None:
            return False
        self.version = version
        return True

    def ctr(self, *args: str) -> str:
        result = subprocess.run(
            [str(self.bin / "ctr"), "--address", str(self.socket), "--namespace", K8S_NAMESPACE,
             *args], capture_output=True, text=True, timeout=CALL_TIMEOUT, check=False,
        )
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        return result.stdout

    def output(self) -> str:
        return (self.workdir / "containerd.log").read_text(errors="replace")

    def close(self) -> None:
        """Stop containerd and its shims, unmount and remove what they left."""
        self.client.close()
        # Containers the test did not remove (a failed call): their processes first.
        runc_root = self.workdir / "runc" / K8S_NAMESPACE
        if runc_root.is_dir():
            for container_id in os.listdir(runc_root):
                subprocess.run([self.runc, "--root", str(runc_root), "delete", "--force",
                                container_id], capture_output=True, timeout=60, check=False)
        self._stop()
        self.log.close()
        # Shims are started with this run's socket address and outlive containerd.
        kill_leftovers(str(self.socket), "shims")
        self._remove_shim_sockets()
        remove_workdir(self.workdir)
        self._remove_cgroups()

    def _remove_shim_sockets(self) -> None:
        """
        The sockets of this run's shims: C{sha256(address/namespace/id)} for
        each task id (runtime/v2/shim/util_unix.go C{SocketAddress}).
        """
        tasks = self.workdir / "state" / "io.containerd.runtime.v2.task" / K8S_NAMESPACE
        for task_id in os.listdir(tasks) if tasks.is_dir() else []:
            name = hashlib.sha256(f"{self.socket}/{K8S_NAMESPACE}/{task_id}".encode()).hexdigest()
            path = SHIM_SOCKET_ROOT / name
            if path.is_socket():
                path.unlink()
        for directory in reversed(self._created):
            try:
                directory.rmdir()
            except OSError:
                pass

    def _remove_cgroups(self) -> None:
        remove_cgroups(self.cgroup_parent)


def remove_cgroups(cgroup_parent: str) -> None:
    """A cgroup parent's directories (empty once the containers are gone), deepest first."""
    root = Path("/sys/fs/cgroup")
    for hierarchy in [root, *root.iterdir()] if root.is_dir() else []:
        top = hierarchy / cgroup_parent.lstrip("/")
        if not top.is_dir():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()),
                                key=lambda p: len(p.parts), reverse=True):
            try:
                directory.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


@contextmanager
def running_containerd(image_tar: Path, messages: ModuleType,
                       package: Path | None = None, release: Release = RELEASES["1.7"],
                       nri: bool = False, runc: str | None = None) -> Iterator[Containerd]:
    package = package or release.package()  # fetched or built before the directory is made
    workdir = Path(tempfile.mkdtemp(prefix="hostpid-cri-", dir="/tmp"))
    os.chmod(workdir, 0o711)
    daemon = Containerd(workdir, package, image_tar, messages, release.config_version, nri,
                        runc)
    try:
        yield daemon
    finally:
        daemon.close()


@contextmanager
def running_runtime(runtime: Runtime, image_tar: Path, messages: ModuleType,
                    nri: bool = True) -> Iterator[Containerd | Crio]:
    """A private daemon for one cell of L{RUNTIMES}."""
    if runtime.daemon == "crio":
        from criolib import running_crio

        with running_crio(image_tar, messages, runtime.oci_binary(), nri=nri) as crio:
            yield crio
        return
    with running_containerd(image_tar, messages, release=RELEASES[runtime.release], nri=nri,
                            runc=runtime.oci_binary()) as containerd:
        yield containerd


@attrs.define
class Containerds:
    """
    The session's runtimes, each started on first use with NRI on, stopped at
    the session's end.  C{get} takes a release line (C{"1.7"}, C{"2.1"},
    C{"2.4"}: that release with Debian's runc) or a L{RUNTIMES} id.
    """

    image: Path
    messages: ModuleType
    stack: ExitStack
    started: dict[str, Any] = attrs.Factory(dict)

    def get(self, release: str = "1.7") -> Containerd:
        daemon = self.runtime(RELEASE_CELLS.get(release, release))
        assert isinstance(daemon, Containerd), f"{release} is not a containerd"
        return daemon

    def runtime(self, cell: str) -> Containerd | Crio:
        """The session's daemon for the L{RUNTIMES} cell C{cell}."""
        if cell not in self.started:
            self.started[cell] = self.stack.enter_context(running_runtime(
                RUNTIMES[cell], self.image, self.messages))
        daemon: Containerd | Crio = self.started[cell]
        return daemon


#: The same, named for what it holds now.
Runtimes = Containerds


def read_cri_log(path: Path) -> tuple[str, str]:
    """
    Stdout and stderr from a CRI log file: lines C{TIMESTAMP STREAM TAG
    TEXT}, C{TAG} C{F} for a full line and C{P} for a partial one (the CRI
    logging format containerd writes and the kubelet reads).
    """
    streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
    pending: dict[str, str] = {"stdout": "", "stderr": ""}
    for line in path.read_text(errors="replace").splitlines():
        _, stream, tag, text = (line.split(" ", 3) + [""])[:4]
        if tag == "P":
            pending[stream] += text
            continue
        streams[stream].append(pending[stream] + text)
        pending[stream] = ""
    return ("".join(f"{line}\n" for line in streams["stdout"]),
            "".join(f"{line}\n" for line in streams["stderr"]))


def wait_exited(client: CriClient, container_id: str, timeout: float = 60.0) -> Any:
    """The container's status once it has exited (bounded poll of ContainerStatus)."""
    exited = client.pb.CONTAINER_EXITED

    def status() -> Any:
        response = client.runtime("ContainerStatus", container_id=container_id, verbose=True)
        return response if response.status.state == exited else None

    return wait_for(status, f"container {container_id} to exit", timeout)


def build_static_client(out_dir: Path) -> Path:
    """The C contract client, linked statically: the image has no C library."""
    from clienttools import build_c_client

    return build_c_client(out_dir, static=True)


def static_busybox() -> Path:
    """Debian's static busybox (C{busybox-static}); the image has no C library."""
    for candidate in ("/bin/busybox", "/usr/bin/busybox"):
        path = Path(candidate)
        if path.is_file():
            # ldd fails on a static executable ("not a dynamic executable").
            linked = subprocess.run(["ldd", candidate], capture_output=True, check=False)
            if linked.returncode != 0:
                return path
    skip_or_fail("this test needs Debian's busybox-static (a static /bin/busybox)")
    raise AssertionError("unreachable")
