"""
Tests for L{hostpid.client.blocking}, the C{hostpid query} / C{hostpid doctor}
commands, and the C contract client, against real sockets.

Refusals of malformed replies use a scripted fake broker (a real Unix socket
served by a thread): the client is what is under test.  Everything that can
use the real broker (C{twistd hostpid-broker}) does.  The production layout
(read-only bind mount, PID namespace) is in
C{tests/integration/test_client_layout.py}.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import pytest_twisted  # type: ignore[import-untyped]
from clienttools import (
    OTHER_UID,
    FakeBroker,
    as_other_uid_argv,
    build_c_client,
    fake_broker,
    fill_accept_queue,
    make_directory,
    response,
)
from support import (
    WAIT_SECONDS,
    BrokerProcess,
    open_fd_count,
    remove_tree,
    require_root,
    running_broker,
    subprocess_env,
)

from hostpid import cli, defaults, wire
from hostpid.client import blocking as client
from hostpid.client import transaction, txclient

ENABLED = {"LIBVGPU_HOSTPID_BROKER": "1"}

#: A tmp directory is read-write: tests that are not about the mount turn
#: that one check off, by name, exactly as the API intends.
def relaxed(directory: Path, *more: str, **kwargs: object) -> client.TrustPolicy:
    return client.TrustPolicy(
        socket_path=str(directory / "broker.sock"), **kwargs  # type: ignore[arg-type]
    ).without(client.READ_ONLY_MOUNT, *more)


def refusal(
    policy: client.TrustPolicy, environ: dict[str, str] = ENABLED
) -> client.HostPidUnavailable:
    with pytest.raises(client.HostPidUnavailable) as caught:
        client.query_host_pid(policy, environ)
    assert client.lookup_host_pid(policy, environ) is None
    return caught.value


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    """A root-owned 0711 directory, as the broker makes it."""
    return make_directory(tmp_path / "hostpid")


@pytest.fixture(scope="session")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_client(tmp_path_factory.mktemp("cclient"))


@pytest.fixture
def other_uid_tmp() -> Iterator[Path]:
    """A directory under /tmp that UID 1000 can reach and write."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="hostpid-client-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        remove_tree(path, ignore_errors=True)


# --- The policy value. ---


class TestPolicy:
    def test_defaults_are_the_production_rules(self) -> None:
        policy = client.TrustPolicy()
        assert policy.socket_path == defaults.CLIENT_SOCKET == "/tmp/vgpulock/hostpid/broker.sock"
        assert policy.trusted_uid == 0
        assert policy.deadline == 0.5
        assert policy.turned_off == frozenset()
        assert all(policy.enforces(name) for name in client.CHECKS)
        assert client.STRICT == policy

    def test_checks_in_order(self) -> None:
        assert client.CHECKS == (
            "gate", "sandbox", "directory", "socket", "read-only-mount", "peer-uid", "peer-pid",
            "reply",
        )

    @pytest.mark.parametrize(
        "name", ["directory", "socket", "read-only-mount", "peer-uid", "peer-pid"]
    )
    def test_turn_off_by_name(self, name: str) -> None:
        policy = client.TrustPolicy().without(name)
        assert not policy.enforces(name)
        assert policy.turned_off == {name}
        assert client.TrustPolicy().enforces(name), "without() must not change the original"

    @pytest.mark.parametrize("name", ["gate", "sandbox", "reply", "connect", "deadline"])
    def test_mandatory_checks_cannot_be_turned_off(self, name: str) -> None:
        with pytest.raises(ValueError, match="cannot be turned off"):
            client.TrustPolicy().without(name)

    def test_unknown_name_is_refused(self) -> None:
        with pytest.raises(ValueError, match="unknown check 'read-only'"):
            client.TrustPolicy().without("read-only")
        with pytest.raises(TypeError):
            client.TrustPolicy(turned_off="peer-uid")

    @pytest.mark.parametrize("deadline", [0, -1, float("nan"), float("inf")])
    def test_deadline_must_be_positive_and_finite(self, deadline: float) -> None:
        with pytest.raises(ValueError):
            client.TrustPolicy(deadline=deadline)


# --- Every refusal, against a real socket. ---


