"""
The NRI plugin protocol over one connection to the runtime's socket.

What happens on a connection (containerd/nri C{pkg/adaptation/plugin.go}
is the runtime's side, C{pkg/stub/stub.go} a Go plugin's):

 1. The plugin connects; both ends multiplex the connection
    (L{hostpid.nri.mux}).  The runtime serves C{nri.pkg.api.v1alpha1.Runtime}
    on sub-connection 2 and calls C{nri.pkg.api.v1alpha1.Plugin} on 1.
 2. The plugin calls C{RegisterPlugin} (name and two-digit index: the
    runtime refuses others, C{api.CheckPluginIndex}).  The runtime waits
    for it up to its registration timeout (5 s by default), then calls
    C{Configure}, whose answer is the event mask the plugin subscribes to
    (bit C{1 << (event - 1)}, C{pkg/api/event.go}), then C{Synchronize}
    with the pods and containers that exist.
 3. From then on the runtime calls the subscribed events, each within its
    request timeout (2 s by default), and C{Shutdown} when it stops.

The failure rule that shapes everything here (C{pkg/adaptation}): a plugin
that times out or whose connection closes is dropped and the container is
created without its adjustment, but an error the plugin answers fails the
container's creation.  So this side never answers an error: a problem with
one container is an empty adjustment (L{IAdjuster}'s job), and a runtime
that breaks the protocol gets its connection closed.

C{Synchronize} echoes the request's C{more} and asks for no updates: the
design's rollout leaves running containers as they are (the runtime closes
a plugin whose answer to a split synchronization does not echo C{more},
C{synchronize} in C{plugin.go}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface

from hostpid.nri import api_pb2
from hostpid.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Multiplexer
from hostpid.nri.ttrpc import ClientChannel, ProtocolViolation, RemoteError, ServerChannel

API_PACKAGE = "nri.pkg.api.v1alpha1"
PLUGIN_SERVICE = API_PACKAGE + ".Plugin"
RUNTIME_SERVICE = API_PACKAGE + ".Runtime"

PLUGIN_NAME = "hostpid"
#: Plugins are called in index order and each sees the container as the
#: ones before it adjusted it (C{result.apply} in C{pkg/adaptation/result.go}
#: updates the request's container).  Device-injecting NRI plugins (NVIDIA's
#: and others' device injectors, vgpu-manager) register with low or middle
#: indices; 90 runs after them, so a GPU they add is seen here.
DEFAULT_INDEX = "90"
#: How long the runtime has to answer C{RegisterPlugin} before the
#: connection is closed and made again: the runtime's own default
#: registration timeout (C{DefaultPluginRegistrationTimeout}, 5 s).
REGISTRATION_TIMEOUT = 5.0


def event_mask(*events: int) -> int:
    """NRI's C{EventMask}: bit C{1 << (event - 1)} per event."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


#: The one event the plugin needs.
SUBSCRIBED = event_mask(api_pb2.CREATE_CONTAINER)

#: Plugin methods that are answered with an empty message: every one whose
#: response carries only optional updates, evictions or a rejection flag.
#: Not subscribed, they are not called; a runtime that calls them anyway
#: gets nothing done rather than a closed connection.
EMPTY_ANSWERS = frozenset({
    "RunPodSandbox", "UpdatePodSandbox", "PostUpdatePodSandbox", "StopPodSandbox",
    "RemovePodSandbox", "PostCreateContainer", "StartContainer", "PostStartContainer",
    "UpdateContainer", "PostUpdateContainer", "StopContainer", "RemoveContainer",
    "StateChange", "ValidateContainerAdjustment",
})


class IAdjuster(Interface):
    """What a container gets at creation (the decision, its metrics and logs)."""

    def adjust(request: api_pb2.CreateContainerRequest) -> api_pb2.ContainerAdjustment:
        """
        The adjustment for C{request}.  Never raises: a problem is an empty
        adjustment and a log line.
        """


class IRegistrationObserver(Interface):
    """Told when a connection registers and when it is gone (readiness, backoff)."""

    def registered(protocol: Any) -> None:
        """The runtime accepted the registration of C{protocol}."""

    def disconnected(protocol: Any, was_registered: bool) -> None:
        """C{protocol}'s connection is gone."""


