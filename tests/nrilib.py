"""
A fake NRI runtime for tests: a real Unix socket speaking NRI's multiplexer
and ttrpc, written apart from L{hostpid.nri} (blocking sockets and
C{struct}, no Twisted) so that a mistake in the plugin's framing is not
mirrored here.  Only the message classes are shared (L{hostpid.nri.api_pb2};
the contract test against NRI's own Go code checks those).

The wire it speaks is containerd/nri's runtime side (C{pkg/adaptation/
plugin.go}): it accepts, waits for C{RegisterPlugin} on sub-connection 2,
answers it, then calls C{Configure}, C{Synchronize} and events on
sub-connection 1.

  - L{FakeRuntime}: the listening socket; C{accept()} gives a
    L{RuntimeConnection}.
  - L{RuntimeConnection}: C{register()}, C{configure()}, C{synchronize()},
    C{create_container(pod, container)}, C{handshake()} (the three first),
    C{send_raw()} and C{wait_closed()} for hostile tests.
  - L{NRIPluginProcess}: the real C{twistd hostpid-nri} (C{wait_registered},
    C{metric}, C{stop}) against any socket, this fake's or a real runtime's.
  - L{mux_frame}, L{ttrpc_frame}, L{request_payload}, L{WireReader}: the
    bytes, for in-memory tests.
  - L{pod}, L{container}, L{gpu_container}: NRI messages as a runtime fills
    them.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hostpid.nri import api_pb2, ttrpc_pb2

MUX = struct.Struct(">II")
TTRPC = struct.Struct(">IIBB")
PLUGIN_CONN = 1
RUNTIME_CONN = 2
REQUEST, RESPONSE, DATA = 1, 2, 3
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
CREATE_CONTAINER_BIT = 1 << (4 - 1)


def mux_frame(conn_id: int, payload: bytes) -> bytes:
    return MUX.pack(conn_id, len(payload)) + payload


def ttrpc_frame(stream_id: int, type_: int, flags: int, payload: bytes) -> bytes:
    return TTRPC.pack(len(payload), stream_id, type_, flags) + payload


def request_payload(service: str, method: str, message: Any = None) -> bytes:
    body = message.SerializeToString() if message is not None else b""
    return ttrpc_pb2.Request(service=service, method=method, payload=body).SerializeToString()


def response_payload(message: Any = None, code: int = 0, text: str = "") -> bytes:
    body = message.SerializeToString() if message is not None else b""
    return ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=code, message=text),
                              payload=body).SerializeToString()


def pod(name: str = "pod", namespace: str = "default", labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None) -> api_pb2.PodSandbox:
    return api_pb2.PodSandbox(id=f"sandbox-{name}", name=name, uid=f"uid-{name}",
                              namespace=namespace, labels=dict(labels or {}),
                              annotations=dict(annotations or {}))


def container(name: str = "ctr", env: Iterable[str] = (), devices: Iterable[str] = (),
              mounts: Iterable[tuple[str, str, list[str]]] = (),
              cdi: Iterable[str] = (), annotations: Mapping[str, str] | None = None,
              ) -> api_pb2.Container:
    """A container as the runtime shows it: C{mounts} as (destination, source, options)."""
    message = api_pb2.Container(id=f"id-{name}", pod_sandbox_id="sandbox", name=name,
                                env=list(env), annotations=dict(annotations or {}))
    for path in devices:
        message.linux.devices.add(path=path, type="c", major=195, minor=0)
    for destination, source, options in mounts:
        message.mounts.add(destination=destination, type="bind", source=source,
                           options=list(options))
    for name_ in cdi:
        message.CDI_devices.add(name=name_)
    return message


def gpu_container(name: str = "gpu", **kwargs: Any) -> api_pb2.Container:
    """A container a stock NVIDIA device plugin gave one GPU (its device nodes and env)."""
    kwargs.setdefault("devices", ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"])
    kwargs.setdefault("env", ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=GPU-0"])
    return container(name, **kwargs)


class WireReader:
    """What the plugin wrote, decoded: ttrpc frames per sub-connection (for in-memory tests)."""

    def __init__(self) -> None:
        self._trunk = b""
        self._streams: dict[int, bytes] = {}

    def feed(self, data: bytes) -> None:
        self._trunk += data
        while len(self._trunk) >= MUX.size:
            conn_id, length = MUX.unpack_from(self._trunk)
            if len(self._trunk) < MUX.size + length:
                break
            self._streams[conn_id] = (self._streams.get(conn_id, b"")
                                      + self._trunk[MUX.size:MUX.size + length])
            self._trunk = self._trunk[MUX.size + length:]

    def frames(self, conn_id: int) -> list[tuple[int, int, int, bytes]]:
        """The whole ttrpc messages on C{conn_id} so far (taken)."""
        out = []
        buffer = self._streams.get(conn_id, b"")
        while len(buffer) >= TTRPC.size:
            length, stream_id, type_, flags = TTRPC.unpack_from(buffer)
            if len(buffer) < TTRPC.size + length:
                break
            out.append((stream_id, type_, flags, buffer[TTRPC.size:TTRPC.size + length]))
            buffer = buffer[TTRPC.size + length:]
        self._streams[conn_id] = buffer
        return out


class RemoteClosed(Exception):
    """The plugin closed the connection."""


class RuntimeConnection:
    """One accepted plugin connection, driven synchronously by a test."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._trunk = b""
        self._streams: dict[int, bytes] = {PLUGIN_CONN: b"", RUNTIME_CONN: b""}
        self._next_stream = 1

    # Bytes

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, conn_id: int, data: bytes) -> None:
        self.send_raw(mux_frame(conn_id, data))

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the plugin sent nothing in time")
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise TimeoutError("the plugin sent nothing in time") from None
        except ConnectionResetError:
            data = b""
        if not data:
            raise RemoteClosed("the plugin closed the connection")
        self._trunk += data
        while len(self._trunk) >= MUX.size:
            conn_id, length = MUX.unpack_from(self._trunk)
            if len(self._trunk) < MUX.size + length:
                break
            payload = self._trunk[MUX.size:MUX.size + length]
            self._trunk = self._trunk[MUX.size + length:]
            self._streams[conn_id] = self._streams.get(conn_id, b"") + payload

    def read_frame(self, conn_id: int, timeout: float = 5.0) -> tuple[int, int, int, bytes]:
        """The next ttrpc message on C{conn_id}: (stream id, type, flags, payload)."""
        deadline = time.monotonic() + timeout
        while True:
            buffer = self._streams.get(conn_id, b"")
            if len(buffer) >= TTRPC.size:
                length, stream_id, type_, flags = TTRPC.unpack_from(buffer)
                if len(buffer) >= TTRPC.size + length:
                    self._streams[conn_id] = buffer[TTRPC.size + length:]
                    return stream_id, type_, flags, buffer[TTRPC.size:TTRPC.size + length]
            self._fill(deadline)

    # The runtime's service: RegisterPlugin

    def expect_registration(
            self, timeout: float = 5.0) -> tuple[int, api_pb2.RegisterPluginRequest]:
        stream_id, type_, flags, payload = self.read_frame(RUNTIME_CONN, timeout)
        assert type_ == REQUEST, type_
        request = ttrpc_pb2.Request.FromString(payload)
        assert (request.service, request.method) == (RUNTIME_SERVICE, "RegisterPlugin"), request
        return stream_id, api_pb2.RegisterPluginRequest.FromString(request.payload)

    def answer(self, stream_id: int, code: int = 0, text: str = "") -> None:
        self.send(RUNTIME_CONN, ttrpc_frame(stream_id, RESPONSE, 0,
                                            response_payload(api_pb2.Empty(), code, text)))

    def register(self, timeout: float = 5.0) -> api_pb2.RegisterPluginRequest:
        stream_id, request = self.expect_registration(timeout)
        self.answer(stream_id)
        return request

    # The plugin's service

    def call(self, method: str, message: Any, response_type: Any, timeout: float = 5.0) -> Any:
        stream_id = self._next_stream
        self._next_stream += 2
        self.send(PLUGIN_CONN, ttrpc_frame(stream_id, REQUEST, 0x1,
                                           request_payload(PLUGIN_SERVICE, method, message)))
        got, type_, _, payload = self.read_frame(PLUGIN_CONN, timeout)
        assert (got, type_) == (stream_id, RESPONSE), (got, type_)
        response = ttrpc_pb2.Response.FromString(payload)
        assert response.status.code == 0, response.status
        return response_type.FromString(response.payload)

    def configure(self, timeout: float = 5.0) -> api_pb2.ConfigureResponse:
        return self.call("Configure", api_pb2.ConfigureRequest(
            runtime_name="fake-runtime", runtime_version="0", registration_timeout=5000,
            request_timeout=2000), api_pb2.ConfigureResponse, timeout)

    def synchronize(self, pods: Iterable[api_pb2.PodSandbox] = (),
                    containers: Iterable[api_pb2.Container] = (), more: bool = False,
                    timeout: float = 5.0) -> api_pb2.SynchronizeResponse:
        return self.call("Synchronize", api_pb2.SynchronizeRequest(
            pods=list(pods), containers=list(containers), more=more),
            api_pb2.SynchronizeResponse, timeout)

    def create_container(self, pod_: api_pb2.PodSandbox, container_: api_pb2.Container,
                         timeout: float = 5.0) -> api_pb2.CreateContainerResponse:
        return self.call("CreateContainer", api_pb2.CreateContainerRequest(
            pod=pod_, container=container_), api_pb2.CreateContainerResponse, timeout)

    def handshake(self, timeout: float = 5.0) -> api_pb2.RegisterPluginRequest:
        """What a runtime does with a new plugin: registration, Configure, Synchronize."""
        registration = self.register(timeout)
        configured = self.configure(timeout)
        assert configured.events == CREATE_CONTAINER_BIT, configured
        self.synchronize(timeout=timeout)
        return registration

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """Whether the plugin closes the connection within C{timeout} (bytes it sends are read)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._fill(deadline)
            except RemoteClosed:
                return True
            except TimeoutError:
                return False

    def close(self) -> None:
        self.sock.close()


class FakeRuntime:
    """A runtime's NRI socket at C{path}."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.connections: list[RuntimeConnection] = []

    def accept(self, timeout: float = 10.0) -> RuntimeConnection:
        self.listener.settimeout(timeout)
        sock, _ = self.listener.accept()
        sock.settimeout(None)
        connection = RuntimeConnection(sock)
        self.connections.append(connection)
        return connection

    def close(self) -> None:
        """Stop listening and remove the socket (as a runtime that stops does)."""
        for connection in self.connections:
            connection.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> FakeRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_tree(root: Path) -> Path:
    """
    C{root} as a node's host paths for the plugin: C{broker/} (the broker
    directory) and C{tmp/vgpulock} (the lock parent, in a 0755 C{tmp}).
    """
    (root / "broker").mkdir()
    (root / "tmp").mkdir(mode=0o755)
    (root / "tmp" / "vgpulock").mkdir()
    return root


