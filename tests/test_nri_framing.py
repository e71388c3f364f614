"""
ttrpc framing and NRI's multiplexer (L{hostpid.nri.ttrpc}, L{hostpid.nri.mux}),
in memory, against bytes built apart from them (L{nrilib}).

Why each check exists:

- The wire: a stream split at every byte gives the same frames as whole
  (a runtime's writes arrive in any pieces), in both layers.
- The caps: a header claiming more than ttrpc's 4 MiB (or the multiplexer's
  4 MiB + 10) is refused before its payload is held, so a frame that claims
  4 GiB costs nothing; exactly the cap is accepted.
- Strictness on the serving side (the peer is the runtime): a response or
  data frame, an even or repeated stream id, a streaming request, or a
  payload that is no ttrpc Request is a violation (the connection closes),
  never an answer.
- The calling side: stream ids 1, 3, 5...; a status other than OK fails the
  call; a response nobody waits for is a violation; a lost connection fails
  every waiting call.
"""

from __future__ import annotations

import pytest
from nrilib import mux_frame, request_payload, response_payload, ttrpc_frame
from twisted.python.failure import Failure

from hostpid.nri import api_pb2, ttrpc_pb2
from hostpid.nri.mux import MAX_PAYLOAD, Multiplexer
from hostpid.nri.ttrpc import (
    MESSAGE_LENGTH_MAX,
    ClientChannel,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    ProtocolViolation,
    RemoteError,
    ServerChannel,
    encode_frame,
)

SERVICE = "nri.pkg.api.v1alpha1.Plugin"


def test_encode_frame_is_ttrpc_header() -> None:
    assert encode_frame(7, 2, 0, b"abc") == b"\x00\x00\x00\x03\x00\x00\x00\x07\x02\x00abc"
    assert encode_frame(7, 2, 0, b"abc") == ttrpc_frame(7, 2, 0, b"abc")
    with pytest.raises(ValueError):
        encode_frame(1, 1, 0, b"\0" * (MESSAGE_LENGTH_MAX + 1))


def test_frames_split_at_every_byte() -> None:
    stream = (ttrpc_frame(1, 1, 1, b"first") + ttrpc_frame(3, 1, 0, b"")
              + ttrpc_frame(5, 3, 4, b"x" * 300))
    expected = [Frame(1, 1, 1, b"first"), Frame(3, 1, 0, b""), Frame(5, 3, 4, b"x" * 300)]
    assert FrameDecoder().feed(stream) == expected
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        assert decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) == expected, cut
    decoder = FrameDecoder()
    assert [f for i in range(len(stream)) for f in decoder.feed(stream[i:i + 1])] == expected


def test_frame_claiming_four_gibibytes_is_refused_from_its_header() -> None:
    decoder = FrameDecoder()
    header = ttrpc_frame(1, 1, 0, b"")[:0] + b"\xff\xff\xff\xff\x00\x00\x00\x01\x01\x00"
    assert decoder.feed(header[:9]) == []
    with pytest.raises(FrameTooLarge):
        decoder.feed(header[9:] + b"\0" * 1000)
    assert decoder.buffered == 0


def test_frame_at_the_cap_is_accepted_one_more_is_not() -> None:
    payload = b"\1" * MESSAGE_LENGTH_MAX
    assert FrameDecoder().feed(ttrpc_frame(1, 1, 0, payload)) == [Frame(1, 1, 0, payload)]
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed((MESSAGE_LENGTH_MAX + 1).to_bytes(4, "big") + b"\0\0\0\1\1\0")


def _serve(payloads: list[bytes]) -> tuple[list[bytes], list[tuple[str, str, bytes]]]:
    sent: list[bytes] = []
    seen: list[tuple[str, str, bytes]] = []

    def handler(service: str, method: str, payload: bytes) -> bytes:
        seen.append((service, method, payload))
        return b"answer:" + method.encode()

    channel = ServerChannel(sent.append, handler)
    for payload in payloads:
        channel.dataReceived(payload)
    return sent, seen


def test_server_answers_requests_on_their_stream() -> None:
    message = api_pb2.ConfigureRequest(runtime_name="r")
    sent, seen = _serve([ttrpc_frame(1, 1, 1, request_payload(SERVICE, "Configure", message)),
                         ttrpc_frame(5, 1, 0, request_payload(SERVICE, "Synchronize"))])
    assert seen == [(SERVICE, "Configure", message.SerializeToString()),
                    (SERVICE, "Synchronize", b"")]
    decoded = [FrameDecoder().feed(s)[0] for s in sent]
    assert [(f.stream_id, f.type, f.flags) for f in decoded] == [(1, 2, 0), (5, 2, 0)]
    responses = [ttrpc_pb2.Response.FromString(f.payload) for f in decoded]
    assert [(r.status.code, r.payload) for r in responses] == [
        (0, b"answer:Configure"), (0, b"answer:Synchronize")]


