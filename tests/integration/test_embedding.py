"""
The embedding example (C{docs/examples/broker-with-web.tac}), run as an
operator runs it: under C{twistd -ny}, with a private broker directory and a
private web socket given through its environment variables; both services
are queried, then it is stopped with SIGTERM.  Also its refusal (one line on
stderr) and its fatal error after startup (the whole process exits 1), as
C{docs/embedding.md} describes, and that the example in the doc is the file.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest_twisted  # type: ignore[import-untyped]
from support import REPO, TWISTD, WAIT_SECONDS, ask_pid, subprocess_env, wait_for
from twisted.application.service import MultiService
from twisted.internet.defer import maybeDeferred

from hostpid import BrokerService

EXAMPLE = REPO / "docs" / "examples" / "broker-with-web.tac"
EMBEDDING_DOC = REPO / "docs" / "embedding.md"


class Example:
    """The example under C{twistd -ny}, its output and error kept apart in files."""

    def __init__(self, tmp_path: Path, gate: str = "1") -> None:
        self.directory = tmp_path / "broker"
        self.web = tmp_path / "web.sock"
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        env = subprocess_env(
            LIBVGPU_HOSTPID_BROKER=gate,
            HOSTPID_BROKER_DIRECTORY=str(self.directory),
            HOSTPID_WEB_ENDPOINT=f"unix:{self.web}",
        )
        self.process = subprocess.Popen(
            [*TWISTD, "-ny", str(EXAMPLE), "--pidfile="],
            env=env, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err,
            cwd=tmp_path,
        )

    def output(self) -> tuple[str, str]:
        texts = []
        for stream in (self._out, self._err):
            stream.seek(0)
            texts.append(stream.read().decode("utf-8", "replace"))
        return texts[0], texts[1]

    def wait(self) -> int:
        try:
            return self.process.wait(WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the example did not exit: {self.output()}") from None

    def get(self) -> tuple[int, str]:
        """GET / from the web site over its Unix socket: status and body."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(WAIT_SECONDS)
            sock.connect(str(self.web))
            sock.sendall(b"GET / HTTP/1.0\r\nHost: example\r\n\r\n")
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
        head, _, body = data.decode().partition("\r\n\r\n")
        return int(head.split()[1]), body

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._out.close()
        self._err.close()


@contextmanager
def example(tmp_path: Path, gate: str = "1") -> Iterator[Example]:
    running = Example(tmp_path, gate)
    try:
        yield running
    finally:
        running.close()


def serving(running: Example) -> bool:
    if running.process.poll() is not None:
        raise AssertionError(f"the example exited {running.process.returncode}: {running.output()}")
    return running.web.exists() and ask_pid(running.directory / "broker.sock") is not None


def test_serves_both_and_stops_on_sigterm(tmp_path: Path) -> None:
    with example(tmp_path) as running:
        wait_for(lambda: serving(running), "the broker and the site")
        # The broker answers a caller outside the process with that caller's PID...
        assert ask_pid(running.directory / "broker.sock") == os.getpid()
        # ...and the site, which asks the broker in its own process, with its PID.
        assert running.get() == (200, f"{running.process.pid}\n")
        running.process.send_signal(signal.SIGTERM)
        assert running.wait() == -signal.SIGTERM  # a shell reports 143
        out, err = running.output()
    assert "Traceback" not in out + err
    assert "hostpid-broker: socket removed" in out
    assert not (running.directory / "broker.sock").exists()
    assert not running.web.exists()


def test_the_site_falls_back_when_the_broker_is_disabled(tmp_path: Path) -> None:
    with example(tmp_path, gate="0") as running:
        wait_for(running.web.exists, "the site")
        assert running.get() == (503, "gate: LIBVGPU_HOSTPID_BROKER='0'\n")
        assert not running.directory.exists(), "a disabled broker creates nothing"
        running.process.send_signal(signal.SIGTERM)
        assert running.wait() == -signal.SIGTERM


def test_refusal_is_one_line_on_stderr(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    directory.mkdir()
    (directory / "broker.sock").write_text("not a socket")
    with example(tmp_path) as running:
        assert running.wait() == 1
        out, err = running.output()
    assert err == (
        f"hostpid-broker: cannot start: {directory}/broker.sock: is a regular file, not a "
        "socket; refusing to replace it (left untouched)\n"
    )
    assert "Traceback" not in out
    assert (directory / "broker.sock").read_text() == "not a socket"


def test_fatal_error_after_startup_ends_the_process(tmp_path: Path) -> None:
    """No onFatal in the example: the broker's failure takes the process down, status 1."""
    with example(tmp_path) as running:
        wait_for(lambda: serving(running), "the broker and the site")
        os.unlink(running.directory / "broker.sock")
        assert running.wait() == 1
        out, _ = running.output()
    assert "the socket was removed while the broker was serving" in out
    assert not running.web.exists(), "the site was stopped on the way out"


def test_the_doc_shows_the_example_file() -> None:
    found = re.search(
        r"^<!-- example-file: docs/examples/broker-with-web.tac -->\n(?:<!--.*-->\n)?"
        r"```python\n(.*?)^```$",
        EMBEDDING_DOC.read_text(), re.M | re.S,
    )
    assert found, "docs/embedding.md does not show the example"
    assert found.group(1) == EXAMPLE.read_text()


@pytest_twisted.ensureDeferred
async def test_on_fatal_is_yours(tmp_path: Path, clean_reactor: None) -> None:
    """
    With onFatal the process goes on: called once, the broker stays failed,
    and stopping it still releases the lock (a new broker can start).
    """
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    directory = str(tmp_path / "broker")
    calls: list[bool] = []
    top = MultiService()
    broker = BrokerService(
        directory=directory, reactor=reactor, environ={"LIBVGPU_HOSTPID_BROKER": "1"},
        onFatal=lambda: calls.append(broker.ready()), watchInterval=0.01,
    )
    broker.setServiceParent(top)
    top.startService()
    try:
        assert broker.ready()
        os.unlink(broker.socketPath)
        for _ in range(int(WAIT_SECONDS / 0.01)):
            if calls:
                break
            await deferLater(reactor, 0.01, lambda: None)
        assert calls == [False]
        assert broker.failed and not broker.ready()
    finally:
        await maybeDeferred(top.stopService)
    assert calls == [False], "called once"
    again = BrokerService(
        directory=directory, reactor=reactor, environ={"LIBVGPU_HOSTPID_BROKER": "1"},
        onFatal=lambda: None,
    )
    again.startService()
    try:
        assert again.ready()
    finally:
        await maybeDeferred(again.stopService)