class TestGate:
    @pytest.mark.parametrize(
        "value", ["", "0", "true", "false", "01", " 1", "1 ", "yes", "1\n", None]
    )
    def test_only_exact_one_enables(self, directory: Path, value: str | None) -> None:
        environ = {} if value is None else {"LIBVGPU_HOSTPID_BROKER": value}
        with fake_broker(directory) as broker:
            problem = refusal(relaxed(directory), environ)
            assert problem.check == "gate"
            assert ("unset" if value is None else repr(value)) in problem.observed
            assert broker.connections == 0, "a disabled client must not connect"

    def test_one_enables(self, directory: Path) -> None:
        with fake_broker(directory, response(pid=4242)) as broker:
            assert client.query_host_pid(relaxed(directory), ENABLED) == 4242
            assert client.lookup_host_pid(relaxed(directory), ENABLED) == 4242
            assert broker.requests == [wire.GET_HOST_PID_REQUEST] * 2

    def test_process_environment_is_the_default(
        self, directory: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with fake_broker(directory, response(pid=77)):
            monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "true")
            assert refusal(relaxed(directory), None).check == "gate"  # type: ignore[arg-type]
            monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "1")
            assert client.query_host_pid(relaxed(directory)) == 77


class TestFilesystemRefusals:
    def test_directory_owned_by_another_uid(self, directory: Path) -> None:
        require_root()
        os.chown(directory, OTHER_UID, OTHER_UID)
        with fake_broker(directory) as broker:
            problem = refusal(relaxed(directory))
            assert problem.check == "directory"
            assert "uid 1000" in problem.observed and "not uid 0" in problem.observed
            assert broker.connections == 0
            # The same layout passes once the trusted UID is the owner's...
            os.chown(directory / "broker.sock", OTHER_UID, OTHER_UID)
            policy = relaxed(directory, "peer-uid", trusted_uid=OTHER_UID)
            assert client.query_host_pid(policy, ENABLED) == 4242

    @pytest.mark.parametrize("mode", [0o777, 0o731, 0o713, 0o1777])
    def test_directory_writable_by_group_or_other(self, directory: Path, mode: int) -> None:
        os.chmod(directory, mode)
        with fake_broker(directory) as broker:
            problem = refusal(relaxed(directory))
            assert problem.check == "directory"
            assert f"mode {mode:04o}" in problem.observed
            assert "group or other may write" in problem.observed
            assert broker.connections == 0
            # ...and it is exactly that check: turned off by name, the query passes.
            assert client.query_host_pid(relaxed(directory, "directory"), ENABLED) == 4242

    def test_symlinked_directory(self, directory: Path, tmp_path: Path) -> None:
        link = tmp_path / "link"
        link.symlink_to(directory)
        with fake_broker(directory) as broker:
            problem = refusal(relaxed(link))
            assert problem.check == "directory"
            assert problem.observed.startswith("symlink")
            assert broker.connections == 0

    def test_missing_directory(self, tmp_path: Path) -> None:
        problem = refusal(relaxed(tmp_path / "absent"))
        assert problem.check == "directory"
        assert "ENOENT" in problem.observed

    def test_missing_socket(self, directory: Path) -> None:
        problem = refusal(relaxed(directory))
        assert problem.check == "socket"
        assert "ENOENT" in problem.observed

    def test_regular_file_at_socket_path(self, directory: Path) -> None:
        (directory / "broker.sock").write_bytes(response())
        problem = refusal(relaxed(directory))
        assert problem.check == "socket"
        assert problem.observed.startswith("regular file") and "not a socket" in problem.observed

    def test_symlink_at_socket_path(self, directory: Path, tmp_path: Path) -> None:
        elsewhere = make_directory(tmp_path / "elsewhere")
        with fake_broker(elsewhere) as broker:
            (directory / "broker.sock").symlink_to(elsewhere / "broker.sock")
            problem = refusal(relaxed(directory))
            assert problem.check == "socket"
            assert problem.observed.startswith("symlink")
            assert broker.connections == 0

    def test_socket_owned_by_another_uid(self, directory: Path) -> None:
        require_root()
        with fake_broker(directory) as broker:
            os.lchown(directory / "broker.sock", OTHER_UID, OTHER_UID)
            problem = refusal(relaxed(directory))
            assert problem.check == "socket"
            assert "uid 1000" in problem.observed
            assert broker.connections == 0

    def test_directory_not_on_a_read_only_mount(self, directory: Path) -> None:
        with fake_broker(directory) as broker:
            problem = refusal(client.TrustPolicy(socket_path=str(directory / "broker.sock")))
            assert problem.check == "read-only-mount"
            assert problem.observed == "read-write mount"
            assert broker.connections == 0

    def test_checks_run_in_order(self, tmp_path: Path) -> None:
        """Several things wrong: the first check in the order is the one named."""
        directory = make_directory(tmp_path / "d", 0o777)
        (directory / "broker.sock").write_bytes(b"")
        policy = client.TrustPolicy(socket_path=str(directory / "broker.sock"))
        assert refusal(policy).check == "directory"
        assert refusal(policy.without("directory")).check == "socket"
        assert refusal(policy.without("directory", "socket")).check == "read-only-mount"


