"""
ttrpc, the RPC protocol NRI speaks, as byte-stream pieces a Twisted protocol
drives: framing with a size cap, a server side and a client side.

The wire, as containerd/ttrpc's C{channel.go} defines it:

  - every message is a 10-byte header then the payload: C{uint32} payload
    length, C{uint32} stream id, C{uint8} type (1 request, 2 response,
    3 data), C{uint8} flags, integers big-endian (C{readMessageHeader},
    C{writeMessageHeader});
  - a payload is at most 4 MiB (C{messageLengthMax = 4 << 20}).  ttrpc
    itself discards a longer one and answers C{ResourceExhausted}; here a
    header claiming more closes the connection before a byte of it is
    buffered: the other end is the runtime, which never sends one, so a
    frame that claims 4 GiB is a broken or hostile peer, and to NRI a
    closed connection is a dropped plugin, never a failed container;
  - a request's payload is a C{ttrpc.Request} (C{request.proto}: service,
    method, payload, timeout, metadata), a response's a C{ttrpc.Response}
    (a C{google.rpc.Status} and the payload);
  - a client's streams have odd ids, starting at 1 and growing by 2
    (C{client.go}, C{createStream}); a unary request carries the flag
    C{remote closed} (0x1); the server answers on the same id with flags 0
    (C{server.go}), and refuses a request whose id is even or not above the
    last one.

Nothing here knows NRI: L{ServerChannel} hands each request to a handler,
L{ClientChannel} turns calls into Deferreds.  Both write through a callable
(a multiplexed sub-connection, L{hostpid.nri.mux}) and raise
L{ProtocolViolation} from C{dataReceived} when the peer breaks the protocol:
the owner of the connection closes it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import attrs
from google.protobuf.message import DecodeError
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from hostpid.nri import ttrpc_pb2

HEADER = struct.Struct(">IIBB")
HEADER_LENGTH = HEADER.size
#: ttrpc's C{messageLengthMax}.
MESSAGE_LENGTH_MAX = 4 << 20

TYPE_REQUEST = 1
TYPE_RESPONSE = 2
TYPE_DATA = 3
TYPES = (TYPE_REQUEST, TYPE_RESPONSE, TYPE_DATA)

FLAG_REMOTE_CLOSED = 0x1
FLAG_REMOTE_OPEN = 0x2
FLAG_NO_DATA = 0x4

#: gRPC status codes used here (C{google.golang.org/grpc/codes}).
CODE_OK = 0


class ProtocolViolation(Exception):
    """The peer broke the protocol: the connection must be closed, nothing answered."""


class FrameTooLarge(ProtocolViolation):
    """A header claimed a payload above L{MESSAGE_LENGTH_MAX}."""


@attrs.frozen
class Frame:
    stream_id: int
    type: int
    flags: int
    payload: bytes


def encode_frame(stream_id: int, type: int, flags: int, payload: bytes) -> bytes:
    """One message on the wire; a payload above the cap is a bug of ours."""
    if len(payload) > MESSAGE_LENGTH_MAX:
        raise ValueError(f"payload of {len(payload)} bytes exceeds ttrpc's {MESSAGE_LENGTH_MAX}")
    return HEADER.pack(len(payload), stream_id, type, flags) + payload


class FrameDecoder:
    """
    Frames out of a byte stream, split anywhere.

    What it holds is bounded by the header and one capped payload, plus the
    bytes of one C{feed} beyond them: the length is checked as soon as the
    header is whole, before any of the payload is kept.
    """

    def __init__(self, max_length: int = MESSAGE_LENGTH_MAX) -> None:
        self.max_length = max_length
        self._buffer = bytearray()
        self._need: int | None = None  # payload length of the frame under way

    def feed(self, data: bytes) -> list[Frame]:
        """
        The frames C{data} completes, in order.

        @raise FrameTooLarge: a header claims more than the cap; nothing
            after it is read (the decoder is then useless).
        """
        self._buffer += data
        frames: list[Frame] = []
        while True:
            if self._need is None:
                if len(self._buffer) < HEADER_LENGTH:
                    return frames
                length, _, _, _ = HEADER.unpack_from(self._buffer)
                if length > self.max_length:
                    self._buffer = bytearray()
                    raise FrameTooLarge(
                        f"a ttrpc frame claims {length} bytes, over the cap of "
                        f"{self.max_length}")
                self._need = length
            if len(self._buffer) < HEADER_LENGTH + self._need:
                return frames
            length, stream_id, type_, flags = HEADER.unpack_from(self._buffer)
            end = HEADER_LENGTH + length
            frames.append(Frame(stream_id, type_, flags, bytes(self._buffer[HEADER_LENGTH:end])))
            del self._buffer[:end]
            self._need = None

    @property
    def buffered(self) -> int:
        """Bytes held (for tests of the bound)."""
        return len(self._buffer)


#: A request handler: (service, method, request payload) -> response payload.
#: It raises L{ProtocolViolation} for a request that must close the connection.
Handler = Callable[[str, str, bytes], bytes]


class ServerChannel:
    """
    The serving side of one ttrpc connection: requests in, responses out.

    Strict, because its peer is the runtime: a frame that is not a request,
    an even or non-increasing stream id (what ttrpc's own server refuses), or
    a payload that is no C{ttrpc.Request} raises L{ProtocolViolation}.
    Streaming (data frames, the flag C{remote open}) is not spoken: NRI's
    plugin service is unary.
    """

    def __init__(self, send: Callable[[bytes], None], handler: Handler) -> None:
        self._send = send
        self._handler = handler
        self._decoder = FrameDecoder()
        self._last_stream_id = 0

    def dataReceived(self, data: bytes) -> None:
        for frame in self._decoder.feed(data):
            self._frame(frame)

    def _frame(self, frame: Frame) -> None:
        if frame.type != TYPE_REQUEST:
            raise ProtocolViolation(f"ttrpc frame of type {frame.type} on the serving side")
        if frame.stream_id % 2 != 1 or frame.stream_id <= self._last_stream_id:
            raise ProtocolViolation(f"ttrpc request on stream {frame.stream_id} after "
                                    f"{self._last_stream_id}: ids must be odd and increase")
        if frame.flags & FLAG_REMOTE_OPEN:
            raise ProtocolViolation("a streaming ttrpc request: the plugin service is unary")
        self._last_stream_id = frame.stream_id
        request = ttrpc_pb2.Request()
        try:
            request.ParseFromString(frame.payload)
        except DecodeError as e:
            raise ProtocolViolation(f"a ttrpc request that does not decode: {e}") from None
        payload = self._handler(request.service, request.method, request.payload)
        response = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=CODE_OK), payload=payload)
        self._send(encode_frame(frame.stream_id, TYPE_RESPONSE, 0,
                                response.SerializeToString()))


class RemoteError(Exception):
    """The peer answered a call with a status other than OK."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"status {code}: {message}")
        self.code = code
        self.message = message


class ClientChannel:
    """
    The calling side of one ttrpc connection: unary calls as Deferreds.

    A response on a stream with no call waiting, or a frame that is not a
    response, raises L{ProtocolViolation}.  L{connectionLost} fails every
    call still waiting.
    """

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._decoder = FrameDecoder()
        self._next_stream_id = 1
        self._waiting: dict[int, Deferred[bytes]] = {}

    def call(self, service: str, method: str, payload: bytes,
             timeout_nano: int = 0) -> Deferred[bytes]:
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        request = ttrpc_pb2.Request(service=service, method=method, payload=payload,
                                    timeout_nano=timeout_nano)
        waiting: Deferred[bytes] = Deferred()
        self._waiting[stream_id] = waiting
        self._send(encode_frame(stream_id, TYPE_REQUEST, FLAG_REMOTE_CLOSED,
                                request.SerializeToString()))
        return waiting

    def dataReceived(self, data: bytes) -> None:
        for frame in self._decoder.feed(data):
            self._frame(frame)

    def _frame(self, frame: Frame) -> None:
        if frame.type != TYPE_RESPONSE:
            raise ProtocolViolation(f"ttrpc frame of type {frame.type} on the calling side")
        waiting = self._waiting.pop(frame.stream_id, None)
        if waiting is None:
            raise ProtocolViolation(f"a ttrpc response on stream {frame.stream_id}, "
                                    "which no call is waiting on")
        response = ttrpc_pb2.Response()
        try:
            response.ParseFromString(frame.payload)
        except DecodeError as e:
            raise ProtocolViolation(f"a ttrpc response that does not decode: {e}") from None
        if response.HasField("status") and response.status.code != CODE_OK:
            waiting.errback(RemoteError(response.status.code, response.status.message))
        else:
            waiting.callback(response.payload)

    def connectionLost(self, reason: Failure) -> None:
        waiting, self._waiting = self._waiting, {}
        for deferred in waiting.values():
            deferred.errback(reason)
