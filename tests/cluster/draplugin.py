"""
A DRA driver for the cluster tier, real to the kubelet: the kubelet plugin
registration API (C{pluginregistration} v1) and the DRA service
C{k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin}, served with C{grpcio} on Unix
sockets under the kubelet's C{--root-dir}, and ResourceSlices written
through the API server, as a driver's helper
(C{k8s.io/dynamic-resource-allocation/kubeletplugin}) does.  The messages are
compiled at test time from C{k8s.io/kubelet}'s own C{.proto} files, as the
tier's device plugin compiles its API's (L{deviceplugin.compile_messages}).

What it publishes and prepares is shaped like HAMi's DRA driver
(C{Project-HAMi/k8s-dra-driver}, C{cmd/hami-kubelet-plugin}):

- devices C{hami-gpu-N} with HAMi's attributes (C{type: hami-gpu},
  C{uuid}, C{minor}, C{productName}...), consumable capacity C{cores} (100)
  and C{memory}, each with a request policy, and
  C{allowMultipleAllocations}, so several claims share one device;
- a DeviceClass selecting them by driver and C{type};
- for each claim, the CDI devices and edits of L{hamidra} (HAMi's names,
  HAMi-core's limits from the claim's consumed capacity, HAMi's bind of the
  lock parent, the device node of a fake GPU of major 195 made by
  L{deviceplugin.gpu_nodes}).

The lock parent bound is the node's (the tier's private one, never the
host's C{/tmp/vgpulock}), made C{01777} if absent, as HAMi's bind needs it
there.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import deviceplugin
from hamidra import (
    CDI_CLAIM_KIND,
    CDI_DEVICE_KIND,
    CDI_VENDOR,
    DEVICE_CLASS,
    DRIVER,
    GPU_MEMORY,
    claim_edits,
    device_name,
    hook_files,
    standard_spec,
    write_json,
)

#: The gRPC service names, as the registration lists them
#: (C{k8s.io/kubelet/pkg/apis/dra/v1} C{DRAPluginService}) and as they are
#: called (the proto's package).
SERVICE_VERSION = "v1.DRAPlugin"
DRA_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
REGISTRATION_SERVICE = "pluginregistration.Registration"


def compile_messages(kubelet_module: Path, out_dir: Path) -> tuple[ModuleType, ModuleType]:
    """The DRA v1 and plugin registration v1 messages (C{_pb2} modules)."""
    apis = kubelet_module / "pkg" / "apis"
    dra = deviceplugin.compile_messages(apis / "dra" / "v1" / "api.proto", out_dir, "dra_v1")
    registration = deviceplugin.compile_messages(
        apis / "pluginregistration" / "v1" / "api.proto", out_dir, "pluginregistration_v1")
    return dra, registration


def resource_slice(node: str, count: int, generation: int = 1) -> dict[str, Any]:
    """The node's one ResourceSlice: C{count} devices shaped like HAMi's."""
    memory = str(GPU_MEMORY)
    devices = []
    for minor in range(count):
        devices.append({
            "name": device_name(minor),
            "attributes": {
                "type": {"string": "hami-gpu"},
                "uuid": {"string": f"GPU-00000000-0000-4000-8000-{minor:012d}"},
                "minor": {"int": minor},
                "productName": {"string": "hostpid test GPU"},
                "brand": {"string": "Test"},
                "driverVersion": {"version": "580.0.0"},
            },
            "capacity": {
                "cores": {"value": "100", "requestPolicy": {
                    "default": "100",
                    "validRange": {"min": "0", "max": "100", "step": "1"}}},
                "memory": {"value": memory, "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": "1Mi", "max": memory, "step": "1Mi"}}},
            },
            "allowMultipleAllocations": True,
        })
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                 "devices": devices},
    }


def device_class() -> dict[str, Any]:
    """The DeviceClass, selecting by driver and C{type} as HAMi's chart does."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": (
            f"device.driver == '{DRIVER}' && "
            f"device.attributes['{DRIVER}'].type == 'hami-gpu'")}}]},
    }


