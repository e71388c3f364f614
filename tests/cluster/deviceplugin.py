"""
A device plugin for the cluster tier: the kubelet's device plugin API
C{v1beta1}, served with C{grpcio} on a Unix socket in the kubelet's device
plugin directory, advertising C{nvidia.com/gpu} devices backed by character
device nodes of NVIDIA's major (195) that it creates itself.

The messages are compiled at test time from the API's own C{api.proto}
(C{k8s.io/kubelet@v0.X.Y/pkg/apis/deviceplugin/v1beta1/api.proto}, from the
Go module cache the Kubernetes build filled), as L{crilib.compile_messages}
compiles CRI's.  The services are plain gRPC method handlers, so no
generated stubs are needed.

Two modes, the two ways a real GPU device plugin hands the kubelet a GPU
(C{pkg/kubelet/cm/devicemanager/pod_devices.go} C{deviceRunContainerOptions}
turns either into the container's config):

- C{"devices"}: each allocated device as a C{DeviceSpec} (host node,
  container path C{/dev/nvidiaN}, C{rw}), NVIDIA's device plugin's default;
- C{"cdi"}: each device as the CDI name C{nvidia.com/gpu=N} in
  C{cdiDevices}, with a CDI spec the plugin writes into the runtime's CDI
  directory naming the same nodes (C{--device-list-strategy=cdi-cri}).

The kubelet empties its device plugin directory when it starts
(C{devicemanager/manager.go} C{Start}: C{removeContents}), so a plugin must
notice its socket is gone, serve again and register again: the watcher
thread does that, which the node restart scenario relies on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

#: C{constants.go} of the API: the directory is fixed, whatever the kubelet's
#: C{--root-dir} (C{devicemanager.NewManagerImpl} uses C{pluginapi.KubeletSocket}).
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = DEVICE_PLUGIN_DIR / "kubelet.sock"
API_VERSION = "v1beta1"
RESOURCE = "nvidia.com/gpu"
#: NVIDIA's character device major (C{/proc/devices}: 195 nvidia-frontend).
NVIDIA_MAJOR = 195
CDI_KIND = "nvidia.com/gpu"
MODES = ("devices", "cdi")


def api_proto(kubelet_module_version: str) -> Path:
    """The API's C{api.proto} in the Go module cache (downloaded if missing)."""
    return kubelet_module(kubelet_module_version) / "pkg" / "apis" / "deviceplugin" / \
        "v1beta1" / "api.proto"


def kubelet_module(kubelet_module_version: str) -> Path:
    """
    C{k8s.io/kubelet}'s directory in the Go module cache (downloaded if
    missing): the kubelet's gRPC APIs' C{.proto} files are under C{pkg/apis}.
    """
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubelet@{kubelet_module_version}"],
        capture_output=True, text=True, timeout=600, check=False, cwd="/",
        env={**os.environ, "GOFLAGS": "", "GOWORK": "off"})
    if result.returncode != 0:
        raise RuntimeError(f"go mod download k8s.io/kubelet failed: {result.stderr[-2000:]}")
    return Path(json.loads(result.stdout)["Dir"])


def compile_messages(proto: Path, out_dir: Path,
                     stem: str = "deviceplugin_v1beta1") -> ModuleType:
    """
    The C{STEM_pb2} module protoc makes from C{proto} (copied to
    C{out_dir/STEM.proto}), imported from C{out_dir}.
    """
    from grpc_tools import protoc

    (out_dir / f"{stem}.proto").write_bytes(proto.read_bytes())
    status = protoc.main(["protoc", f"-I{out_dir}", f"--python_out={out_dir}",
                          str(out_dir / f"{stem}.proto")])
    if status != 0:
        raise AssertionError(f"protoc failed on {proto} ({status})")
    name = f"{stem}_pb2"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, out_dir / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cdi_spec(devices: dict[str, Path]) -> dict[str, Any]:
    """The CDI spec (C{nvidia.com/gpu}) naming each device's node."""
    return {
        "cdiVersion": "0.5.0",
        "kind": CDI_KIND,
        "devices": [
            {"name": device_id,
             "containerEdits": {"deviceNodes": [
                 {"path": f"/dev/nvidia{device_id}", "hostPath": str(node),
                  "type": "c", "major": NVIDIA_MAJOR, "minor": int(device_id),
                  "permissions": "rw"}]}}
            for device_id, node in sorted(devices.items(), key=lambda item: int(item[0]))
        ],
    }


def gpu_nodes(node_dir: Path, count: int) -> dict[str, Path]:
    """
    C{count} fake GPUs: character device nodes C{node_dir/nvidiaN} of
    NVIDIA's major (195, N), made if absent, by their minor as a string.
    """
    devices = {}
    node_dir.mkdir(parents=True, exist_ok=True)
    for minor in range(count):
        node = node_dir / f"nvidia{minor}"
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
        devices[str(minor)] = node
    return devices


