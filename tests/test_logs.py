"""
L{hostpid.logs.json_record}: the JSON object each log event becomes, from
real events (a L{Logger} and Twisted's legacy C{log.msg}/C{log.err}, the
two ways events reach twistd's observer).
"""

from __future__ import annotations

import io
import json
import math
from datetime import UTC, datetime
from typing import Any

from twisted.logger import Logger, LogLevel
from twisted.python import log as legacy_log
from twisted.python.failure import Failure

from hostpid.logs import JSONLinesObserver, json_line, json_record


def events_of(emit: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    emit(Logger(namespace="hostpid.example", observer=events.append))
    return events


def one(emit: Any) -> dict[str, object]:
    (event,) = events_of(emit)
    return json_record(event)


def test_the_mapped_keys_and_the_fields() -> None:
    record = one(lambda log: log.warn("hostpid-broker: {what} at {path}", what="stale",
                                      path="/run/x", count=3))
    assert record["level"] == "warn"
    assert record["logger"] == "hostpid.example"
    assert record["message"] == "hostpid-broker: stale at /run/x"
    assert (record["what"], record["path"], record["count"]) == ("stale", "/run/x", 3)
    assert not [key for key in record if key.startswith("log_")]
    assert list(record)[:4] == ["time", "level", "logger", "message"]


def test_time_is_rfc3339_utc() -> None:
    (event,) = events_of(lambda log: log.info("x"))
    event["log_time"] = 1_800_000_000.25
    assert json_record(event)["time"] == "2027-01-15T08:00:00.250000Z"
    moment = datetime.fromisoformat(str(json_record(event)["time"]))
    assert moment == datetime.fromtimestamp(1_800_000_000.25, tz=UTC)
    del event["log_time"]  # an event made by hand: stamped now
    before = datetime.now(UTC)
    stamped = datetime.fromisoformat(str(json_record(event)["time"]))
    assert before <= stamped <= datetime.now(UTC)


def test_every_level_by_its_name() -> None:
    for level in LogLevel.iterconstants():
        record = one(lambda log, level=level: log.emit(level, "x"))
        assert record["level"] == level.name


def test_values_json_cannot_hold_become_their_repr() -> None:
    class Thing:
        def __repr__(self) -> str:
            return "<thing>"

    record = one(lambda log: log.info("{a}", a=Thing(), b=b"\x00", c=math.nan,
                                      d={(1, 2): "tuple key"}, e=[1, "two", None]))
    assert record["a"] == "<thing>"
    assert record["b"] == repr(b"\x00")
    assert record["c"] == "nan"
    assert record["d"] == repr({(1, 2): "tuple key"})
    assert record["e"] == [1, "two", None]
    assert json.loads(json_line(events_of(lambda log: log.info("{a}", a=Thing()))[0]))


def test_a_field_named_like_a_mapped_key_does_not_overwrite_it() -> None:
    record = one(lambda log: log.info("the text", message="mine", logger=7, time="noon"))
    assert (record["message"], record["logger"]) == ("the text", "hostpid.example")
    assert (record["field_message"], record["field_logger"], record["field_time"]) == \
        ("mine", 7, "noon")
    assert str(record["time"]).endswith("Z")


def test_a_failure_gives_its_traceback() -> None:
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError:
        failure = Failure()
    record = one(lambda log: log.failure("hostpid-broker: it broke", failure))
    assert record["level"] == "critical"
    assert record["message"] == "hostpid-broker: it broke"
    assert "ZeroDivisionError" in str(record["traceback"])


def test_legacy_events_lose_their_legacy_repeats() -> None:
    """
    twistd and parts of Twisted still log through C{twisted.python.log}:
    its C{message} tuple, C{time}, C{isError} and C{system} repeat what
    the record says; C{system} stays when it names something.
    """
    events: list[dict[str, Any]] = []
    legacy_log.addObserver(events.append)
    try:
        legacy_log.msg("plain", system="SomeProtocol,3", extra="kept")
        legacy_log.err(ValueError("bad"), "while testing")
    finally:
        legacy_log.removeObserver(events.append)
    plain = json_record(events[0])
    assert plain["message"] == "plain"
    assert plain["level"] == "info"
    assert plain["logger"] == "log_legacy"
    assert plain["system"] == "SomeProtocol,3"
    assert plain["extra"] == "kept"
    assert not {"isError", "field_message", "field_time", "format"} & plain.keys()
    error = json_record(events[1])
    assert error["level"] == "critical"
    assert "while testing" in str(error["message"])
    assert "ValueError: bad" in str(error["traceback"])


def test_the_observer_writes_whole_lines_and_flushes() -> None:
    out = io.StringIO()
    logger = Logger(namespace="hostpid.example", observer=JSONLinesObserver(out))
    logger.info("one\ntwo {n}", n=1)
    logger.info("three")
    lines = out.getvalue().split("\n")
    assert lines[-1] == ""
    assert [json.loads(line)["message"] for line in lines[:-1]] == ["one\ntwo 1", "three"]