@pytest.mark.parametrize("frames", [
    pytest.param([ttrpc_frame(1, 2, 0, response_payload())], id="response"),
    pytest.param([ttrpc_frame(1, 3, 0, b"")], id="data"),
    pytest.param([ttrpc_frame(1, 9, 0, b"")], id="unknown-type"),
    pytest.param([ttrpc_frame(2, 1, 0, request_payload(SERVICE, "Configure"))], id="even-id"),
    pytest.param([ttrpc_frame(3, 1, 0, request_payload(SERVICE, "Configure")),
                  ttrpc_frame(3, 1, 0, request_payload(SERVICE, "Configure"))], id="reused-id"),
    pytest.param([ttrpc_frame(1, 1, 2, request_payload(SERVICE, "Configure"))], id="streaming"),
    pytest.param([ttrpc_frame(1, 1, 0, b"\xff\xff\xff")], id="garbage-request"),
])
def test_server_violations(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolViolation):
        _serve(frames)


def test_client_calls_and_responses() -> None:
    sent: list[bytes] = []
    client = ClientChannel(sent.append)
    first = client.call("svc", "A", b"1")
    second = client.call("svc", "B", b"2")
    frames = [FrameDecoder().feed(s)[0] for s in sent]
    assert [(f.stream_id, f.type, f.flags) for f in frames] == [(1, 1, 1), (3, 1, 1)]
    request = ttrpc_pb2.Request.FromString(frames[1].payload)
    assert (request.service, request.method, request.payload) == ("svc", "B", b"2")
    results: list[object] = []
    first.addBoth(results.append)
    second.addBoth(results.append)
    client.dataReceived(ttrpc_frame(3, 2, 0, response_payload(code=3, text="no")))
    client.dataReceived(ttrpc_frame(1, 2, 0, ttrpc_pb2.Response(payload=b"ok")
                                    .SerializeToString()))
    assert isinstance(results[0], Failure) and results[0].check(RemoteError)
    assert results[1] == b"ok"


def test_client_violations_and_lost_connection() -> None:
    client = ClientChannel(lambda data: None)
    with pytest.raises(ProtocolViolation):
        client.dataReceived(ttrpc_frame(1, 2, 0, response_payload()))
    client = ClientChannel(lambda data: None)
    client.call("svc", "A", b"")
    with pytest.raises(ProtocolViolation):
        client.dataReceived(ttrpc_frame(1, 1, 0, request_payload("svc", "A")))
    client = ClientChannel(lambda data: None)
    waiting = client.call("svc", "A", b"")
    results: list[object] = []
    waiting.addBoth(results.append)
    client.connectionLost(Failure(ConnectionError("gone")))
    assert isinstance(results[0], Failure) and results[0].check(ConnectionError)


def collecting(*conn_ids: int) -> tuple[Multiplexer, dict[int, bytes]]:
    got = {conn_id: b"" for conn_id in conn_ids}
    mux = Multiplexer(lambda data: None)
    for conn_id in conn_ids:
        mux.open(conn_id, lambda data, c=conn_id: got.__setitem__(c, got[c] + data))
    return mux, got


def test_mux_split_at_every_byte() -> None:
    stream = mux_frame(1, b"plugin bytes") + mux_frame(2, b"") + mux_frame(2, b"runtime")
    for cut in range(len(stream) + 1):
        mux, got = collecting(1, 2)
        mux.dataReceived(stream[:cut])
        mux.dataReceived(stream[cut:])
        assert got == {1: b"plugin bytes", 2: b"runtime"}, cut
    mux, got = collecting(1)
    for i in range(len(stream)):
        mux.dataReceived(stream[i:i + 1])
    assert got[1] == b"plugin bytes" and mux.dropped == len(b"runtime")


def test_mux_caps_and_reserved_id() -> None:
    mux = Multiplexer(lambda data: None)
    with pytest.raises(ProtocolViolation):
        mux.dataReceived(b"\x00\x00\x00\x01\xff\xff\xff\xff")
    mux = Multiplexer(lambda data: None)
    with pytest.raises(ProtocolViolation):
        mux.dataReceived(mux_frame(1, b"")[:4] + (MAX_PAYLOAD + 1).to_bytes(4, "big"))
    mux = Multiplexer(lambda data: None)
    with pytest.raises(ProtocolViolation):
        mux.dataReceived(mux_frame(0, b"x"))
    with pytest.raises(ValueError):
        Multiplexer(lambda data: None).open(0, lambda data: None)


def test_mux_send_splits_at_the_cap() -> None:
    written: list[bytes] = []
    mux = Multiplexer(written.append)
    send = mux.open(2, lambda data: None)
    data = bytes(range(256)) * ((MAX_PAYLOAD * 2) // 256 + 3)
    send(data)
    wire = b"".join(written)
    received = b""
    receiver = Multiplexer(lambda data: None)

    def collect(piece: bytes) -> None:
        nonlocal received
        received += piece

    receiver.open(2, collect)
    receiver.dataReceived(wire)
    assert received == data
    assert wire[:8] == (2).to_bytes(4, "big") + MAX_PAYLOAD.to_bytes(4, "big")