class NRIPluginProtocol(Protocol):
    """
    One connection to the runtime: registration, then the plugin service.

    @ivar registration: fires with None when the runtime accepts the
        registration; fails when it refuses, the timeout passes, or the
        connection goes first.
    """

    log = Logger()

    def __init__(self, adjuster: IAdjuster, clock: IReactorTime, *,
                 index: str = DEFAULT_INDEX, name: str = PLUGIN_NAME,
                 observer: IRegistrationObserver | None = None,
                 registration_timeout: float = REGISTRATION_TIMEOUT) -> None:
        self.adjuster = adjuster
        self.clock = clock
        self.index = index
        self.name = name
        self.observer = observer
        self.registration_timeout = registration_timeout
        self.registered = False
        self.configured = False
        self.closed = False
        self.registration: Deferred[None] = Deferred()
        self._timer: IDelayedCall | None = None
        self._methods: dict[str, Callable[[bytes], bytes]] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "CreateContainer": self._create_container,
            "Shutdown": self._shutdown,
        }

    def connectionMade(self) -> None:
        assert self.transport is not None
        # The transport is its own producer: once the answers it has not yet
        # written pass its buffer size, it stops reading until they are
        # written.  A runtime that sends requests and never reads the answers
        # then fills its own socket, not this process's memory.
        self.transport.registerProducer(self.transport, True)  # type: ignore[attr-defined]
        self.mux = Multiplexer(self.transport.write)
        self.server = ServerChannel(
            self.mux.open(PLUGIN_SERVICE_CONN, self._server_data), self._handle)
        self.client = ClientChannel(self.mux.open(RUNTIME_SERVICE_CONN, self._client_data))
        self._timer = self.clock.callLater(self.registration_timeout, self._registration_timed_out)
        request = api_pb2.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index)
        self.client.call(RUNTIME_SERVICE, "RegisterPlugin",
                         request.SerializeToString()).addCallbacks(
            self._registered, self._registration_failed)

    def _server_data(self, data: bytes) -> None:
        if not self.closed:
            self.server.dataReceived(data)

    def _client_data(self, data: bytes) -> None:
        if not self.closed:
            self.client.dataReceived(data)

    def dataReceived(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self.mux.dataReceived(data)
        except ProtocolViolation as e:
            self.abort(f"the runtime broke the protocol: {e}")
        except Exception as e:
            self.log.failure("hostpid-nri: unexpected error on the runtime's connection",
                             Failure())
            self.abort(f"internal error: {type(e).__name__}")

    def abort(self, why: str) -> None:
        """Close the connection at once: to NRI, a dropped plugin."""
        if self.closed:
            return
        self.closed = True
        self.log.warn("hostpid-nri: closing the connection to the runtime: {why}", why=why)
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.client.connectionLost(reason)
        if self.observer is not None:
            self.observer.disconnected(self, self.registered)

    # Registration

    def _registered(self, payload: bytes) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self.closed:
            return
        self.registered = True
        self.log.info("hostpid-nri: registered with the runtime as {index}-{name}",
                      index=self.index, name=self.name)
        if self.observer is not None:
            self.observer.registered(self)
        self.registration.callback(None)

    def _registration_failed(self, failure: Failure) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if failure.check(RemoteError):
            self.abort(f"the runtime refused the registration ({failure.value})")
        self.registration.errback(failure)
        self.registration.addErrback(lambda _: None)

    def _registration_timed_out(self) -> None:
        self._timer = None
        self.abort(f"the runtime did not answer the registration within "
                   f"{self.registration_timeout:g} s")

    # The plugin service

    def _handle(self, service: str, method: str, payload: bytes) -> bytes:
        if service != PLUGIN_SERVICE:
            raise ProtocolViolation(f"a call to service {service!r}, not {PLUGIN_SERVICE}")
        handler = self._methods.get(method)
        if handler is not None:
            return handler(payload)
        if method in EMPTY_ANSWERS:
            return b""
        raise ProtocolViolation(f"a call to unknown method {method!r}")

    @staticmethod
    def _parse(message: Any, payload: bytes) -> Any:
        try:
            message.ParseFromString(payload)
        except DecodeError as e:
            raise ProtocolViolation(
                f"a {type(message).__name__} that does not decode: {e}") from None
        return message

    def _configure(self, payload: bytes) -> bytes:
        request = self._parse(api_pb2.ConfigureRequest(), payload)
        self.configured = True
        self.log.info(
            "hostpid-nri: configured by {runtime} {version} (request timeout {timeout} ms), "
            "subscribing to CreateContainer",
            runtime=request.runtime_name or "?", version=request.runtime_version or "?",
            timeout=request.request_timeout)
        return api_pb2.ConfigureResponse(events=SUBSCRIBED).SerializeToString()

    def _synchronize(self, payload: bytes) -> bytes:
        request = self._parse(api_pb2.SynchronizeRequest(), payload)
        return api_pb2.SynchronizeResponse(more=request.more).SerializeToString()

    def _create_container(self, payload: bytes) -> bytes:
        request = self._parse(api_pb2.CreateContainerRequest(), payload)
        adjustment = self.adjuster.adjust(request)
        return api_pb2.CreateContainerResponse(adjust=adjustment).SerializeToString()

    def _shutdown(self, payload: bytes) -> bytes:
        self.log.info("hostpid-nri: the runtime is shutting the plugin down")
        return b""
