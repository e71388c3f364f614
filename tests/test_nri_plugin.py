"""
The plugin protocol on one connection (L{hostpid.nri.plugin}), in memory:
C{StringTransport} and C{MemoryReactorClock}, the runtime's bytes built by
L{nrilib} apart from the code under test.

Why each check exists:

- Registration as NRI's runtime expects it: C{RegisterPlugin} on
  sub-connection 2, stream 1, name C{hostpid} and the index; the runtime's
  refusal, or no answer within the registration timeout, closes the
  connection (reconnecting is the service's job).
- The plugin service: C{Configure} subscribes to CreateContainer only (bit
  C{1 << 3}), C{Synchronize} asks for no updates and echoes C{more} (NRI
  closes a plugin that does not), C{CreateContainer} carries the
  adjuster's answer, the other events are answered empty.
- Never an error answer: garbage, a frame that claims 4 GiB, an unknown
  message type, an unknown method or service, a message that does not
  decode: each closes the connection with nothing written in answer.
- The whole conversation split at every byte gives the same answers.
"""

from __future__ import annotations

import pytest
from nrilib import (
    PLUGIN_CONN,
    PLUGIN_SERVICE,
    RUNTIME_CONN,
    WireReader,
    gpu_container,
    mux_frame,
    pod,
    request_payload,
    response_payload,
    ttrpc_frame,
)
from twisted.internet.testing import MemoryReactorClock, StringTransport
from zope.interface import implementer

from hostpid.nri import api_pb2, ttrpc_pb2
from hostpid.nri.plugin import (
    REGISTRATION_TIMEOUT,
    SUBSCRIBED,
    IAdjuster,
    NRIPluginProtocol,
    event_mask,
)


@implementer(IAdjuster)
class FixedAdjuster:
    def __init__(self) -> None:
        self.seen: list[api_pb2.CreateContainerRequest] = []

    def adjust(self, request: api_pb2.CreateContainerRequest) -> api_pb2.ContainerAdjustment:
        self.seen.append(request)
        adjustment = api_pb2.ContainerAdjustment()
        adjustment.env.add(key="SEEN", value=request.container.name)
        return adjustment


class Connected:
    def __init__(self, **kwargs: object) -> None:
        self.clock = MemoryReactorClock()
        self.adjuster = FixedAdjuster()
        self.protocol = NRIPluginProtocol(self.adjuster, self.clock, **kwargs)  # type: ignore
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self.reader = WireReader()

    def written(self, conn_id: int) -> list[tuple[int, int, int, bytes]]:
        self.reader.feed(self.transport.value())
        self.transport.clear()
        return self.reader.frames(conn_id)

    def register(self) -> None:
        """Answer the registration (stream 1; test_registration_request checks the request)."""
        self.written(RUNTIME_CONN)
        self.protocol.dataReceived(mux_frame(RUNTIME_CONN, ttrpc_frame(
            1, 2, 0, response_payload(api_pb2.Empty()))))

    def call(self, stream: int, method: str, message: object = None,
             service: str = PLUGIN_SERVICE) -> bytes:
        self.protocol.dataReceived(mux_frame(PLUGIN_CONN, ttrpc_frame(
            stream, 1, 1, request_payload(service, method, message))))
        [(got, type_, _, payload)] = self.written(PLUGIN_CONN)
        assert (got, type_) == (stream, 2)
        response = ttrpc_pb2.Response.FromString(payload)
        assert response.status.code == 0
        return response.payload

    @property
    def aborted(self) -> bool:
        return self.transport.disconnecting


def test_registration_request() -> None:
    connected = Connected(index="42")
    [(stream, type_, flags, payload)] = connected.written(RUNTIME_CONN)
    request = ttrpc_pb2.Request.FromString(payload)
    assert (request.service, request.method) == ("nri.pkg.api.v1alpha1.Runtime",
                                                 "RegisterPlugin")
    registration = api_pb2.RegisterPluginRequest.FromString(request.payload)
    assert (registration.plugin_name, registration.plugin_idx) == ("hostpid", "42")
    assert not connected.protocol.registered
    connected.register()
    assert connected.protocol.registered and not connected.aborted
    assert connected.clock.getDelayedCalls() == []


def test_registration_timeout_closes() -> None:
    connected = Connected()
    connected.clock.advance(REGISTRATION_TIMEOUT - 0.01)
    assert not connected.aborted
    connected.clock.advance(0.02)
    assert connected.aborted and not connected.protocol.registered


def test_registration_refused_closes() -> None:
    connected = Connected()
    connected.written(RUNTIME_CONN)
    connected.protocol.dataReceived(mux_frame(RUNTIME_CONN, ttrpc_frame(
        1, 2, 0, response_payload(code=3, text="invalid plugin index"))))
    assert connected.aborted and not connected.protocol.registered
    assert connected.clock.getDelayedCalls() == []


