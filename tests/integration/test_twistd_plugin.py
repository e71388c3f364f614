"""
C{twistd hostpid-broker} as an operator runs it: the gate, options, startup
refusals (one clear line, non-zero exit) and signals.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
from support import (
    TWISTD,
    BrokerProcess,
    as_user_argv,
    ask_pid,
    hostpid_argv,
    require_root,
    running_broker,
    subprocess_env,
    twistd_argv,
    wait_for,
)


@pytest.mark.parametrize("value", ["", "0", "true", "false", "01", " 1", "1 ", "yes", "1\n"])
def test_gate_not_exactly_1_creates_nothing(tmp_path: Path, value: str) -> None:
    directory = tmp_path / "broker"
    with BrokerProcess(directory, gate=value) as broker:
        wait_for(lambda: "disabled" in broker.output(), "the disabled message")
        assert broker.process.poll() is None, "the service keeps running"
        assert not directory.exists(), "no directory, lock or socket is created"
        broker.terminate()
    assert not directory.exists()


def test_gate_unset_creates_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    with BrokerProcess(directory, gate=None) as broker:
        wait_for(lambda: "disabled" in broker.output(), "the disabled message")
        broker.terminate()
    assert not directory.exists()


def test_gate_1_serves(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "broker", gate="1") as broker:
        broker.wait_listening()
        assert ask_pid(broker.socket_path) == os.getpid()
        broker.terminate()


def test_the_broker_loads_no_tls_stack(tmp_path: Path) -> None:
    """
    The broker never uses TLS, but Twisted imported pyOpenSSL (cryptography's
    Rust extension, libcrypto) wherever it could offer it: 48.1 MB of RSS
    where 35.0 MB serve.  A serving broker, its metrics port included, maps
    none of it, and stays under 40 MiB without the metrics port.
    """
    with BrokerProcess(tmp_path / "broker", gate="1") as broker:
        broker.wait_listening()
        assert ask_pid(broker.socket_path) == os.getpid()
        maps = Path(f"/proc/{broker.pid}/maps").read_text()
        status = Path(f"/proc/{broker.pid}/status").read_text()
        rss = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("VmRSS:")))
        broker.terminate()
    assert "cryptography" not in maps and "_cffi_backend" not in maps, "no pyOpenSSL"
    assert rss < 40 * 1024, f"{rss} kB"
    with BrokerProcess(tmp_path / "metrics", ["--metrics", "tcp:0:interface=127.0.0.1"],
                       gate="1") as broker:
        broker.wait_listening()
        assert "cryptography" not in Path(f"/proc/{broker.pid}/maps").read_text()
        broker.terminate()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-connections", "0"], "--max-connections: must be a whole number from 1"),
        (["--max-connections", "many"], "--max-connections: must be a whole number from 1"),
        (["--max-connections", "-3"], "--max-connections: must be a whole number from 1"),
        (["--max-waiting-per-peer", "0"], "--max-waiting-per-peer: must be a whole number from 1"),
        (["--deadline", "-1"], "--deadline: must be a positive number of seconds"),
        (["--deadline", "nan"], "--deadline: must be a positive number of seconds"),
        (["--deadline", "1e12"], "--deadline: must be a positive number of seconds"),
        (["--no-such-option"], "no-such-option"),
    ],
)
def test_bad_option_exits_non_zero_with_a_message(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = subprocess.run(
        twistd_argv("--directory", str(tmp_path / "broker"), *args),
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert not (tmp_path / "broker").exists()
    if args[0] != "--no-such-option":  # twistd's own usage error for an unknown option
        assert result.stderr == f"hostpid-broker: cannot start: {args[0]}: " + (
            result.stderr.split(": ", 3)[3]
        ), "one line on stderr, naming the option"
        assert result.stderr.count("\n") == 1


def run_twistd(
    *broker_args: str, argv_prefix: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """A twistd broker run to its end, standard output and error kept apart."""
    return subprocess.run(
        [*argv_prefix, *twistd_argv(*broker_args)],
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        cwd=tempfile.gettempdir(),
    )


def assert_refused_alone_on_stderr(result: subprocess.CompletedProcess[str], line: str) -> None:
    """
    The refusal as a supervisor shows it: exit 1, the one line alone on
    stderr with no timestamp; the log (stdout under --nodaemon) keeps its
    own record of the same line, and there is no traceback anywhere.
    """
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr == line + "\n", result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    records = [entry for entry in result.stdout.splitlines() if "cannot start" in entry]
    assert len(records) == 1, result.stdout
    assert records[0].endswith("] " + line)


def test_refusal_is_one_line_alone_on_stderr(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    directory.mkdir()
    (directory / "broker.sock").write_text("x")
    result = run_twistd("--directory", str(directory))
    assert_refused_alone_on_stderr(
        result,
        f"hostpid-broker: cannot start: {directory}/broker.sock: is a regular file, not a "
        "socket; refusing to replace it (left untouched)",
    )
    assert (directory / "broker.sock").read_text() == "x"


def test_symlinked_directory_refusal_alone_on_stderr(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "broker").symlink_to(tmp_path / "elsewhere")
    result = run_twistd("--directory", str(tmp_path / "broker"))
    refused = f"hostpid-broker: cannot start: {tmp_path}/broker: is a symlink"
    assert result.stderr.startswith(refused)
    assert result.stderr.count("\n") == 1
    assert_refused_alone_on_stderr(result, result.stderr.rstrip("\n"))


def test_lock_held_refusal_alone_on_stderr(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    with running_broker(directory):
        # Without its control socket the running broker cannot hand over.
        wait_for(lambda: (directory / "handover.sock").exists(), "the control socket")
        (directory / "handover.sock").unlink()
        result = run_twistd("--directory", str(directory))
    assert result.returncode == 1
    assert result.stderr.startswith(f"hostpid-broker: cannot start: {directory}/broker.lock: ")
    assert result.stderr.count("\n") == 1
    assert_refused_alone_on_stderr(result, result.stderr.rstrip("\n"))


def test_metrics_port_in_use_refusal_alone_on_stderr(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_twistd(
            "--directory", str(tmp_path / "broker"),
            "--metrics", f"tcp:{port}:interface=127.0.0.1",
        )
    assert_refused_alone_on_stderr(
        result,
        f"hostpid-broker: cannot start: --metrics tcp:{port}:interface=127.0.0.1: the metrics "
        f"endpoint cannot listen: Couldn't listen on 127.0.0.1:{port}: "
        "[Errno 98] Address already in use.",
    )
    assert not (tmp_path / "broker").exists()


def test_default_directory_as_non_root_exits_non_zero() -> None:
    require_root()  # to become UID 1000
    result = run_twistd(argv_prefix=as_user_argv(1000, []))
    assert_refused_alone_on_stderr(
        result,
        "hostpid-broker: cannot start: /var/run/hami/hostpid: the default broker directory "
        "requires effective UID 0 (running as UID 1000)",
    )


def test_non_root_broker_serves_its_own_directory(public_tmp: Path) -> None:
    """Another --directory takes the effective UID as the expected UID."""
    require_root()
    home = public_tmp / "home"
    home.mkdir()
    os.chown(home, 1000, 1000)
    with BrokerProcess(home / "broker", argv_prefix=as_user_argv(1000, [])) as broker:
        broker.wait_listening()
        assert os.lstat(broker.socket_path).st_uid == 1000
        assert os.lstat(home / "broker" / "broker.lock").st_uid == 1000
        assert ask_pid(broker.socket_path) == os.getpid()
        broker.terminate()
    assert not (home / "broker" / "broker.sock").exists()


def test_service_is_composable_in_a_larger_application(tmp_path: Path) -> None:
    """A device plugin can add the broker to its own MultiService."""
    directory = tmp_path / "broker"
    script = f"""
