"""The sans-IO codec: every malformed request, and properties over any bytes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

import hostpid.values
from hostpid import wire


def test_request_bytes() -> None:
    assert wire.GET_HOST_PID_REQUEST == b"HPID\x00\x01\x00\x01"
    assert len(wire.GET_HOST_PID_REQUEST) == wire.REQUEST_SIZE


def test_ok_response_bytes() -> None:
    assert wire.encode_ok(4242) == b"HPID\x00\x01\x00\x00\x00\x00\x10\x92"


def test_invalid_response_bytes() -> None:
    assert wire.INVALID_REQUEST_RESPONSE == b"HPID\x00\x01\x00\x01\x00\x00\x00\x00"


def test_valid_request_parses() -> None:
    request = wire.parse_request(wire.GET_HOST_PID_REQUEST)
    assert request == wire.Request()
    assert request.problem() is None
    assert wire.is_valid_request(wire.GET_HOST_PID_REQUEST)


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"HPIX\x00\x01\x00\x01", wire.RequestProblem.BAD_MAGIC),
        (b"hpid\x00\x01\x00\x01", wire.RequestProblem.BAD_MAGIC),
        (b"HPID\x00\x00\x00\x01", wire.RequestProblem.BAD_VERSION),
        (b"HPID\x00\x02\x00\x01", wire.RequestProblem.BAD_VERSION),
        (b"HPID\x01\x01\x00\x01", wire.RequestProblem.BAD_VERSION),
        (b"HPID\x00\x01\x00\x00", wire.RequestProblem.BAD_COMMAND),
        (b"HPID\x00\x01\x00\x02", wire.RequestProblem.BAD_COMMAND),
        (b"HPID\x00\x01\x01\x01", wire.RequestProblem.BAD_COMMAND),
    ],
)
def test_malformed_requests(data: bytes, problem: str) -> None:
    assert wire.parse_request(data).problem() == problem
    assert not wire.is_valid_request(data)


@pytest.mark.parametrize("size", [0, 1, 7, 9, 12])
def test_request_of_wrong_length_is_refused(size: int) -> None:
    data = (wire.GET_HOST_PID_REQUEST * 2)[:size]
    with pytest.raises(ValueError, match="8 bytes"):
        wire.parse_request(data)
    assert not wire.is_valid_request(data)


@pytest.mark.parametrize("pid", [0, -1, 2**31, 2**32 - 1])
def test_ok_reply_never_carries_an_impossible_pid(pid: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        wire.encode_ok(pid)


def test_response_round_trip() -> None:
    response = wire.parse_response(wire.encode_ok(1))
    assert response == wire.Response(status=wire.Status.OK, pid=1)
    assert wire.parse_response(wire.encode_ok(wire.PID_MAX)).pid == wire.PID_MAX


@pytest.mark.parametrize("size", [0, 11, 13])
def test_response_of_wrong_length_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="12 bytes"):
        wire.parse_response(b"\0" * size)


@given(st.binary(min_size=8, max_size=8))
def test_any_eight_bytes_are_a_valid_request_or_get_status_1(data: bytes) -> None:
    """
    Any 8 bytes decode; they are either exactly the valid request, or their
    problem is named and the reply for them is status 1 with PID 0.
    """
    request = wire.parse_request(data)
    assert request.encode() == data
    if request.problem() is None:
        assert data == wire.GET_HOST_PID_REQUEST
        assert wire.is_valid_request(data)
    else:
        assert not wire.is_valid_request(data)
        magic, version, status, pid = struct.unpack("!4sHHI", wire.INVALID_REQUEST_RESPONSE)
        assert (magic, version, status, pid) == (b"HPID", 1, 1, 0)


@given(st.binary(min_size=12, max_size=12))
def test_any_twelve_bytes_decode_losslessly(data: bytes) -> None:
    response = wire.parse_response(data)
    assert response.encode() == data


@given(st.integers(min_value=1, max_value=wire.PID_MAX))
def test_ok_reply_round_trips_every_pid(pid: int) -> None:
    assert wire.parse_response(wire.encode_ok(pid)) == wire.Response(wire.Status.OK, pid)


def test_wire_imports_no_twisted() -> None:
    """
    The codec is sans-IO: no Twisted, no sockets, nothing of the project but
    the value base class (which imports nothing itself).
    """
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(wire))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported <= {"__future__", "enum", "struct", "hostpid.values"}
    values = ast.parse(inspect.getsource(hostpid.values))
    assert {
        alias.name for node in ast.walk(values) if isinstance(node, ast.ImportFrom | ast.Import)
        for alias in node.names
    } <= {"annotations", "Any", "TypeVar"}