def test_configure_synchronize_create() -> None:
    connected = Connected()
    connected.register()
    configured = api_pb2.ConfigureResponse.FromString(connected.call(
        1, "Configure", api_pb2.ConfigureRequest(runtime_name="containerd")))
    assert configured.events == SUBSCRIBED == 1 << 3 == event_mask(api_pb2.CREATE_CONTAINER)
    for stream, more in ((3, True), (5, False)):
        synced = api_pb2.SynchronizeResponse.FromString(connected.call(
            stream, "Synchronize", api_pb2.SynchronizeRequest(containers=[gpu_container()],
                                                              more=more)))
        assert synced.more is more and not synced.ListFields()[1:]
    created = api_pb2.CreateContainerResponse.FromString(connected.call(
        7, "CreateContainer", api_pb2.CreateContainerRequest(pod=pod(),
                                                             container=gpu_container("c1"))))
    assert [(e.key, e.value) for e in created.adjust.env] == [("SEEN", "c1")]
    assert connected.call(9, "StopContainer", api_pb2.Empty()) == b""
    assert connected.call(11, "Shutdown", api_pb2.Empty()) == b""
    assert not connected.aborted


def test_conversation_split_at_every_byte() -> None:
    stream = (mux_frame(RUNTIME_CONN, ttrpc_frame(1, 2, 0, response_payload(api_pb2.Empty())))
              + mux_frame(PLUGIN_CONN, ttrpc_frame(1, 1, 1, request_payload(
                  PLUGIN_SERVICE, "Configure", api_pb2.ConfigureRequest())))
              + mux_frame(PLUGIN_CONN, ttrpc_frame(3, 1, 1, request_payload(
                  PLUGIN_SERVICE, "CreateContainer", api_pb2.CreateContainerRequest(
                      pod=pod(), container=gpu_container("split"))))))
    expected = None
    for cut in range(len(stream) + 1):
        connected = Connected()
        connected.written(RUNTIME_CONN)
        connected.protocol.dataReceived(stream[:cut])
        connected.protocol.dataReceived(stream[cut:])
        answers = connected.written(PLUGIN_CONN)
        assert connected.protocol.registered and not connected.aborted
        if expected is None:
            expected = answers
            assert len(answers) == 2
        assert answers == expected, cut


HOSTILE = {
    "garbage": b"\x00\x00\x00\x01\x00\x00\x00\x05hello" + b"\x17" * 64,
    "mux-4GiB": b"\x00\x00\x00\x01\xff\xff\xff\xff" + b"\0" * 64,
    "ttrpc-4GiB": mux_frame(PLUGIN_CONN, b"\xff\xff\xff\xff\x00\x00\x00\x01\x01\x00"),
    "unknown-type": mux_frame(PLUGIN_CONN, ttrpc_frame(1, 7, 0, b"")),
    "unknown-method": mux_frame(PLUGIN_CONN, ttrpc_frame(1, 1, 1, request_payload(
        PLUGIN_SERVICE, "Frobnicate"))),
    "unknown-service": mux_frame(PLUGIN_CONN, ttrpc_frame(1, 1, 1, request_payload(
        "nri.pkg.api.v1alpha1.Other", "Configure"))),
    "undecodable-create": mux_frame(PLUGIN_CONN, ttrpc_frame(1, 1, 1, ttrpc_pb2.Request(
        service=PLUGIN_SERVICE, method="CreateContainer",
        payload=b"\x12\xff\xff").SerializeToString())),
    "request-on-runtime-conn": mux_frame(RUNTIME_CONN, ttrpc_frame(1, 1, 1, request_payload(
        PLUGIN_SERVICE, "Configure"))),
    "reserved-conn": mux_frame(0, b"x"),
}


@pytest.mark.parametrize("data", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_input_closes_without_answer(data: bytes) -> None:
    connected = Connected()
    connected.register()
    connected.written(PLUGIN_CONN)
    connected.protocol.dataReceived(data)
    assert connected.aborted
    assert connected.transport.value() == b""
    connected.protocol.dataReceived(mux_frame(PLUGIN_CONN, ttrpc_frame(
        1, 1, 1, request_payload(PLUGIN_SERVICE, "Configure"))))
    assert connected.transport.value() == b""


def test_hostile_before_registration_ends_registration() -> None:
    connected = Connected()
    failures: list[object] = []
    connected.protocol.registration.addErrback(failures.append)
    connected.protocol.dataReceived(HOSTILE["mux-4GiB"])
    assert connected.aborted
    connected.protocol.connectionLost()
    assert failures and connected.clock.getDelayedCalls() == []