class TestPeerUid:
    def test_broker_running_as_another_uid(self, other_uid_tmp: Path) -> None:
        """A real broker as UID 1000: only the peer-uid check stands between."""
        require_root()
        os.chown(other_uid_tmp, OTHER_UID, OTHER_UID)
        broker_dir = other_uid_tmp / "broker"
        with running_broker(broker_dir, argv_prefix=as_other_uid_argv()):
            assert os.stat(broker_dir / "broker.sock").st_uid == OTHER_UID
            policy = relaxed(broker_dir, "directory", "socket")
            problem = refusal(policy)
            assert problem.check == "peer-uid"
            assert problem.observed.startswith("uid 1000 (pid ")
            # Trusting that UID, every check passes and the answer is ours.
            trusted = relaxed(broker_dir, trusted_uid=OTHER_UID)
            assert client.query_host_pid(trusted, ENABLED) == os.getpid()

    def test_no_request_is_sent_to_an_untrusted_peer(self, other_uid_tmp: Path) -> None:
        """The peer check comes before the first byte: the listener sees nothing."""
        require_root()
        os.chown(other_uid_tmp, OTHER_UID, OTHER_UID)
        path = other_uid_tmp / "broker.sock"
        script = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n"
            "print('listening', flush=True)\n"
            "c, _ = s.accept(); c.settimeout(10)\n"
            "print(repr(c.recv(64)), flush=True)\n"
        )
        listener = subprocess.Popen(
            [*as_other_uid_argv(), sys.executable, "-c", script, str(path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert listener.stdout is not None
            assert listener.stdout.readline() == "listening\n"
            problem = refusal(relaxed(other_uid_tmp, "directory", "socket"))
            assert problem.check == "peer-uid"
            # The listener accepts the (closed) connection and reads end of file.
            assert listener.stdout.readline() == "b''\n"
        finally:
            listener.kill()
            listener.wait()


class TestReplyRefusals:
    @pytest.mark.parametrize(
        ("reply", "observed"),
        [
            (response(magic=b"HPIX"), "bad magic b'HPIX'"),
            (response(magic=b"\0\0\0\0"), "bad magic"),
            (response(version=2), "bad version 2"),
            (response(version=0), "bad version 0"),
            (wire.INVALID_REQUEST_RESPONSE, "status 1, not 0"),
            (response(status=1, pid=4242), "status 1, not 0"),
            (response(pid=0), "PID 0 outside 1..2147483647"),
            (response(pid=2**31), "PID 2147483648 outside"),
            (response(pid=2**32 - 1), "PID 4294967295 outside"),
            (response()[:5], "cut short: 5 of 12 bytes"),
            (response()[:11], "cut short: 11 of 12 bytes"),
            (b"", "cut short: 0 of 12 bytes"),
        ],
    )
    def test_refused(self, directory: Path, reply: bytes, observed: str) -> None:
        with fake_broker(directory, reply) as broker:
            problem = refusal(relaxed(directory))
            assert problem.check == "reply"
            assert observed in problem.observed
            # The client sent exactly the version 1 request: never a PID.
            assert broker.requests[0] == wire.GET_HOST_PID_REQUEST

    @pytest.mark.parametrize("pid", [1, 4242, 2**31 - 1])
    def test_accepted_pid_is_the_replied_one(self, directory: Path, pid: int) -> None:
        with fake_broker(directory, response(pid=pid)):
            assert client.query_host_pid(relaxed(directory), ENABLED) == pid

    def test_trickling_broker_cannot_extend_the_deadline(self, directory: Path) -> None:
        """One byte per 100 ms would take 1.1 s; the client gives up at 0.5 s."""
        with fake_broker(directory, trickle=0.1) as broker:
            started = time.monotonic()
            with pytest.raises(client.HostPidUnavailable) as caught:
                client.query_host_pid(relaxed(directory), ENABLED)
            elapsed = time.monotonic() - started
            assert caught.value.check == "deadline"
            assert "0.5 s passed waiting for the reply" in caught.value.observed
            assert 0.45 <= elapsed < 1.0, elapsed
            assert broker.requests == [wire.GET_HOST_PID_REQUEST]

    def test_silent_broker(self, directory: Path) -> None:
        with fake_broker(directory, hold=True):
            started = time.monotonic()
            problem = refusal(relaxed(directory, deadline=0.2))
            assert problem.check == "deadline"
            assert "(0 of 12 bytes)" in problem.observed
            assert 0.15 <= time.monotonic() - started < 1.5


class TestConnect:
    def test_refused_connection(self, directory: Path) -> None:
        """A stale socket (nobody listening): the kernel refuses at once."""
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(directory / "broker.sock"))
        stale.close()
        problem = refusal(relaxed(directory))
        assert problem.check == "connect"
        assert "ECONNREFUSED" in problem.observed

    def test_full_accept_queue_retried_until_the_deadline(self, directory: Path) -> None:
        with FakeBroker(directory / "broker.sock", backlog=0, accept=False) as broker:
            held = fill_accept_queue(broker.path)
            try:
                started = time.monotonic()
                problem = refusal(relaxed(directory, deadline=0.3))
                elapsed = time.monotonic() - started
            finally:
                for sock in held:
                    sock.close()
        assert problem.check == "deadline"
        assert "accept queue full" in problem.observed
        assert 0.25 <= elapsed < 1.5, elapsed

    def test_full_accept_queue_drained_in_time(self, directory: Path) -> None:
        """EAGAIN is retried: once the queue drains, the same call succeeds."""
        with FakeBroker(directory / "broker.sock", backlog=0, accept=False) as broker:
            held = fill_accept_queue(broker.path)
            drained = threading.Event()

            def drain() -> None:
                # Server behaviour: a broker that gets to its queue 100 ms late.
                time.sleep(0.1)
                for _ in held:
                    broker.listener.accept()[0].close()
                drained.set()
                broker.listener.settimeout(5)
                connection, _ = broker.listener.accept()
                with connection:
                    connection.recv(8)
                    connection.sendall(response(pid=99))

            thread = threading.Thread(target=drain)
            started = time.monotonic()
            thread.start()
            try:
                assert client.query_host_pid(relaxed(directory), ENABLED) == 99
                assert drained.is_set()
                assert time.monotonic() - started >= 0.09
            finally:
                thread.join(10)
                for sock in held:
                    sock.close()


# --- The real broker: threads, fork, descriptors. ---


@pytest.fixture(scope="module")
def real_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path_factory.mktemp("real") / "broker") as broker:
        yield broker


class TestRealBroker:
    def test_answer_is_our_own_pid(self, real_broker: BrokerProcess) -> None:
        policy = relaxed(real_broker.directory)
        assert client.query_host_pid(policy, ENABLED) == os.getpid()

    def test_from_many_threads(self, real_broker: BrokerProcess) -> None:
        policy = relaxed(real_broker.directory)
        results: list[int | None] = []
        lock = threading.Lock()

        def ask() -> None:
            answer = client.lookup_host_pid(policy, ENABLED)
            with lock:
                results.append(answer)

        threads = [threading.Thread(target=ask) for _ in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert results == [os.getpid()] * 32

    def test_after_fork(self, real_broker: BrokerProcess) -> None:
        policy = relaxed(real_broker.directory)
        assert client.query_host_pid(policy, ENABLED) == os.getpid()
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            try:
                os.close(read_end)
                answer = client.lookup_host_pid(policy, ENABLED)
                os.write(write_end, f"{answer} {os.getpid()}".encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            reported, own = pipe.read().decode().split()
        os.waitpid(child, 0)
        assert int(reported) == int(own) == child

    def test_no_descriptor_leaks(self, real_broker: BrokerProcess, tmp_path: Path) -> None:
        good = relaxed(real_broker.directory)
        bad = client.TrustPolicy(socket_path=str(real_broker.socket_path))
        client.query_host_pid(good, ENABLED)
        before = open_fd_count()
        for _ in range(20):
            client.query_host_pid(good, ENABLED)
            client.lookup_host_pid(bad, ENABLED)
            client.lookup_host_pid(relaxed(tmp_path / "absent"), ENABLED)
            client.doctor(bad, ENABLED)
        assert open_fd_count() == before

    def test_doctor_for_a_layout_that_only_lacks_the_read_only_mount(
        self, real_broker: BrokerProcess
    ) -> None:
        results = client.doctor(
            client.TrustPolicy(socket_path=str(real_broker.socket_path)), ENABLED
        )
        assert [r.name for r in results] == list(client.DOCTOR_CHECKS)
        verdicts = {r.name: (r.ok, r.observed) for r in results}
        assert verdicts["gate"] == (True, "LIBVGPU_HOSTPID_BROKER='1'")
        assert verdicts["directory"] == (True, "directory, uid 0, mode 0711")
        assert verdicts["socket"] == (True, "socket, uid 0, mode 0666")
        assert verdicts["read-only-mount"] == (False, "read-write mount")
        assert verdicts["connect"] == (True, "connected")
        assert verdicts["peer-uid"] == (True, f"uid 0 (pid {real_broker.pid})")
        assert verdicts["peer-pid"][0] is True
        assert verdicts["sandbox"][0] is True
        assert verdicts["reply"] == (True, f"host PID {os.getpid()}")


class TestTransportRules:
    def test_socket_is_non_blocking_and_close_on_exec(
        self, directory: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        made: list[tuple[socket.socket, bool, bool]] = []
        # The transport lives in hostpid.client.transaction (the probe's
        # attrs-free path); the blocking client uses it from there.
        original = transaction.new_socket

        def recording() -> socket.socket:
            sock = original()
            # A _socket.socket (the probe's path loads no socket module):
            # the close-on-exec flag is asked of the kernel, by descriptor.
            made.append((sock, sock.getblocking(), os.get_inheritable(sock.fileno())))
            return sock

        monkeypatch.setattr(transaction, "new_socket", recording)
        with fake_broker(directory, response(pid=5)):
            assert client.query_host_pid(relaxed(directory), ENABLED) == 5
        [(sock, blocking, inheritable)] = made
        assert (blocking, inheritable) == (False, False)
        assert (sock.family, sock.type) == (socket.AF_UNIX, socket.SOCK_STREAM)
        assert sock.fileno() == -1, "the socket is closed after the query"

    def test_importing_the_client_does_not_install_a_reactor(self) -> None:
        code = (
            "import sys, hostpid.client.blocking, hostpid.cli\n"
            "assert 'twisted.internet.reactor' not in sys.modules\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, timeout=30
        )
        assert done.returncode == 0, done.stderr


# --- The command line. ---


def run_cli(*argv: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    status = cli.main(list(argv), stdout, stderr)
    return status, stdout.getvalue(), stderr.getvalue()


class TestCommandLine:
    def test_query_keeps_strict_checks_with_socket(
        self, real_broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "1")
        status, out, err = run_cli("query", "--socket", str(real_broker.socket_path))
        assert (status, out) == (1, "")
        assert err == (
            f"hostpid query: read-only-mount check failed: {real_broker.directory}: "
            "read-write mount\n"
        )

    def test_query_gate(self, real_broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "0")
        status, out, err = run_cli("query", "--socket", str(real_broker.socket_path))
        assert (status, out) == (1, "")
        assert err == "hostpid query: gate check failed: LIBVGPU_HOSTPID_BROKER='0'\n"

    def test_query_default_socket_is_the_container_path(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Outside a workload there is no read-only broker mount: a trust check fails."""
        monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "1")
        status, out, err = run_cli("query")
        assert (status, out) == (1, "")
        assert err.count("\n") == 1
        check = err.split()[2]
        assert check in ("directory", "socket", "read-only-mount"), err

    def test_query_subprocess_exit_status(self, real_broker: BrokerProcess) -> None:
        from support import hostpid_argv

        done = subprocess.run(
            hostpid_argv("query", "--socket", str(real_broker.socket_path)),
            env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (done.returncode, done.stdout) == (1, "")
        assert done.stderr.count("\n") == 1 and "read-only-mount" in done.stderr
        usage = subprocess.run(
            hostpid_argv("query", "--bogus"), env=subprocess_env(), capture_output=True,
            timeout=30,
        )
        assert usage.returncode == 2

    def test_doctor_broken_layout(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        directory = make_directory(tmp_path / "d", 0o777)
        with fake_broker(directory) as broker:
            monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "true")
            status, out, err = run_cli("doctor", "--socket", str(broker.path))
        assert status == 1 and err == ""
        lines = out.splitlines()
        assert lines[1].startswith("sandbox ok not sandboxed: kernel ")
        assert lines[:1] + lines[2:] == [
            "gate FAIL LIBVGPU_HOSTPID_BROKER='true'",
            f"directory FAIL {directory}: directory, uid 0, mode 0777: group or other may write",
            "socket ok socket, uid 0, mode 0755",
            f"read-only-mount FAIL {directory}: read-write mount",
            "connect ok connected",
            f"peer-uid ok uid 0 (pid {os.getpid()})",
            f"peer-pid ok pid {os.getpid()}: this process, in the host PID namespace (a broker "
            "embedded in it)",
            "reply ok host PID 4242",
        ]

    def test_doctor_nothing_there(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("LIBVGPU_HOSTPID_BROKER", raising=False)
        status, out, _ = run_cli("doctor", "--socket", str(tmp_path / "none" / "broker.sock"))
        assert status == 1
        lines = out.splitlines()
        assert [line.split()[:2] for line in lines] == [
            [name, "ok" if name == "sandbox" else "FAIL"] for name in client.DOCTOR_CHECKS
        ]
        assert lines[0] == "gate FAIL LIBVGPU_HOSTPID_BROKER unset"
        assert lines[2] == (
            f"directory FAIL {tmp_path / 'none'}: cannot open: ENOENT (No such file or directory)"
        ), "the path checked is named, as query names it"
        assert lines[5] == "connect FAIL not tried: no socket to connect to"

    def test_doctor_reports_a_trickling_reply(
        self, directory: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LIBVGPU_HOSTPID_BROKER", "1")
        with fake_broker(directory, trickle=0.1) as broker:
            status, out, _ = run_cli("doctor", "--socket", str(broker.path))
        assert status == 1
        assert out.splitlines()[-1].startswith(
            f"reply FAIL {broker.path}: deadline: 0.5 s passed waiting for the reply ("
        )


# --- The Twisted transport: the same checks, on a reactor. ---


async def reactor_turns_until(condition: Callable[[], object], what: str) -> None:
    """Let the reactor run until C{condition} holds, failing after a bound."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await deferLater(reactor, 0.001, lambda: None)


class TestTwisted:
    @pytest_twisted.ensureDeferred
    async def test_real_broker(self, real_broker: BrokerProcess, clean_reactor: None) -> None:
        policy = relaxed(real_broker.directory)
        assert await txclient.query_host_pid_deferred(policy, ENABLED) == os.getpid()
        assert await txclient.lookup_host_pid_deferred(policy, ENABLED) == os.getpid()

    @pytest_twisted.ensureDeferred
    @pytest.mark.parametrize(
        ("reply", "check", "observed"),
        [
            (response(pid=4242), None, None),
            (response(magic=b"XPID"), "reply", "bad magic"),
            (response(version=7), "reply", "bad version 7"),
            (wire.INVALID_REQUEST_RESPONSE, "reply", "status 1"),
            (response(pid=0), "reply", "PID 0 outside"),
            (response(pid=2**31), "reply", "PID 2147483648 outside"),
            (response()[:7], "reply", "cut short: 7 of 12 bytes"),
        ],
    )
    async def test_replies(
        self,
        directory: Path,
        clean_reactor: None,
        reply: bytes,
        check: str | None,
        observed: str | None,
    ) -> None:
        with fake_broker(directory, reply) as broker:
            deferred = txclient.query_host_pid_deferred(relaxed(directory), ENABLED)
            if check is None:
                assert await deferred == 4242
            else:
                with pytest.raises(client.HostPidUnavailable) as caught:
                    await deferred
                assert caught.value.check == check
                assert observed is not None and observed in caught.value.observed
                lookup = txclient.lookup_host_pid_deferred(relaxed(directory), ENABLED)
                assert await lookup is None
            assert broker.requests[0] == wire.GET_HOST_PID_REQUEST

    @pytest_twisted.ensureDeferred
    async def test_checks_before_connecting(
        self, directory: Path, tmp_path: Path, clean_reactor: None
    ) -> None:
        with fake_broker(directory) as broker:
            for environ, policy, check in [
                ({"LIBVGPU_HOSTPID_BROKER": "01"}, relaxed(directory), "gate"),
                (ENABLED, client.TrustPolicy(str(directory / "broker.sock")), "read-only-mount"),
                (ENABLED, relaxed(tmp_path / "absent"), "directory"),
            ]:
                with pytest.raises(client.HostPidUnavailable) as caught:
                    await txclient.query_host_pid_deferred(policy, environ)
                assert caught.value.check == check
            assert broker.connections == 0

    @pytest_twisted.ensureDeferred
    async def test_trickling_broker_real_clock(self, directory: Path, clean_reactor: None) -> None:
        with fake_broker(directory, trickle=0.1):
            started = time.monotonic()
            with pytest.raises(client.HostPidUnavailable) as caught:
                await txclient.query_host_pid_deferred(relaxed(directory), ENABLED)
            elapsed = time.monotonic() - started
        assert caught.value.check == "deadline"
        assert "waiting for the reply" in caught.value.observed
        assert 0.45 <= elapsed < 1.0, elapsed

    @pytest_twisted.ensureDeferred
    async def test_deadline_on_an_injected_clock(
        self, directory: Path, clean_reactor: None
    ) -> None:
        from twisted.internet.task import Clock

        clock = Clock()
        with fake_broker(directory, hold=True) as broker:
            deferred = txclient.query_host_pid_deferred(relaxed(directory), ENABLED, clock=clock)
            await reactor_turns_until(lambda: broker.requests, "the request to arrive")
            clock.advance(0.499)
            assert not deferred.called
            clock.advance(0.002)
            with pytest.raises(client.HostPidUnavailable) as caught:
                await deferred
        assert caught.value.check == "deadline"
        assert caught.value.observed == "0.5 s passed waiting for the reply (0 of 12 bytes)"
        assert clock.getDelayedCalls() == []

    @pytest_twisted.ensureDeferred
    async def test_full_accept_queue_retried_on_the_clock(
        self, directory: Path, clean_reactor: None
    ) -> None:
        from twisted.internet.task import Clock

        clock = Clock()
        with FakeBroker(directory / "broker.sock", backlog=0, accept=False) as broker:
            held = fill_accept_queue(broker.path)
            try:
                deferred = txclient.query_host_pid_deferred(
                    relaxed(directory), ENABLED, clock=clock
                )
                # Retries at 1, 2, 4, 8, 10, 10 ms...: still queued, no answer.
                clock.pump([0.001, 0.002, 0.004, 0.008, 0.010, 0.010])
                assert not deferred.called
                assert len(clock.getDelayedCalls()) == 2  # the retry and the deadline
                for _ in held:
                    broker.listener.accept()[0].close()
                clock.advance(0.010)  # the next retry connects
                assert len(clock.getDelayedCalls()) == 1  # only the deadline is left
                received: list[bytes] = []

                def serve() -> None:
                    connection, _ = broker.listener.accept()
                    with connection:
                        connection.settimeout(5)
                        received.append(connection.recv(8))
                        connection.sendall(response(pid=31337))

                thread = threading.Thread(target=serve)
                thread.start()
                try:
                    assert await deferred == 31337
                finally:
                    thread.join(10)
                assert received == [wire.GET_HOST_PID_REQUEST]
                assert clock.getDelayedCalls() == []
            finally:
                for sock in held:
                    sock.close()

    @pytest_twisted.ensureDeferred
    async def test_peer_uid_from_the_transport(
        self, other_uid_tmp: Path, clean_reactor: None
    ) -> None:
        require_root()
        os.chown(other_uid_tmp, OTHER_UID, OTHER_UID)
        broker_dir = other_uid_tmp / "broker"
        with running_broker(broker_dir, argv_prefix=as_other_uid_argv()):
            with pytest.raises(client.HostPidUnavailable) as caught:
                await txclient.query_host_pid_deferred(
                    relaxed(broker_dir, "directory", "socket"), ENABLED
                )
            assert caught.value.check == "peer-uid"
            assert "uid 1000" in caught.value.observed
            trusted = relaxed(broker_dir, trusted_uid=OTHER_UID)
            assert await txclient.query_host_pid_deferred(trusted, ENABLED) == os.getpid()

    @pytest_twisted.ensureDeferred
    async def test_cancel(self, directory: Path, clean_reactor: None) -> None:
        from twisted.internet import reactor
        from twisted.internet.defer import CancelledError
        from twisted.internet.task import deferLater

        with fake_broker(directory, hold=True) as broker:
            deferred = txclient.query_host_pid_deferred(relaxed(directory), ENABLED)
            await reactor_turns_until(lambda: broker.requests, "the request to arrive")
            deferred.cancel()
            with pytest.raises(CancelledError):
                await deferred
            # The aborted connection goes on the next reactor turn.
            await deferLater(reactor, 0, lambda: None)


# --- The C contract client. ---


def run_c(
    binary: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), *args],
        env=ENABLED if env is None else env,
        capture_output=True,
        text=True,
        timeout=30,
    )


class TestCClient:
    def test_real_broker(self, c_client: Path, real_broker: BrokerProcess) -> None:
        done = run_c(
            c_client, "--socket", str(real_broker.socket_path), "--without", "read-only-mount"
        )
        assert done.returncode == 0, done.stderr
        host_pid, own_pid = map(int, done.stdout.split())
        assert host_pid == own_pid

    def test_strict_default_refuses_read_write_mount(
        self, c_client: Path, real_broker: BrokerProcess
    ) -> None:
        done = run_c(c_client, "--socket", str(real_broker.socket_path))
        assert (done.returncode, done.stdout) == (1, "")
        assert done.stderr == "hostpid_client: read-only-mount: read-write mount\n"

    @pytest.mark.parametrize("value", ["", "0", "true", "01", " 1", "1 ", None])
    def test_gate(self, c_client: Path, directory: Path, value: str | None) -> None:
        env = {} if value is None else {"LIBVGPU_HOSTPID_BROKER": value}
        with fake_broker(directory) as broker:
            done = run_c(c_client, "--socket", str(broker.path), env=env)
        assert done.returncode == 1 and done.stderr.startswith("hostpid_client: gate: ")
        assert broker.connections == 0

    @pytest.mark.parametrize(
        ("reply", "check"),
        [
            (response(pid=4242), None),
            (response(magic=b"HPIX"), "reply: bad magic"),
            (response(version=2), "reply: bad version 2"),
            (wire.INVALID_REQUEST_RESPONSE, "reply: status 1"),
            (response(pid=0), "reply: PID 0 outside"),
            (response(pid=2**31), "reply: PID 2147483648 outside"),
            (response()[:5], "reply: cut short: 5 of 12"),
        ],
    )
    def test_replies(
        self, c_client: Path, directory: Path, reply: bytes, check: str | None
    ) -> None:
        with fake_broker(directory, reply) as broker:
            done = run_c(c_client, "--socket", str(broker.path), "--without", "read-only-mount")
        assert broker.requests == [wire.GET_HOST_PID_REQUEST]
        if check is None:
            assert done.returncode == 0, done.stderr
            assert done.stdout.split()[0] == "4242"
        else:
            assert (done.returncode, done.stdout) == (1, "")
            assert done.stderr.startswith(f"hostpid_client: {check}")

    def test_trickle(self, c_client: Path, directory: Path) -> None:
        with fake_broker(directory, trickle=0.1) as broker:
            started = time.monotonic()
            done = run_c(c_client, "--socket", str(broker.path), "--without", "read-only-mount")
            elapsed = time.monotonic() - started
        assert done.returncode == 1
        assert done.stderr.startswith("hostpid_client: deadline: 0.5 s passed waiting")
        assert 0.45 <= elapsed < 1.5, elapsed

    def test_filesystem_refusals(self, c_client: Path, tmp_path: Path) -> None:
        require_root()
        cases = []
        wide = make_directory(tmp_path / "wide", 0o777)
        cases.append((wide, "directory: mode 0777"))
        foreign = make_directory(tmp_path / "foreign")
        os.chown(foreign, OTHER_UID, OTHER_UID)
        cases.append((foreign, "directory: owner uid 1000"))
        linked = tmp_path / "linked"
        linked.symlink_to(foreign)
        cases.append((linked, "directory: symlink"))
        regular = make_directory(tmp_path / "regular")
        (regular / "broker.sock").write_bytes(b"")
        cases.append((regular, "socket: regular file"))
        symlinked = make_directory(tmp_path / "symlinked")
        (symlinked / "broker.sock").symlink_to("/dev/null")
        cases.append((symlinked, "socket: symlink"))
        empty = make_directory(tmp_path / "empty")
        cases.append((empty, "socket: cannot lstat"))
        owned = make_directory(tmp_path / "owned")
        with FakeBroker(owned / "broker.sock") as broker:
            os.lchown(broker.path, OTHER_UID, OTHER_UID)
            cases.append((owned, "socket: owner uid 1000"))
            for directory, expected in cases:
                done = run_c(
                    c_client, "--socket", str(directory / "broker.sock"),
                    "--without", "read-only-mount",
                )
                assert (done.returncode, done.stdout) == (1, ""), expected
                assert done.stderr.startswith(f"hostpid_client: {expected}"), done.stderr

    def test_peer_uid(self, c_client: Path, other_uid_tmp: Path) -> None:
        require_root()
        os.chown(other_uid_tmp, OTHER_UID, OTHER_UID)
        broker_dir = other_uid_tmp / "broker"
        with running_broker(broker_dir, argv_prefix=as_other_uid_argv()):
            socket_path = str(broker_dir / "broker.sock")
            done = run_c(
                c_client, "--socket", socket_path, "--without", "read-only-mount",
                "--without", "directory", "--without", "socket",
            )
            assert done.returncode == 1
            assert done.stderr.startswith("hostpid_client: peer-uid: uid 1000 (pid ")
            trusted = run_c(
                c_client, "--socket", socket_path, "--without", "read-only-mount",
                "--trusted-uid", str(OTHER_UID),
            )
            assert trusted.returncode == 0, trusted.stderr
