"""
The plugin as a runtime launches it (C{--nri-fd}) and as it leaves when
stopped (C{--drain}), with the real C{twistd hostpid-nri} process and the
fake runtime of L{nrilib} on real sockets.

Why each check exists:

- A runtime that launches a plugin from its plugin directory hands it one
  end of a connected socket pair as descriptor C{NRI_PLUGIN_SOCKET}
  (containerd/nri C{newLaunchedPlugin}); the plugin registers on it with
  C{NRI_PLUGIN_IDX} and adjusts, and exits when the runtime closes it (the
  runtime launches it again at its next start; a process left behind would
  hold nothing).  The shipped launcher does this with the environment NRI
  gives (three variables, nothing else) and refuses to run without it.
- C{--nri-fd} refuses a descriptor that is not a connected Unix stream
  socket at start, with the reason.
- A stopped plugin stays registered C{--drain} seconds (answering
  CreateContainer), so an instance stopped once its replacement reports
  ready never leaves the runtime without a plugin while it adds the new one;
  C{--drain 0} leaves at once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelfeatures import kernel_feature
from nrilib import FakeRuntime, NRIPluginProcess, RuntimeConnection, gpu_container, pod
from support import REPO, TWISTD, subprocess_env, wait_for

from hostpid.gate import GATE_ENV

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = kernel_feature("immutable_tmp")


LAUNCHER = REPO / "deploy" / "nri" / "hostpid-nri-launcher"


@pytest.fixture
def node(tmp_path: Path) -> dict[str, str]:
    """Host paths that exist, so that a GPU container is adjusted."""
    lock_parent, broker_dir = tmp_path / "vgpulock", tmp_path / "broker"
    lock_parent.mkdir()
    broker_dir.mkdir()
    return {"lock-parent": str(lock_parent), "broker-dir": str(broker_dir)}


def node_args(node: dict[str, str]) -> list[str]:
    return [arg for key, value in node.items() for arg in (f"--{key}", value)]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    runtime, plugin = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield runtime, plugin
    finally:
        runtime.close()
        plugin.close()


def adjusted(connection: RuntimeConnection) -> bool:
    response = connection.create_container(pod(), gpu_container())
    return len(response.adjust.mounts) == 2


def serve_one_launch(runtime: socket.socket, process: subprocess.Popen[bytes]) -> Any:
    """
    As the runtime: take the launched plugin's registration, have it adjust
    one GPU container, close the connection, and see the plugin exit 0.
    The registration is returned; the process is killed if it outlives this.
    """
    try:
        connection = RuntimeConnection(runtime)
        registration = connection.handshake(timeout=30)
        assert adjusted(connection)
        runtime.shutdown(socket.SHUT_RDWR)
        assert process.wait(30) == 0
        return registration
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_launched_plugin_registers_on_the_descriptor_and_exits_with_it(
        pair: tuple[socket.socket, socket.socket], node: dict[str, str]) -> None:
    runtime, plugin_end = pair
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [*TWISTD, "--nodaemon", "--pidfile=", "hostpid-nri", "--nri-fd",
             str(plugin_end.fileno()), "--plugin-index", "92", *node_args(node)],
            pass_fds=[plugin_end.fileno()], env=subprocess_env({GATE_ENV: "1"}),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        plugin_end.close()
        try:
            registration = serve_one_launch(runtime, process)
        finally:
            log.seek(0)
            output = log.read().decode(errors="replace")
    assert (registration.plugin_name, registration.plugin_idx) == ("hostpid", "92")
    assert "exiting (it launches the plugin again when it starts)" in output, output
    assert "Traceback" not in output, output


def test_the_launcher_runs_with_the_environment_nri_gives(
        pair: tuple[socket.socket, socket.socket], node: dict[str, str],
        tmp_path: Path) -> None:
    """
    The shipped launcher, its settings pointed at this run, started as NRI
    starts it: descriptor 3, three variables and nothing else.
    """
    runtime, plugin_end = pair
    twistd = tmp_path / "twistd"
    twistd.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} "
                      "-c 'from twisted.scripts.twistd import run; run()' \"$@\"\n")
    twistd.chmod(0o755)
    log = tmp_path / "launched.log"
    settings = {"TWISTD": str(twistd), "LOCK_PARENT": node["lock-parent"],
                "BROKER_DIR": node["broker-dir"], "LOG": str(log)}
    launcher = tmp_path / "92-hostpid"
    launcher.write_text("".join(
        f"{line.partition('=')[0]}={settings[line.partition('=')[0]]}\n"
        if line.partition("=")[0] in settings else line + "\n"
        for line in LAUNCHER.read_text().splitlines()))
    launcher.chmod(0o755)

    def as_fd_3() -> None:
        # Kept open by pass_fds, which subprocess applies after this.
        os.dup2(plugin_end.fileno(), 3)

    environment = {"NRI_PLUGIN_NAME": "hostpid", "NRI_PLUGIN_IDX": "92",
                   "NRI_PLUGIN_SOCKET": "3"}
    process = subprocess.Popen([str(launcher)], env=environment, preexec_fn=as_fd_3,
                               pass_fds=[3, plugin_end.fileno()], stdin=subprocess.DEVNULL)
    plugin_end.close()
    assert serve_one_launch(runtime, process).plugin_idx == "92"
    assert "registered with the runtime as 92-hostpid" in log.read_text()
    # Not started by a runtime: refused, with the reason.
    refused = subprocess.run([str(launcher)], env={}, capture_output=True, text=True,
                             timeout=30)
    assert refused.returncode == 2 and "run only by the runtime" in refused.stderr


def test_the_launcher_logs_to_syslog_unless_told_a_file(tmp_path: Path) -> None:
    """The runtime discards a launched plugin's output: by default the journal gets it."""
    argv = tmp_path / "argv"
    twistd = tmp_path / "twistd"
    twistd.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {argv}\n')
    twistd.chmod(0o755)
    launcher = tmp_path / "92-hostpid"
    launcher.write_text(LAUNCHER.read_text().replace(
        "TWISTD=/opt/hostpid/venv/bin/twistd\n", f"TWISTD={twistd}\n"))
    launcher.chmod(0o755)
    subprocess.run([str(launcher)], env={"NRI_PLUGIN_NAME": "hostpid", "NRI_PLUGIN_IDX": "92",
                                         "NRI_PLUGIN_SOCKET": "3"}, check=True, timeout=30)
    words = argv.read_text().splitlines()
    assert words[:5] == ["--nodaemon", "--pidfile=", "--syslog", "--prefix=hostpid-nri",
                         "hostpid-nri"], words
    assert words[words.index("--nri-fd") + 1] == "3"
    assert words[words.index("--plugin-index") + 1] == "92"


