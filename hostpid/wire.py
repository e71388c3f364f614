"""
The host PID broker's wire format, protocol version 1, with no I/O in it.

One request and one response travel on each Unix stream connection; every
integer is unsigned and in network byte order::

    request  (8 bytes):  magic "HPID" | version u16 | command u16
    response (12 bytes): magic "HPID" | version u16 | status u16 | host PID u32

The format is fixed and byte-compatible with HAMi-core's C client, so this
module is deliberately tiny and pure: the server, the clients and the tests all
share it, and none of them has to know how the bytes are laid out.  It imports
nothing from Twisted and nothing else of the project but L{hostpid.values}.

Its named numbers are plain class attributes, not C{enum} members: an exec
probe (C{hostpid probe}, a fresh interpreter every few seconds on every
node) reads a reply with this module, and importing C{enum} would be CPU it
pays on every run.  The numbers are what travels; nothing here needs an
enum's type.
"""

from __future__ import annotations

import struct

from hostpid.values import Value

MAGIC = b"HPID"
VERSION = 1

REQUEST_SIZE = 8
RESPONSE_SIZE = 12

#: The largest PID a reply may carry (a C C{pid_t} is a signed 32-bit int).
PID_MAX = 2**31 - 1

_REQUEST = struct.Struct("!4sHH")
_RESPONSE = struct.Struct("!4sHHI")


class Command:
    """What a request asks for (a C{u16}).  Version 1 knows one command."""

    GET_HOST_PID = 1


class Status:
    """The outcome a response reports (a C{u16})."""

    OK = 0
    INVALID_REQUEST = 1


class RequestProblem:
    """Why eight bytes are not a valid version 1 request: one of these words."""

    BAD_MAGIC = "bad magic"
    BAD_VERSION = "bad version"
    BAD_COMMAND = "bad command"


class Request(Value):
    """A request as it travels: C{magic}, C{version} and C{command}."""

    __slots__ = ("command", "version", "magic")
    command: int
    version: int
    magic: bytes

    def __init__(
        self, command: int = Command.GET_HOST_PID, version: int = VERSION, magic: bytes = MAGIC
    ) -> None:
        self._set(command=command, version=version, magic=magic)

    def encode(self) -> bytes:
        return _REQUEST.pack(self.magic, self.version, self.command)

    def problem(self) -> str | None:
        """
        Say what makes this request invalid (a L{RequestProblem}), or
        C{None} for a valid one.
        Checked in the order the C client checks a reply: magic, version,
        then the command.
        """
        if self.magic != MAGIC:
            return RequestProblem.BAD_MAGIC
        if self.version != VERSION:
            return RequestProblem.BAD_VERSION
        if self.command != Command.GET_HOST_PID:
            return RequestProblem.BAD_COMMAND
        return None


class Response(Value):
    """A response as it travels: C{magic}, C{version}, C{status}, C{pid}."""

    __slots__ = ("status", "pid", "version", "magic")
    status: int
    pid: int
    version: int
    magic: bytes

    def __init__(self, status: int, pid: int, version: int = VERSION, magic: bytes = MAGIC) -> None:
        self._set(status=status, pid=pid, version=version, magic=magic)

    def encode(self) -> bytes:
        return _RESPONSE.pack(self.magic, self.version, self.status, self.pid)


#: The success reply's first 8 bytes; the PID follows, 4 bytes big-endian.
OK_PREFIX: bytes = _RESPONSE.pack(MAGIC, VERSION, Status.OK, 0)[:8]

#: The one request a client ever sends.
GET_HOST_PID_REQUEST: bytes = Request().encode()

#: The reply to anything that is not a valid request: status 1, PID 0.
INVALID_REQUEST_RESPONSE: bytes = Response(Status.INVALID_REQUEST, 0).encode()


def parse_request(data: bytes) -> Request:
    """
    Decode exactly C{REQUEST_SIZE} bytes.  Any eight bytes decode; whether
    they form a valid request is L{Request.problem}'s answer.

    @raise ValueError: C{data} is not exactly eight bytes long.
    """
    if len(data) != REQUEST_SIZE:
        raise ValueError(f"a request is {REQUEST_SIZE} bytes, got {len(data)}")
    magic, version, command = _REQUEST.unpack(data)
    return Request(command=command, version=version, magic=magic)


def is_valid_request(data: bytes) -> bool:
    """The fast yes/no: C{data} is exactly the version 1 get-host-PID request."""
    return data == GET_HOST_PID_REQUEST


def encode_ok(pid: int) -> bytes:
    """
    The success reply carrying C{pid}.

    @raise ValueError: C{pid} is not in 1..L{PID_MAX}: the broker never sends
        a PID it could not have received from the kernel.
    """
    if not 1 <= pid <= PID_MAX:
        raise ValueError(f"host PID out of range: {pid}")
    return OK_PREFIX + pid.to_bytes(4, "big")


def parse_response(data: bytes) -> Response:
    """
    Decode exactly C{RESPONSE_SIZE} bytes without judging them; the client's
    trust policy decides what a magic, version, status or PID means to it.

    @raise ValueError: C{data} is not exactly twelve bytes long.
    """
    if len(data) != RESPONSE_SIZE:
        raise ValueError(f"a response is {RESPONSE_SIZE} bytes, got {len(data)}")
    magic, version, status, pid = _RESPONSE.unpack(data)
    return Response(status=status, pid=pid, version=version, magic=magic)
