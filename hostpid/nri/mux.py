"""
NRI's connection multiplexer: one Unix connection carrying two byte streams.

An external NRI plugin connects once to the runtime's socket; both ends
wrap the connection in containerd/nri's C{pkg/net/multiplex} and open two
virtual connections on it (C{ttrpc.go}): L{PLUGIN_SERVICE_CONN} (1), where the
runtime calls the plugin's service, and L{RUNTIME_SERVICE_CONN} (2), where
the plugin calls the runtime's.  Id 0 is reserved (C{reservedConnID}).

The wire (C{mux.go}, C{write} and C{reader}): each frame is an 8-byte header,
C{uint32} connection id then C{uint32} payload length, big-endian, then the
payload.  A writer splits its data into frames of at most
L{MAX_PAYLOAD} bytes (ttrpc's 10-byte header plus its 4 MiB cap), so a
sub-connection is a byte stream: a ttrpc message may span frames and a frame
may end inside one.  Go's reader allocates whatever a header claims; here a
header claiming more than L{MAX_PAYLOAD} is a L{ProtocolViolation} before a
byte of it is read, and payload bytes are passed through as they arrive
(nothing is buffered at this level beyond a partial header).

Frames for an id nobody opened are dropped unread, as Go's reader drops
them (a newer runtime may open more ids); id 0 is a violation.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from hostpid.nri.ttrpc import HEADER_LENGTH, MESSAGE_LENGTH_MAX, ProtocolViolation

HEADER = struct.Struct(">II")
HEADER_LENGTH_MUX = HEADER.size
#: C{maxPayloadSize = ttrpcMessageHeaderLength + ttrpcMessageLengthMax}.
MAX_PAYLOAD = HEADER_LENGTH + MESSAGE_LENGTH_MAX

RESERVED_CONN = 0
PLUGIN_SERVICE_CONN = 1
RUNTIME_SERVICE_CONN = 2

Receiver = Callable[[bytes], None]


class Multiplexer:
    """
    The multiplexing layer of one trunk connection.

    @param write: writes bytes to the trunk (the transport's C{write}).
    """

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._receivers: dict[int, Receiver] = {}
        self._header = bytearray()
        self._conn = 0
        self._remaining = 0  # payload bytes of the current frame still to come
        #: Payload bytes dropped for ids nobody opened.
        self.dropped = 0

    def open(self, conn_id: int, receiver: Receiver) -> Callable[[bytes], None]:
        """
        Route C{conn_id}'s bytes to C{receiver}; return the function that
        sends on it.  Opening is local, as in NRI: nothing goes on the wire.
        """
        if conn_id == RESERVED_CONN:
            raise ValueError("connection id 0 is reserved")
        self._receivers[conn_id] = receiver
        return lambda data: self.send(conn_id, data)

    def send(self, conn_id: int, data: bytes) -> None:
        view = memoryview(data)
        chunks = []
        while True:
            piece = view[:MAX_PAYLOAD]
            chunks.append(HEADER.pack(conn_id, len(piece)))
            chunks.append(bytes(piece))
            view = view[MAX_PAYLOAD:]
            if not view:
                break
        self._write(b"".join(chunks))

    def dataReceived(self, data: bytes) -> None:
        """
        Demultiplex C{data}; a receiver's L{ProtocolViolation} passes through.

        @raise ProtocolViolation: a header for id 0 or claiming more than
            L{MAX_PAYLOAD}.
        """
        view = memoryview(data)
        while view:
            if self._remaining == 0 and len(self._header) < HEADER_LENGTH_MUX:
                take = HEADER_LENGTH_MUX - len(self._header)
                self._header += view[:take]
                view = view[take:]
                if len(self._header) < HEADER_LENGTH_MUX:
                    return
                conn_id, length = HEADER.unpack(self._header)
                self._header = bytearray()
                if conn_id == RESERVED_CONN:
                    raise ProtocolViolation("a multiplexed frame on the reserved id 0")
                if length > MAX_PAYLOAD:
                    raise ProtocolViolation(
                        f"a multiplexed frame claims {length} bytes, over the cap of "
                        f"{MAX_PAYLOAD}")
                self._conn, self._remaining = conn_id, length
                continue
            piece = view[:self._remaining]
            view = view[self._remaining:]
            self._remaining -= len(piece)
            receiver = self._receivers.get(self._conn)
            if receiver is None:
                self.dropped += len(piece)
            else:
                receiver(bytes(piece))