def unfreeze(path: Path) -> None:
    """
    Clear the immutable attribute below C{path} (where preparation sets one on
    the broker mountpoint) so that root can remove what the plugin made
    (L{support.release_immutable}).
    """
    from support import release_immutable

    release_immutable(path)


def http_get(path: Path | str, target: str, timeout: float = 5.0) -> tuple[int, str]:
    """C{GET target} over the Unix socket C{path} (a C{--metrics unix:PATH} endpoint)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


class NRIPluginProcess:
    """
    A real plugin: C{twistd hostpid-nri} in its own process, output to a file
    (a chatty process never blocks on a full pipe).

    @param metrics: a Unix socket path for C{--metrics}; then L{ready},
        L{wait_registered} and L{metric} read the plugin's own endpoints.
    @param wrapper: a command line the plugin's is appended to (one that
        sets up a namespace, then runs C{"$@"}).
    """

    def __init__(self, socket_path: Path | str, args: Iterable[str] = (), gate: str | None = "1",
                 env: Mapping[str, str] | None = None,
                 metrics: Path | str | None = None, wrapper: Iterable[str] = ()) -> None:
        import subprocess
        import tempfile

        from support import TWISTD, subprocess_env

        self.metrics_path = str(metrics) if metrics is not None else None
        if metrics is not None:
            args = [*args, "--metrics", f"unix:{metrics}"]

        environment = subprocess_env(dict(env or {}))
        environment.pop("LIBVGPU_HOSTPID_BROKER", None)
        if gate is not None:
            environment["LIBVGPU_HOSTPID_BROKER"] = gate
        self._log = tempfile.TemporaryFile()
        self.argv = [*wrapper, *TWISTD, "--nodaemon", "--pidfile=", "hostpid-nri",
                     "--nri-socket", str(socket_path), *args]
        self.process = subprocess.Popen(
            self.argv, env=environment, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def ready(self) -> bool:
        """C{/readyz} is 200: the plugin is registered with the runtime."""
        assert self.metrics_path is not None, "start it with metrics=PATH"
        try:
            return http_get(self.metrics_path, "/readyz")[0] == 200
        except OSError:
            return False

    def wait_registered(self, timeout: float = 30.0) -> None:
        from support import wait_for

        wait_for(self.ready, f"hostpid-nri registered\n{self.output()}", timeout)

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of C{/metrics}, e.g. C{metric("hostpid_nri_containers_total",
        reason="adjusted")}; None when absent."""
        assert self.metrics_path is not None, "start it with metrics=PATH"
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(http_get(self.metrics_path, "/metrics")[1]):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout)

    def __enter__(self) -> NRIPluginProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()