@pytest.mark.parametrize("descriptor", ["file", "listening", "closed"])
def test_nri_fd_refuses_what_is_not_a_connection(tmp_path: Path, descriptor: str) -> None:
    keep: list[object] = []
    if descriptor == "file":
        handle = open(tmp_path / "file", "w")  # noqa: SIM115 (closed below)
        keep.append(handle)
        fd = handle.fileno()
    elif descriptor == "listening":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "sock"))
        listener.listen()
        keep.append(listener)
        fd = listener.fileno()
    else:
        fd = 987
    try:
        result = subprocess.run(
            [*TWISTD, "--nodaemon", "--pidfile=", "hostpid-nri", "--nri-fd", str(fd)],
            pass_fds=[fd] if descriptor != "closed" else [], env=subprocess_env(),
            capture_output=True, text=True, timeout=60)
    finally:
        for item in keep:
            item.close()  # type: ignore[attr-defined]
    assert result.returncode == 1
    assert "--nri-fd: descriptor" in result.stdout + result.stderr


@pytest.mark.parametrize("drain", [None, "0"], ids=["default", "zero"])
def test_a_stopped_plugin_stays_registered_for_the_drain(
        tmp_path: Path, node: dict[str, str], drain: str | None) -> None:
    args = node_args(node) + (["--drain", drain] if drain is not None else [])
    with FakeRuntime(tmp_path / "nri.sock") as runtime, \
            NRIPluginProcess(runtime.path, args, metrics=tmp_path / "m.sock") as plugin:
        connection = runtime.accept(30)
        connection.handshake(timeout=30)
        wait_for(plugin.ready, "the plugin ready", 30)
        os.kill(plugin.pid, signal.SIGTERM)
        stopped = time.monotonic()
        if drain is None:
            # Still answering after the stop, then gone once the drain (1 s) is over.
            assert adjusted(connection)
            assert connection.wait_closed(30)
            assert time.monotonic() - stopped >= 1.0
        else:
            assert connection.wait_closed(30)
            assert time.monotonic() - stopped < 1.0
        assert plugin.process.wait(30) in (0, -signal.SIGTERM)


@pytest.mark.parametrize("value", ["-1", "31", "soon"])
def test_drain_out_of_bounds_is_refused(value: str) -> None:
    from twisted.python import usage

    from hostpid.nri.tap import Options

    with pytest.raises(usage.UsageError, match="--drain must be a number of seconds"):
        Options().parseOptions(["--drain", value])