import os, sys
from twisted.application.service import MultiService
from twisted.internet import reactor
from hostpid.broker.service import BrokerService
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from support import ask_pid

top = MultiService()
broker = BrokerService(directory={str(directory)!r}, reactor=reactor,
                       environ={{"LIBVGPU_HOSTPID_BROKER": "1"}})
broker.setServiceParent(top)

def check():
    from twisted.internet.threads import deferToThread
    d = deferToThread(ask_pid, {str(directory / "broker.sock")!r})
    def done(pid):
        print("answered", pid == os.getpid(), flush=True)
        return top.stopService()
    d.addCallback(done)
    d.addBoth(lambda _: reactor.stop())

top.startService()
reactor.callWhenRunning(check)
reactor.run()
print("socket left", os.path.exists({str(directory / "broker.sock")!r}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "answered True" in result.stdout
    assert "socket left False" in result.stdout


def test_refusal_while_building_the_service_alone_on_stderr(tmp_path: Path) -> None:
    """
    A refusal raised while the plugin builds its services (before twistd
    begins logging, where a bad option value would be refused) takes the
    same path: one line on stderr, exit 1.
    """
    code = (
        "import hostpid.tap as tap\n"
        "from hostpid.errors import PathRuleError\n"
        "def refuse(**options):\n"
        "    raise PathRuleError('--example', 'refused while building the service')\n"
        "tap.BrokerService = refuse\n"
        "from twisted.scripts.twistd import run\n"
        "run()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--nodaemon", "--pidfile=", "hostpid-broker",
         "--directory", str(tmp_path / "broker")],
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir(),
    )
    assert result.returncode == 1, result
    assert result.stderr == (
        "hostpid-broker: cannot start: --example: refused while building the service\n"
    )
    assert "Traceback" not in result.stdout


def test_cdi_refusal_alone_on_stderr(tmp_path: Path) -> None:
    """The CDI issue's refusals take the same path (every PathRuleError does)."""
    require_root()
    (tmp_path / "real-cdi").mkdir()
    (tmp_path / "cdi").symlink_to(tmp_path / "real-cdi")
    result = run_twistd(
        "--directory", str(tmp_path / "broker"), "--cdi-dir", str(tmp_path / "cdi"),
        "--lock-parent", str(tmp_path / "vgpulock"),
    )
    assert result.stderr.startswith(f"hostpid-broker: cannot start: {tmp_path}/cdi: "), result
    assert result.stderr.count("\n") == 1
    assert_refused_alone_on_stderr(result, result.stderr.rstrip("\n"))
    assert list((tmp_path / "real-cdi").iterdir()) == []


@pytest.mark.parametrize("plugin", ["hostpid-broker", "hostpid-nri", "hostpid-webhook"])
def test_version_is_hostpids(plugin: str) -> None:
    """
    C{twistd PLUGIN --version}, for each of the project's three plugins:
    this package's version first, the line C{hostpid --version} prints (the
    NRI plugin's and the webhook's printed Twisted's version alone), then
    Twisted's.
    """
    from twisted import copyright

    hostpid = subprocess.run(hostpid_argv("--version"), env=subprocess_env(),
                             capture_output=True, text=True, timeout=60)
    assert hostpid.returncode == 0 and hostpid.stdout.startswith("hostpid "), hostpid
    done = subprocess.run(
        [*TWISTD, plugin, "--version"], env=subprocess_env(),
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{hostpid.stdout}Twisted {copyright.version}\n"
