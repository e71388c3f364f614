"""
The C{hostpid} command line: what it says about itself (C{--version}, help,
usage errors), and C{hostpid probe}, the operator's check of a running
broker, against real brokers and real failures.

Probes run as separate processes (C{python -m hostpid.cli}): a healthy probe
must be answered with its own PID, and only a separate process has a PID the
test knows in advance of nothing (C{Popen.pid}).
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from importlib.metadata import version
from pathlib import Path

import pytest
from clienttools import OTHER_UID, as_other_uid_argv, fake_broker, make_directory, response
from support import (
    BrokerProcess,
    DefaultLayout,
    hostpid_argv,
    require_root,
    running_broker,
    stale_socket,
    subprocess_env,
    wait_for,
)

import hostpid
from hostpid import cli, defaults

ENABLED = {"LIBVGPU_HOSTPID_BROKER": "1"}

#: What C{hostpid probe} must not import beyond what the interpreter has
#: loaded before the command runs: each costs the exec probe CPU on every
#: run.  attrs (typing, inspect), Twisted, zope, argparse,
#: importlib.metadata; the standard library's socket (enum, selectors,
#: collections, array: the probe uses the C module _socket), ctypes (the
#: sandbox check's fstatfs is the C helper's), and re (pip's console-script
#: wrapper imported it; the command is a plain script).
PROBE_NEVER_LOADS = (
    "attr", "attrs", "twisted", "zope", "argparse", "typing", "inspect", "prometheus_client",
    "importlib.metadata", "socket", "enum", "ctypes", "selectors", "collections", "re",
)


#: C{PROC_SUPER_MAGIC} (include/uapi/linux/magic.h): procfs's C{f_type}.
PROC_SUPER_MAGIC = 0x9FA0


def heavy_modules(loaded: set[str], before: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The modules of L{PROBE_NEVER_LOADS} (or in their packages) loaded, less C{before}."""
    return sorted(
        name for name in loaded - before
        if name in PROBE_NEVER_LOADS or name.split(".")[0] in PROBE_NEVER_LOADS
    )