class DraPlugin:
    """
    The driver's kubelet plugin: C{count} GPUs, registered with the kubelet
    of C{kube} and published in a ResourceSlice; C{start()} serves,
    registers and publishes, C{stop()} takes all of it away.

    @ivar prepared: each NodePrepareResources claim seen, C{(namespace,
        name, uid)}, in order.
    @ivar registered: the kubelet's answers to the registration, in order.
    """

    def __init__(self, messages: tuple[ModuleType, ModuleType], kube: Any, node_dir: Path,
                 count: int, cdi_dir: Path, lock_parent: Path) -> None:
        self.dra, self.registration = messages
        self.kube = kube
        self.count = count
        self.cdi_dir = cdi_dir
        self.lock_parent = lock_parent
        self.devices = deviceplugin.gpu_nodes(node_dir, count)
        self.hook_dir = node_dir / "vgpu"
        plugins = Path(kube.kubelet_root) / "plugins" / DRIVER
        self.endpoint = plugins / "dra.sock"
        self.registration_socket = Path(kube.kubelet_root) / "plugins_registry" / \
            f"{DRIVER}-reg.sock"
        self.standard_file = cdi_dir / f"{CDI_VENDOR}-device.json"
        self.prepared: list[tuple[str, str, str]] = []
        self.unprepared: list[str] = []
        self.registered: list[tuple[bool, str]] = []
        self._lock = threading.Lock()
        self._servers: list[Any] = []
        self._stopped = False

    # -- the DRA service ---------------------------------------------------

    def _claim_file(self, uid: str) -> Path:
        return self.cdi_dir / f"{CDI_VENDOR}-claim_{uid}.json"

    def _prepare_one(self, claim: Any) -> Any:
        found = self.kube.get("resourceclaim", "-n", claim.namespace, claim.name)
        if found["metadata"]["uid"] != claim.uid:
            return self.dra.NodePrepareResourceResponse(
                error=f"claim {claim.namespace}/{claim.name} is {found['metadata']['uid']}, "
                      f"not {claim.uid}")
        allocation = (found.get("status") or {}).get("allocation") or {}
        results = [r for r in allocation.get("devices", {}).get("results", [])
                   if r.get("driver") == DRIVER]
        if not self.lock_parent.exists():
            self.lock_parent.mkdir(parents=True)
            self.lock_parent.chmod(0o1777)
        spec = {"cdiVersion": "0.5.0", "kind": CDI_CLAIM_KIND, "devices": [
            {"name": f"{claim.uid}-{r['device']}",
             "containerEdits": claim_edits(results, self.hook_dir, self.lock_parent)}
            for r in results]}
        write_json(self._claim_file(claim.uid), spec)
        response = self.dra.NodePrepareResourceResponse()
        for result in results:
            device = response.devices.add(
                request_names=[result["request"]], pool_name=result["pool"],
                device_name=result["device"],
                cdi_device_ids=[f"{CDI_DEVICE_KIND}={result['device']}",
                                f"{CDI_CLAIM_KIND}={claim.uid}-{result['device']}"])
            if result.get("shareID"):
                device.share_id = result["shareID"]
        with self._lock:
            self.prepared.append((claim.namespace, claim.name, claim.uid))
        return response

    def _prepare(self, request: Any, context: Any) -> Any:
        response = self.dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                response.claims[claim.uid].CopyFrom(self._prepare_one(claim))
            except Exception as e:  # noqa: BLE001 (the kubelet is told, and retries)
                response.claims[claim.uid].error = f"{type(e).__name__}: {e}"
        return response

    def _unprepare(self, request: Any, context: Any) -> Any:
        response = self.dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            path = self._claim_file(claim.uid)
            if path.exists():
                path.unlink()
            with self._lock:
                self.unprepared.append(claim.uid)
            response.claims[claim.uid].CopyFrom(self.dra.NodeUnprepareResourceResponse())
        return response

    # -- the registration service -------------------------------------------

    def _info(self, request: Any, context: Any) -> Any:
        return self.registration.PluginInfo(
            type="DRAPlugin", name=DRIVER, endpoint=str(self.endpoint),
            supported_versions=[SERVICE_VERSION])

    def _status(self, request: Any, context: Any) -> Any:
        with self._lock:
            self.registered.append((request.plugin_registered, request.error))
        return self.registration.RegistrationStatusResponse()

    # -- lifecycle -----------------------------------------------------------

    def _server(self, socket: Path, service: str, handlers: Mapping[str, Any]) -> Any:
        from crilib import grpc_module

        grpc = grpc_module()
        rpc = {name: grpc.unary_unary_rpc_method_handler(
                   handler, request_deserializer=request_type.FromString,
                   response_serializer=lambda message: message.SerializeToString())
               for name, (handler, request_type) in handlers.items()}
        socket.parent.mkdir(parents=True, exist_ok=True)
        if socket.exists() or socket.is_symlink():
            socket.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, rpc),))
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        self._servers.append(server)
        return server

    def start(self) -> None:
        """CDI spec, DRA service, then the registration socket the kubelet watches; publish."""
        hook_files(self.hook_dir)
        write_json(self.standard_file, standard_spec(self.devices))
        self._server(self.endpoint, DRA_SERVICE, {
            "NodePrepareResources": (self._prepare, self.dra.NodePrepareResourcesRequest),
            "NodeUnprepareResources": (self._unprepare, self.dra.NodeUnprepareResourcesRequest),
        })
        self._server(self.registration_socket, REGISTRATION_SERVICE, {
            "GetInfo": (self._info, self.registration.InfoRequest),
            "NotifyRegistrationStatus": (self._status, self.registration.RegistrationStatus),
        })
        from support import wait_for

        wait_for(lambda: any(ok for ok, _ in self.registered),
                 f"the kubelet to register DRA driver {DRIVER}", 60.0)
        self.kube.apply(device_class(), resource_slice(self.kube_node(), self.count))

    def kube_node(self) -> str:
        from cluster import NODE_NAME

        return NODE_NAME

    def stop(self) -> None:
        """Unpublish, stop serving, remove every file made (once)."""
        if self._stopped:
            return
        self._stopped = True
        self.kube.kubectl_run("delete", "resourceslice", f"{self.kube_node()}-{DRIVER}",
                              "--ignore-not-found")
        self.kube.kubectl_run("delete", "deviceclass", DEVICE_CLASS, "--ignore-not-found")
        for server in self._servers:
            server.stop(None)
        self._servers.clear()
        for path in (self.registration_socket, self.endpoint, self.standard_file,
                     *self.cdi_dir.glob(f"{CDI_VENDOR}-claim_*.json")):
            if path.exists() or path.is_symlink():
                path.unlink()
        for node in self.devices.values():
            if node.exists():
                node.unlink()
        for name in ("libvgpu.so", "ld.so.preload"):
            if (self.hook_dir / name).exists():
                (self.hook_dir / name).unlink()