class DevicePlugin:
    """
    The plugin: C{count} GPUs named C{"0"} .. C{str(count - 1)}, each a
    character device node C{node_dir/nvidiaN} (195, N).  C{start()} serves
    and registers; C{stop()} unregisters by going away and removes what it
    made.
    """

    def __init__(self, messages: ModuleType, node_dir: Path, count: int, mode: str = "devices",
                 cdi_dir: Path | None = None, name: str = "hostpid-test-gpu",
                 at_host_path: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        if mode == "cdi" and cdi_dir is None:
            raise ValueError("mode cdi needs the runtime's CDI directory")
        self.pb = messages
        self.mode = mode
        #: Mode C{"devices"}: each GPU at its node's own path in the
        #: container, not C{/dev/nvidiaN}.  In a user namespace runc makes a
        #: device node by binding the host's file at the OCI device's path
        #: (the spec has no host path: C{libcontainer/rootfs_linux.go}
        #: C{bindMountDeviceNode}); a real GPU's C{/dev/nvidia0} is there on
        #: the host, the tier's private nodes are not.
        self.at_host_path = at_host_path
        self.cdi_dir = cdi_dir
        self.socket = DEVICE_PLUGIN_DIR / f"{name}.sock"
        self.devices = gpu_nodes(node_dir, count)
        self.cdi_file = cdi_dir / "hostpid-test-nvidia.json" if cdi_dir is not None else None
        #: Allocate calls seen, each the device IDs of each container.
        self.allocations: list[list[list[str]]] = []
        #: Registrations made (one more after each kubelet restart).
        self.registrations = 0
        self._stopping = threading.Event()
        self._server: Any = None
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- the DevicePlugin service ------------------------------------------

    def _options(self, request: Any, context: Any) -> Any:
        return self.pb.DevicePluginOptions()

    def _list_and_watch(self, request: Any, context: Any) -> Iterator[Any]:
        yield self.pb.ListAndWatchResponse(devices=[
            self.pb.Device(ID=device_id, health="Healthy") for device_id in self.devices])
        # Nothing changes: hold the stream open until the kubelet or we go away.
        while not self._stopping.is_set() and context.is_active():
            self._stopping.wait(1.0)

    def _allocate(self, request: Any, context: Any) -> Any:
        responses = []
        seen = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            seen.append(ids)
            response = self.pb.ContainerAllocateResponse()
            if self.mode == "devices":
                for device_id in ids:
                    node = self.devices[device_id]
                    response.devices.add(container_path=str(node) if self.at_host_path
                                         else f"/dev/nvidia{device_id}",
                                         host_path=str(self.devices[device_id]),
                                         permissions="rw")
            else:
                for device_id in ids:
                    response.cdi_devices.add(name=f"{CDI_KIND}={device_id}")
            response.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
            responses.append(response)
        with self._lock:
            self.allocations.append(seen)
        return self.pb.AllocateResponse(container_responses=responses)

    def _preferred(self, request: Any, context: Any) -> Any:
        return self.pb.PreferredAllocationResponse()

    def _prestart(self, request: Any, context: Any) -> Any:
        return self.pb.PreStartContainerResponse()

    # -- lifecycle -----------------------------------------------------------

    def _serve(self) -> None:
        from crilib import grpc_module

        grpc = grpc_module()
        from concurrent import futures

        pb = self.pb

        def unary(handler: Any, request_type: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=request_type.FromString,
                response_serializer=lambda message: message.SerializeToString())

        handlers = {
            "GetDevicePluginOptions": unary(self._options, pb.Empty),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self._list_and_watch, request_deserializer=pb.Empty.FromString,
                response_serializer=lambda message: message.SerializeToString()),
            "GetPreferredAllocation": unary(self._preferred, pb.PreferredAllocationRequest),
            "Allocate": unary(self._allocate, pb.AllocateRequest),
            "PreStartContainer": unary(self._prestart, pb.PreStartContainerRequest),
        }
        if self.socket.exists() or self.socket.is_symlink():
            self.socket.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", handlers),))
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        self._register()

    def _register(self) -> None:
        from crilib import grpc_module

        grpc = grpc_module()
        with grpc.insecure_channel(f"unix://{KUBELET_SOCKET}") as channel:
            register = channel.unary_unary(
                "/v1beta1.Registration/Register",
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=self.pb.Empty.FromString)
            register(self.pb.RegisterRequest(
                version=API_VERSION, endpoint=self.socket.name, resource_name=RESOURCE,
                options=self.pb.DevicePluginOptions()), timeout=10.0)
        self.registrations += 1

    def start(self) -> None:
        """Write the CDI spec (mode C{cdi}), serve, register, and keep registered."""
        if self.cdi_file is not None:
            temporary = self.cdi_file.with_suffix(".tmp")
            temporary.write_text(json.dumps(cdi_spec(self.devices)))
            temporary.replace(self.cdi_file)
        self._serve()
        self._watcher = threading.Thread(target=self._watch, name="deviceplugin-watch",
                                         daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Serve and register again whenever the kubelet emptied the directory."""
        while not self._stopping.wait(0.5):
            if self.socket.exists():
                continue
            try:
                if KUBELET_SOCKET.exists():
                    self._server.stop(None)
                    self._serve()
            except Exception:  # noqa: BLE001 (the kubelet is not back yet: try again)
                continue

    def stop(self) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(10)
        if self._server is not None:
            self._server.stop(None)
        for path in (self.socket, self.cdi_file):
            if path is not None and (path.exists() or path.is_symlink()):
                path.unlink()
        for node in self.devices.values():
            if node.exists():
                node.unlink()