def run_cli(*argv: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    status = cli.main(list(argv), stdout, stderr)
    return status, stdout.getvalue(), stderr.getvalue()


def run_hostpid(
    *args: str, env: Mapping[str, str] | None = None, prefix: Sequence[str] = ()
) -> tuple[subprocess.CompletedProcess[str], int]:
    """C{hostpid ARGS} in its own process: the outcome and that process's PID."""
    environment = subprocess_env(dict(ENABLED if env is None else env))
    if env is not None and "LIBVGPU_HOSTPID_BROKER" not in env:
        environment.pop("LIBVGPU_HOSTPID_BROKER", None)
    process = subprocess.Popen(
        [*prefix, *hostpid_argv(*args)], env=environment, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    try:
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), process.pid


def healthy_line(socket_path: Path | str, pid: int, gate: str = "LIBVGPU_HOSTPID_BROKER='1'"
                 ) -> str:
    """The probe's healthy line; C{gate} is what it reports of its own environment."""
    return (
        f"{socket_path}: ok: answered PID {pid} (this process); socket, uid 0, mode 0666; "
        f"gate here: {gate}\n"
    )


# --- What the command says about itself. ---


class TestSelfDescription:
    def test_version_is_the_distributions(self) -> None:
        done, _ = run_hostpid("--version")
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"hostpid {version('hostpid-broker')}\n"
        assert re.fullmatch(r"hostpid \d+\.\d+\.\d+\n", done.stdout)

    def test_version_loads_no_heavy_module(self) -> None:
        """
        C{hostpid --version} is one line: it built the whole parser first,
        importing attrs, the CDI spec's modules and importlib.metadata (123
        ms of CPU where the interpreter's own start is 27; now 36).  What it
        loads beyond the interpreter's start is held to the probe's list.
        """
        code = ("import sys\nbefore = set(sys.modules)\nfrom hostpid.cli import main\n"
                "try:\n    status = main(['--version'])\n"
                "except SystemExit as e:\n    status = e.code\n"
                "print(status, *sorted(set(sys.modules) - before), file=sys.stderr)\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env=subprocess_env(), check=False)
        status, *loaded = done.stderr.strip().splitlines()[-1].split()
        assert status == "0" and done.stdout == f"hostpid {hostpid.__version__}\n"
        assert heavy_modules(set(loaded)) == []

    def test_every_subcommand_and_option_is_described(self) -> None:
        parser = cli.build_parser()
        (commands,) = [
            action for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
        ]
        assert set(commands.choices) == {"query", "probe", "doctor", "prepare-lock-parent", "cdi",
                                         "allocate", "nri-probe"}
        summaries = {choice.dest: choice.help for choice in commands._choices_actions}
        for name, subparser in commands.choices.items():
            assert summaries[name], f"{name}: no summary in `hostpid --help`"
            assert subparser.description, f"{name}: no description in `hostpid {name} --help`"
            options = [a for a in subparser._actions if a.option_strings != ["-h", "--help"]]
            assert options or name == "doctor"
            for action in options:
                assert action.help and "(default: %(default)s)" in action.help, (
                    name, action.option_strings
                )
                rendered = subparser.format_help()
                assert str(action.default) in " ".join(rendered.split()), (name, action.dest)

    @pytest.mark.parametrize("command", ["query", "probe", "nri-probe"])
    @pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "1e12", "3601", "soon"])
    def test_a_bad_timeout_names_the_option(
        self, command: str, timeout: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exited:
            cli.main([command, "--timeout", timeout])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == (
            f"hostpid {command}: --timeout must be a positive number of seconds, "
            f"at most 3600, got {timeout!r}"
        )
        assert "deadline" not in err

    def test_query_failure_names_the_path_checked(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "1")
        missing = tmp_path / "none"
        status, out, err = run_cli("query", "--socket", str(missing / "broker.sock"))
        assert (status, out) == (1, "")
        assert err == (
            f"hostpid query: directory check failed: {missing}: "
            "cannot open: ENOENT (No such file or directory)\n"
        )


# --- hostpid probe: healthy. ---


@pytest.fixture
def root_directory(tmp_path: Path) -> Path:
    """A root-owned 0711 broker directory (the tests run as root in CI)."""
    require_root()
    return tmp_path / "broker"


class TestProbeHealthy:
    def test_a_real_broker_answers_the_probe_with_its_own_pid(
        self, root_directory: Path
    ) -> None:
        with running_broker(root_directory) as broker:
            done, pid = run_hostpid("probe", "--socket", str(broker.socket_path))
        assert done.returncode == 0, done.stderr
        assert done.stdout == healthy_line(broker.socket_path, pid)
        assert done.stderr == ""

    @pytest.mark.parametrize("gate", [None, "0", "true"])
    def test_the_probe_needs_no_gate_in_the_operators_shell(
        self, root_directory: Path, gate: str | None
    ) -> None:
        """
        An operator checking the broker from the host, in a shell
        without the workload's gate (or with it off), is answered, and told
        the gate it has as information.  Before, this was "gate check failed:
        LIBVGPU_HOSTPID_BROKER unset; ... not probed", exit 1.
        """
        env = {} if gate is None else {"LIBVGPU_HOSTPID_BROKER": gate}
        with running_broker(root_directory) as broker:
            done, pid = run_hostpid("probe", "--socket", str(broker.socket_path), env=env)
        assert done.returncode == 0, done.stderr
        seen = ("LIBVGPU_HOSTPID_BROKER unset" if gate is None
                else f"LIBVGPU_HOSTPID_BROKER={gate!r}")
        assert done.stdout == healthy_line(
            broker.socket_path, pid, f"{seen} (information only: a workload asks only with '1')"
        )
        assert done.stderr == ""

    def test_the_probe_does_not_require_a_read_only_mount_but_query_does(
        self, root_directory: Path
    ) -> None:
        """The broker's directory is read-write where the operator is."""
        with running_broker(root_directory) as broker:
            probed, _ = run_hostpid("probe", "--socket", str(broker.socket_path))
            queried, _ = run_hostpid("query", "--socket", str(broker.socket_path))
        assert probed.returncode == 0, probed.stderr
        assert queried.returncode == 1
        assert queried.stderr == (
            f"hostpid query: read-only-mount check failed: {root_directory}: read-write mount\n"
        )


@pytest.fixture
def default_layout() -> Iterator[DefaultLayout]:
    with DefaultLayout() as layout:
        yield layout


def wait_answering(broker: BrokerProcess, path: Path) -> None:
    from support import ask_pid

    def answering() -> bool:
        if broker.process.poll() is not None:
            raise AssertionError(f"broker exited {broker.process.returncode}:\n{broker.output()}")
        try:
            return ask_pid(path) == os.getpid()
        except OSError:
            return False

    wait_for(answering, f"the broker at {path}")


def test_probe_default_socket_is_the_host_path(default_layout: DefaultLayout) -> None:
    """
    With no option, the probe checks C{/var/run/hami/hostpid/broker.sock}: a
    root broker on its default directory, probed with no argument, is healthy.
    """
    assert defaults.BROKER_SOCKET == "/var/run/hami/hostpid/broker.sock"
    with BrokerProcess(None, argv_prefix=default_layout.prefix) as broker:
        wait_answering(broker, default_layout.seen_from_here(defaults.BROKER_SOCKET))
        done, pid = run_hostpid("probe", prefix=default_layout.prefix)
        assert done.returncode == 0, done.stderr
        assert done.stdout == healthy_line(defaults.BROKER_SOCKET, pid)
        assert broker.terminate() != 0  # 143 through twistd, as on a real node
    done, _ = run_hostpid("probe", prefix=default_layout.prefix)
    assert done.returncode == 1
    assert done.stderr == (
        f"hostpid probe: socket check failed: {defaults.BROKER_SOCKET}: "
        "cannot lstat: ENOENT (No such file or directory)\n"
    )


# --- hostpid probe: each failure, one line naming the path. ---


class TestProbeFailures:
    def test_no_directory(self, tmp_path: Path) -> None:
        path = tmp_path / "none" / "broker.sock"
        done, _ = run_hostpid("probe", "--socket", str(path))
        assert (done.returncode, done.stdout) == (1, "")
        assert done.stderr == (
            f"hostpid probe: directory check failed: {path.parent}: "
            "cannot open: ENOENT (No such file or directory)\n"
        )

    def test_no_socket(self, tmp_path: Path) -> None:
        directory = make_directory(tmp_path / "broker")
        done, _ = run_hostpid("probe", "--socket", str(directory / "broker.sock"))
        assert (done.returncode, done.stdout) == (1, "")
        assert done.stderr == (
            f"hostpid probe: socket check failed: {directory / 'broker.sock'}: "
            "cannot lstat: ENOENT (No such file or directory)\n"
        )

    def test_stale_socket(self, root_directory: Path) -> None:
        directory = make_directory(root_directory)
        stale_socket(directory / "broker.sock")
        done, _ = run_hostpid("probe", "--socket", str(directory / "broker.sock"))
        assert done.returncode == 1
        assert done.stderr == (
            f"hostpid probe: connect check failed: {directory / 'broker.sock'}: "
            "ECONNREFUSED (Connection refused)\n"
        )

    def test_broker_disabled(self, root_directory: Path) -> None:
        """
        A broker started with the gate off serves nothing: the probe says
        what is missing, whatever the probe's own gate.  (The DaemonSets skip
        the probe while the broker's gate is off: test_deploy.py.)
        """
        with BrokerProcess(root_directory, gate="0") as broker:
            wait_for(
                lambda: "disabled" in broker.output() or broker.process.poll() is not None,
                "the broker to say it is disabled",
            )
            assert broker.process.poll() is None, broker.output()
            for env in (ENABLED, {}):
                done, _ = run_hostpid("probe", "--socket", str(broker.socket_path), env=env)
                assert (done.returncode, done.stdout) == (1, ""), env
                assert done.stderr == (
                    f"hostpid probe: directory check failed: {root_directory}: "
                    "cannot open: ENOENT (No such file or directory)\n"
                ), env

    def test_broker_of_another_owner(self, public_tmp: Path) -> None:
        """A real broker run by UID 1000: its directory is not root's."""
        require_root()
        os.chown(public_tmp, OTHER_UID, OTHER_UID)
        directory = public_tmp / "broker"
        with running_broker(directory, argv_prefix=as_other_uid_argv()) as broker:
            done, _ = run_hostpid("probe", "--socket", str(broker.socket_path))
        assert done.returncode == 1
        assert done.stderr == (
            f"hostpid probe: directory check failed: {directory}: "
            "directory, uid 1000, mode 0711: owner is not uid 0\n"
        )

    def test_trusted_uid_probes_a_broker_of_another_owner(
        self, public_tmp: Path, tmp_path: Path
    ) -> None:
        """
        A real broker run unprivileged by UID 1000 on its own directory:
        C{--trusted-uid 1000} probes it with every other check still on
        (healthy), and a root broker is then refused, since the owner is no
        longer the one trusted.
        """
        require_root()
        os.chown(public_tmp, OTHER_UID, OTHER_UID)
        directory = public_tmp / "broker"
        with running_broker(directory, argv_prefix=as_other_uid_argv()) as broker:
            done, pid = run_hostpid("probe", "--socket", str(broker.socket_path),
                                    "--trusted-uid", str(OTHER_UID))
        assert done.returncode == 0, done.stderr
        assert done.stdout == healthy_line(broker.socket_path, pid).replace(
            "uid 0,", f"uid {OTHER_UID},")
        assert done.stderr == ""
        root_owned = tmp_path / "root-broker"
        with running_broker(root_owned) as broker:
            done, _ = run_hostpid("probe", "--socket", str(broker.socket_path),
                                  "--trusted-uid", str(OTHER_UID))
        assert done.returncode == 1
        assert done.stderr == (
            f"hostpid probe: directory check failed: {root_owned}: "
            f"directory, uid 0, mode 0711: owner is not uid {OTHER_UID}\n"
        )

    @pytest.mark.parametrize("uid", ["-1", "root", "4294967295", "1.5"])
    def test_a_bad_trusted_uid_is_a_usage_error(
        self, uid: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exited:
            cli.main(["probe", "--trusted-uid", uid])
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == \
            f"hostpid probe: --trusted-uid must be a UID, got {uid!r}"

    def test_socket_of_another_owner(self, root_directory: Path) -> None:
        """In root's directory, a socket that belongs to UID 1000."""
        directory = make_directory(root_directory)
        with fake_broker(directory) as fake:
            os.chown(fake.path, OTHER_UID, OTHER_UID)
            done, _ = run_hostpid("probe", "--socket", str(fake.path))
            assert fake.connections == 0, "not even connected to"
        assert done.returncode == 1
        assert done.stderr == (
            f"hostpid probe: socket check failed: {fake.path}: "
            "socket, uid 1000, mode 0755: owner is not uid 0\n"
        )

    def test_listener_of_another_uid(self, root_directory: Path) -> None:
        """
        Root's directory, a root-owned socket path, but the listener is UID
        1000 (it bound the socket and root handed the path over): peer-uid.
        """
        directory = make_directory(root_directory)
        directory.chmod(0o755)
        os.chown(directory, OTHER_UID, OTHER_UID)
        path = directory / "broker.sock"
        script = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n"
            "print('listening', flush=True)\n"
            "c, _ = s.accept(); c.settimeout(10); print(repr(c.recv(64)), flush=True)\n"
        )
        listener = subprocess.Popen(
            [*as_other_uid_argv(), sys.executable, "-c", script, str(path)],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert listener.stdout is not None
            assert listener.stdout.readline() == "listening\n"
            os.chown(path, 0, 0)
            os.chown(directory, 0, 0)
            directory.chmod(0o711)
            done, _ = run_hostpid("probe", "--socket", str(path))
            assert listener.stdout.readline() == "b''\n", "no request sent to it"
        finally:
            listener.kill()
            listener.wait()
        assert done.returncode == 1
        assert re.fullmatch(
            rf"hostpid probe: peer-uid check failed: {re.escape(str(path))}: "
            r"uid 1000 \(pid \d+\): not uid 0\n",
            done.stderr,
        ), done.stderr

    def test_a_server_that_answers_another_pid(self, root_directory: Path) -> None:
        """Root's socket in root's directory, answering PID 4242 to everyone."""
        directory = make_directory(root_directory)
        with fake_broker(directory, response(pid=4242)) as fake:
            done, pid = run_hostpid("probe", "--socket", str(fake.path))
            assert fake.requests == [b"HPID\x00\x01\x00\x01"]
        assert (done.returncode, done.stdout) == (1, "")
        assert done.stderr == (
            f"hostpid probe: reply check failed: {fake.path}: answered PID 4242, not this "
            f"process's PID {pid} (a probe must run in the broker's PID namespace)\n"
        )

    def test_a_refusing_server(self, root_directory: Path) -> None:
        directory = make_directory(root_directory)
        with fake_broker(directory, response(status=1, pid=0)) as fake:
            done, _ = run_hostpid("probe", "--socket", str(fake.path))
        assert done.returncode == 1
        assert done.stderr == (
            f"hostpid probe: reply check failed: {fake.path}: status 1, not 0\n"
        )

    def test_a_silent_server(self, root_directory: Path) -> None:
        directory = make_directory(root_directory)
        with fake_broker(directory, hold=True) as fake:
            done, _ = run_hostpid("probe", "--socket", str(fake.path), "--timeout", "0.2")
        assert done.returncode == 1
        assert done.stderr == (
            f"hostpid probe: deadline check failed: {fake.path}: "
            "0.2 s passed waiting for the reply (0 of 12 bytes)\n"
        )

    def test_a_regular_file(self, root_directory: Path) -> None:
        directory = make_directory(root_directory)
        (directory / "broker.sock").write_bytes(b"")
        done, _ = run_hostpid("probe", "--socket", str(directory / "broker.sock"))
        assert done.returncode == 1
        assert "socket check failed" in done.stderr and "not a socket" in done.stderr


def test_probe_library_reports_what_it_checked(root_directory: Path) -> None:
    """The function behind the command, in this process."""
    from hostpid.client import blocking

    with running_broker(root_directory) as broker:
        report = blocking.probe(str(broker.socket_path), environ=ENABLED)
    assert report.pid == os.getpid()
    assert report.socket.name == "socket" and report.socket.ok
    assert report.socket.observed == "socket, uid 0, mode 0666"
    assert (report.gate.name, report.gate.ok) == ("gate", True)
    assert report.gate.observed == "LIBVGPU_HOSTPID_BROKER='1'"


class TestProbeIsCheap:
    """
    The exec probe runs as a fresh interpreter every few seconds on every
    node: what it imports is its cost (bench/probe measures the CPU; this
    keeps the heavy modules out, whatever the timing on a given machine).
    """

    #: Run in a fresh interpreter: the modules the probe loads beyond those
    #: loaded before it (the interpreter's start, site-packages' .pth files).
    LOADS = (
        "import sys\nbefore = set(sys.modules)\n{prelude}from hostpid.cli import main\n"
        "status = main(['probe', '--socket', sys.argv[1], '--timeout', '3'])\n"
        "print(status, *sorted(set(sys.modules) - before), file=sys.stderr)\n"
    )

    def probe_loads(self, socket_path: Path, prelude: str = "") -> tuple[int, list[str]]:
        done = subprocess.run(
            [sys.executable, "-c", self.LOADS.format(prelude=prelude), str(socket_path)],
            capture_output=True, text=True, timeout=60, env=subprocess_env(), check=False,
        )
        status, *loaded = done.stderr.strip().splitlines()[-1].split()
        assert ": ok: answered PID " in done.stdout, done.stderr
        return int(status), heavy_modules(set(loaded))

    def test_a_healthy_probe_loads_no_heavy_module(self, root_directory: Path) -> None:
        with running_broker(root_directory) as broker:
            status, heavy = self.probe_loads(broker.socket_path)
            # The control: the same check sees what a heavier start loads.
            _, control = self.probe_loads(broker.socket_path, "import re, socket\n")
        assert (status, heavy) == (0, [])
        assert {"re", "socket", "enum", "selectors"} <= set(control)

    def test_the_sandbox_check_reads_fstatfs_without_ctypes_where_the_helper_is_built(
        self,
    ) -> None:
        """
        The C helper's C{fstatfs_type} and the C{ctypes} fallback agree (on
        procfs, whose magic number is fixed), and the helper's is the one
        used where it is built: the probe then never imports C{ctypes}.
        """
        from hostpid.client import sandbox

        fd = os.open("/proc", os.O_PATH | os.O_CLOEXEC)
        try:
            assert sandbox.ctypes_fstatfs_type(fd) == PROC_SUPER_MAGIC
            assert sandbox.fstatfs_type(fd) == PROC_SUPER_MAGIC
        finally:
            os.close(fd)
        for read in (sandbox.ctypes_fstatfs_type, sandbox.fstatfs_type):
            with pytest.raises(OSError) as raised:
                read(fd)  # closed now
            assert raised.value.errno == errno.EBADF
        native = pytest.importorskip("_hostpid_native", reason="the C helper is not built")
        assert sandbox.fstatfs_type is native.fstatfs_type

    @pytest.mark.parametrize(
        "argv",
        [
            ["probe"],
            ["probe", "--socket", "/a/b.sock"],
            ["probe", "--socket=/a/b.sock", "--timeout=0.25"],
            ["probe", "--timeout", "2", "--socket", "/x", "--socket", "/y"],
            ["probe", "--timeout", "3600"],
        ],
    )
    def test_the_hand_parser_agrees_with_argparse(self, argv: list[str]) -> None:
        fast = cli._probe_arguments(argv)
        full = cli.build_parser().parse_args(argv)
        assert isinstance(fast, cli._ProbeArguments)
        assert (fast.socket, fast.timeout) == (full.socket, full.timeout)

    @pytest.mark.parametrize(
        "argv",
        [
            ["nri-probe"],
            ["nri-probe", "--ready"],
            ["nri-probe", "--address", "127.0.0.1:9399", "--ready", "--timeout=0.5"],
            ["nri-probe", "--address=/run/h.sock", "--address", "[::1]:1"],
        ],
    )
    def test_the_nri_probe_hand_parser_agrees_with_argparse(self, argv: list[str]) -> None:
        fast = cli._probe_arguments(argv)
        full = cli.build_parser().parse_args(argv)
        assert isinstance(fast, cli._NRIProbeArguments)
        assert (fast.address, fast.ready, fast.timeout) == (
            full.address, full.ready, full.timeout)

    @pytest.mark.parametrize(
        "argv",
        [
            ["probe", "--help"], ["probe", "--sock", "/x"], ["probe", "--timeout", "0"],
            ["probe", "--timeout", "nan"], ["probe", "--socket"], ["probe", "--socket", "-x"],
            ["probe", "--socket="], ["probe", "extra"], ["query"], [],
            ["probe", "--ready"], ["nri-probe", "--ready=1"], ["nri-probe", "--timeout", "0"],
            ["nri-probe", "--address"], ["nri-probe", "--help"],
        ],
    )
    def test_anything_else_goes_to_argparse(self, argv: list[str]) -> None:
        assert cli._probe_arguments(argv) is None
