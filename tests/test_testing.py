"""
Tests for L{hostpid.testing.FakeBroker}, the double downstream projects use
in their own tests: the project's real clients against it, over its real
socket, with and without a running reactor; what it leaves behind (nothing);
and a downstream-style test module, and the one in C{docs/client.md}, run
under both trial and pytest by a real UID 1000 process.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest
import pytest_twisted  # type: ignore[import-untyped]
from support import REPO, as_user_argv, require_root, subprocess_env, wait_for

import hostpid
from hostpid import wire
from hostpid.client import blocking, txclient
from hostpid.testing import Close, Delay, FakeBroker, Raw, Reply, Silent

REFUSING = wire.INVALID_REQUEST_RESPONSE
DOWNSTREAM = REPO / "tests" / "downstream" / "test_hostpid_fake_broker.py"
CLIENT_DOC = REPO / "docs" / "client.md"

#: A non-root UID for the downstream runs.
USER = 1000


def raw_exchange(path: str, payload: bytes, close_write: bool = False) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(payload)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(64):
            data += chunk
        return data


class TestAnswers:
    def test_own_pid_by_default(self) -> None:
        with FakeBroker() as broker:
            assert hostpid.query_host_pid(broker.policy, broker.environ) == os.getpid()
            assert broker.requests == [wire.GET_HOST_PID_REQUEST]
            assert broker.connections == 1

    def test_each_caller_gets_its_own_pid(self) -> None:
        """From SO_PEERCRED: a child process is told its PID, not ours."""
        code = (
            "import os, sys\n"
            "from hostpid import TrustPolicy, query_host_pid\n"
            "policy = TrustPolicy(sys.argv[1], trusted_uid=os.geteuid())"
            ".without('read-only-mount')\n"
            "print(query_host_pid(policy, {'LIBVGPU_HOSTPID_BROKER': '1'}))\n"
        )
        with FakeBroker() as broker:
            child = subprocess.Popen(
                [sys.executable, "-c", code, broker.socket_path],
                env=subprocess_env(), stdout=subprocess.PIPE, text=True,
            )
            out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        assert int(out) == child.pid != os.getpid()

    def test_fixed_pid(self) -> None:
        with FakeBroker(pid=4242) as broker:
            assert hostpid.query_host_pid(broker.policy, broker.environ) == 4242

    @pytest.mark.parametrize(
        ("reply", "observed"),
        [
            (REFUSING, "status 1, not 0"),
            (b"XPID\x00\x01\x00\x00\x00\x00\x00\x07", "bad magic b'XPID'"),
            (b"HPID\x00\x01", "cut short: 6 of 12 bytes"),
            (b"", "cut short: 0 of 12 bytes"),
        ],
    )
    def test_reply_bytes(self, reply: bytes, observed: str) -> None:
        with FakeBroker(reply=reply) as broker:
            with pytest.raises(hostpid.HostPidUnavailable) as caught:
                hostpid.query_host_pid(broker.policy, broker.environ)
            assert hostpid.lookup_host_pid(broker.policy, broker.environ) is None
        assert (caught.value.check, caught.value.observed) == ("reply", observed)

    def test_silent(self) -> None:
        with FakeBroker(silent=True) as broker:
            policy = attrs.evolve(broker.policy, deadline=0.2)
            with pytest.raises(hostpid.HostPidUnavailable) as caught:
                hostpid.query_host_pid(policy, broker.environ)
            assert broker.requests == [wire.GET_HOST_PID_REQUEST]
        assert caught.value.check == "deadline"
        assert caught.value.observed == "0.2 s passed waiting for the reply (0 of 12 bytes)"

    def test_invalid_request_gets_status_1_as_from_the_real_broker(self) -> None:
        with FakeBroker() as broker:
            assert raw_exchange(broker.socket_path, b"XPID\x00\x01\x00\x01") == REFUSING
            assert raw_exchange(broker.socket_path, b"HPID\x00\x01\x00\x02") == REFUSING

    def test_short_request_gets_no_reply(self) -> None:
        with FakeBroker() as broker:
            assert raw_exchange(broker.socket_path, b"HPI", close_write=True) == b""
            assert broker.requests == [b"HPI"]

    def test_many_callers_at_once(self) -> None:
        answers: list[int | None] = []

        def ask(policy: hostpid.TrustPolicy) -> None:
            for _ in range(25):
                answers.append(blocking.lookup_host_pid(policy, {"LIBVGPU_HOSTPID_BROKER": "1"}))

        with FakeBroker() as broker:
            threads = [threading.Thread(target=ask, args=(broker.policy,)) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert broker.connections == 200
        assert answers == [os.getpid()] * 200


class TestPolicy:
    def test_every_check_on_but_the_read_only_mount_and_peer_pid(self) -> None:
        with FakeBroker() as broker:
            policy = broker.policy
            assert policy.turned_off == frozenset({"read-only-mount", "peer-pid"})
            assert policy.trusted_uid == os.geteuid()
            assert policy.deadline == hostpid.TrustPolicy().deadline
            directory = os.lstat(os.path.dirname(policy.socket_path))
            assert stat.S_ISDIR(directory.st_mode)
            assert (directory.st_uid, stat.S_IMODE(directory.st_mode)) == (os.geteuid(), 0o700)

    def test_doctor_passes_every_check_it_enforces(self) -> None:
        with FakeBroker() as broker:
            results = {r.name: r for r in blocking.doctor(broker.policy, broker.environ)}
        assert [name for name, r in results.items() if not r.ok] == ["read-only-mount"]
        assert results["read-only-mount"].observed == "read-write mount [check turned off]"
        assert results["reply"].observed == f"host PID {os.getpid()}"

    def test_the_strict_default_policy_does_not_trust_it(self) -> None:
        with FakeBroker() as broker:
            strict = hostpid.TrustPolicy(socket_path=broker.socket_path, trusted_uid=os.geteuid())
            with pytest.raises(hostpid.HostPidUnavailable) as caught:
                hostpid.query_host_pid(strict, broker.environ)
        assert caught.value.check == "read-only-mount"

    def test_the_gate_still_applies(self) -> None:
        with FakeBroker() as broker:
            off = {"LIBVGPU_HOSTPID_BROKER": "true"}
            assert hostpid.lookup_host_pid(broker.policy, off) is None
            assert broker.connections == 0


class TestLifecycle:
    @pytest.mark.parametrize(
        ("kwargs", "error"),
        [
            ({"pid": 1, "reply": b""}, ValueError),
            ({"pid": 1, "silent": True}, ValueError),
            ({"reply": b"", "silent": True}, ValueError),
            ({"pid": 0}, ValueError),
            ({"pid": 2**31}, ValueError),
            ({"reply": "HPID"}, TypeError),
        ],
    )
    def test_bad_arguments(self, kwargs: dict[str, object], error: type[Exception]) -> None:
        with pytest.raises(error):
            FakeBroker(**kwargs)  # type: ignore[arg-type]

    def test_runs_once(self) -> None:
        broker = FakeBroker()
        with pytest.raises(RuntimeError, match="start"):
            broker.policy  # noqa: B018
        broker.start()
        with pytest.raises(RuntimeError, match="starts once"):
            broker.start()
        broker.stop()
        broker.stop()
        with pytest.raises(RuntimeError):
            broker.start()
        with pytest.raises(RuntimeError):
            broker.policy  # noqa: B018
        FakeBroker().stop()  # never started: harmless

    def test_leaves_no_thread_descriptor_or_file(self) -> None:
        threads_before = set(threading.enumerate())
        fds_before = set(os.listdir("/proc/self/fd"))
        broker = FakeBroker(silent=True).start()
        path = broker.socket_path
        assert len(set(threading.enumerate()) - threads_before) == 1
        # Connections still open when it stops: one waiting for its reply,
        # one that never sent a byte.
        held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        for sock in held:
            sock.settimeout(10)
            sock.connect(path)
        held[0].sendall(wire.GET_HOST_PID_REQUEST)
        wait_for(lambda: broker.connections == 2 and broker.requests, "both connections")
        broker.stop()
        for sock in held:
            assert sock.recv(12) == b"", "the fake closes its side at stop"
            sock.close()
        assert set(threading.enumerate()) == threads_before
        assert set(os.listdir("/proc/self/fd")) == fds_before
        assert not os.path.exists(os.path.dirname(path))

    def test_leaves_alone_what_it_did_not_make(self) -> None:
        broker = FakeBroker().start()
        directory = Path(broker.socket_path).parent
        os.unlink(broker.socket_path)
        (directory / "broker.sock").write_text("someone else's")
        broker.stop()
        assert (directory / "broker.sock").read_text() == "someone else's"
        (directory / "broker.sock").unlink()
        directory.rmdir()


class TestWithTheReactor:
    """Under pytest-twisted the reactor runs in this process, as under trial."""

    @pytest_twisted.ensureDeferred
    async def test_twisted_client(self, clean_reactor: None) -> None:
        with FakeBroker() as broker:
            assert await hostpid.query_host_pid_deferred(broker.policy, broker.environ) == (
                os.getpid()
            )
        with FakeBroker(pid=77) as broker:
            assert await txclient.lookup_host_pid_deferred(broker.policy, broker.environ) == 77
        with FakeBroker(reply=REFUSING) as broker:
            with pytest.raises(hostpid.HostPidUnavailable) as caught:
                await hostpid.query_host_pid_deferred(broker.policy, broker.environ)
            assert caught.value.check == "reply"

    @pytest_twisted.ensureDeferred
    async def test_twisted_client_against_silence(self, clean_reactor: None) -> None:
        with FakeBroker(silent=True) as broker:
            policy = attrs.evolve(broker.policy, deadline=0.2)
            with pytest.raises(hostpid.HostPidUnavailable) as caught:
                await hostpid.query_host_pid_deferred(policy, broker.environ)
        assert caught.value.check == "deadline"
        assert "waiting for the reply" in caught.value.observed

    @pytest_twisted.ensureDeferred
    async def test_blocking_client_on_the_reactor_thread(self, clean_reactor: None) -> None:
        """The reactor is blocked by the call; the fake does not need it."""
        from twisted.internet import reactor
        from twisted.internet.task import deferLater

        def on_the_reactor() -> int | None:
            assert reactor.running  # type: ignore[attr-defined]
            with FakeBroker() as broker:
                return blocking.lookup_host_pid(broker.policy, broker.environ)

        assert await deferLater(reactor, 0, on_the_reactor) == os.getpid()


class TestMemoryReactor:
    def test_the_deadline_names_the_reactor_not_the_accept_queue(self) -> None:
        """
        A MemoryReactor records an adopted connection and never runs it: the
        deadline used to blame a full accept queue that was never full.
        """
        from twisted.internet.testing import MemoryReactorClock

        reactor = MemoryReactorClock()
        failures: list[object] = []
        with FakeBroker() as broker:
            deferred = txclient.query_host_pid_deferred(
                broker.policy, broker.environ, reactor=reactor
            )
            deferred.addErrback(failures.append)
            assert len(reactor.adoptedStreamConnections) == 1
            reactor.advance(0.5)
        [failure] = failures
        problem = failure.value  # type: ignore[attr-defined]
        assert problem.check == "deadline"
        assert "accept queue" not in problem.observed
        assert problem.observed == (
            "0.5 s passed after connecting: the reactor never started the connection it "
            "adopted (a MemoryReactor never does; use a real reactor, e.g. against "
            "hostpid.testing.FakeBroker)"
        )
        assert reactor.getDelayedCalls() == []


def query(broker: FakeBroker, policy: hostpid.TrustPolicy | None = None) -> int | str:
    """The blocking client's answer, or the name of the check that failed."""
    try:
        return hostpid.query_host_pid(policy or broker.policy, broker.environ)
    except hostpid.HostPidUnavailable as problem:
        return problem.check


class TestScript:
    """One step per connection, in order, like treq's RequestSequence."""

    def test_steps_in_order_one_per_connection(self) -> None:
        script = [Reply(pid=11), Raw(REFUSING), Close(), Reply(), Silent(), Reply(pid=12)]
        with FakeBroker(script=script, deadline=0.2) as broker:
            assert broker.remaining == tuple(script)
            assert query(broker) == 11
            assert query(broker) == "reply"           # status 1
            assert query(broker) == "reply"           # closed at accept: no reply
            assert query(broker) == os.getpid()       # Reply(): the caller's own PID
            assert query(broker) == "deadline"        # Silent()
            assert query(broker) == 12
            assert broker.remaining == ()
            assert broker.unscripted == 0
            # Past the script: closed at once, and counted, so a test sees it.
            assert query(broker) == "reply"
            assert (broker.connections, broker.unscripted) == (7, 1)
            # Close() read nothing; the unscripted connection neither.
            assert broker.requests == [wire.GET_HOST_PID_REQUEST] * 5

    def test_delay_then_reply(self) -> None:
        with FakeBroker(script=[Delay(0.3, then=Reply(pid=5)), Delay(2.0)], deadline=1.0) as broker:
            started = time.monotonic()
            assert query(broker) == 5
            assert time.monotonic() - started >= 0.3, "answered after the delay, not before"
            assert query(broker) == "deadline", "a delay longer than the caller's deadline"

    def test_a_delay_answers_a_half_closed_caller(self) -> None:
        with FakeBroker(script=[Delay(0.2, then=Reply(pid=6))]) as broker:
            reply = raw_exchange(broker.socket_path, wire.GET_HOST_PID_REQUEST, close_write=True)
        assert reply == wire.encode_ok(6)

    def test_a_delay_then_a_close_or_silence(self) -> None:
        script = [Delay(0.1, then=Close()), Delay(0.1, then=Silent()), Delay(0, then=Raw(b"HP"))]
        with FakeBroker(script=script, deadline=0.5) as broker:
            assert query(broker) == "reply"
            assert query(broker) == "deadline"
            assert raw_exchange(broker.socket_path, wire.GET_HOST_PID_REQUEST) == b"HP"

    def test_a_caller_that_leaves_during_a_delay(self) -> None:
        """Its connection is closed when the delay ends; the double goes on serving."""
        with FakeBroker(script=[Delay(0.2), Reply(pid=8)]) as broker:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(broker.socket_path)
                sock.sendall(wire.GET_HOST_PID_REQUEST)
            wait_for(lambda: broker.requests, "the request read")
            assert query(broker) == 8

    @pytest.mark.parametrize(
        ("make", "error"),
        [
            (lambda: FakeBroker(script=[Reply(), "HPID"]), TypeError),
            (lambda: FakeBroker(pid=1, script=[]), ValueError),
            (lambda: FakeBroker(silent=True, script=[Silent()]), ValueError),
            (lambda: FakeBroker(deadline=0), ValueError),
            (lambda: FakeBroker(deadline=float("inf")), ValueError),
            (lambda: Reply(pid=0), ValueError),
            (lambda: Reply(pid=2**31), ValueError),
            (lambda: Raw("HPID"), TypeError),
            (lambda: Delay(-1), ValueError),
            (lambda: Delay(float("nan")), ValueError),
            (lambda: Delay("1"), TypeError),
            (lambda: Delay(1, then=b"HPID"), TypeError),
        ],
    )
    def test_bad_scripts(self, make: object, error: type[Exception]) -> None:
        with pytest.raises(error):
            make()  # type: ignore[operator]

    def test_an_empty_script_answers_nobody(self) -> None:
        with FakeBroker(script=[]) as broker:
            assert query(broker) == "reply"
            assert broker.unscripted == 1


class TestDeadline:
    def test_the_policy_carries_the_deadline_given(self) -> None:
        with FakeBroker(deadline=0.2) as broker:
            assert broker.policy.deadline == 0.2
        with FakeBroker() as broker:
            assert broker.policy.deadline == hostpid.STRICT.deadline

    def test_a_silent_broker_is_given_up_on_at_that_deadline(self) -> None:
        with FakeBroker(silent=True, deadline=0.2) as broker:
            started = time.monotonic()
            assert query(broker) == "deadline"
            assert time.monotonic() - started < hostpid.STRICT.deadline


class TestRestart:
    def test_a_new_socket_at_the_same_path(self) -> None:
        with FakeBroker(script=[Silent(), Reply(pid=21), Reply(pid=22)]) as broker:
            path, policy = broker.socket_path, broker.policy
            # Held open, the old inode cannot be reused for the new socket,
            # and its link count tells whether its name is gone.
            old = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.settimeout(10)
            held.connect(path)
            held.sendall(wire.GET_HOST_PID_REQUEST)
            wait_for(lambda: broker.requests, "the held connection's request")
            assert broker.restart() is broker
            assert held.recv(12) == b"", "a connection open at the restart is closed unanswered"
            held.close()
            try:
                before = os.fstat(old)
            finally:
                os.close(old)
            assert before.st_nlink == 0, "the old socket is gone"
            after = os.lstat(path)
            assert stat.S_ISSOCK(after.st_mode)
            assert (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino)
            assert broker.policy == policy, "the same path and the same trust"
            assert query(broker) == 21, "the script goes on where it was"
            broker.restart()
            assert query(broker) == 22
            assert broker.restarts == 2

    def test_leaves_nothing_behind_after_restarts(self) -> None:
        threads_before = set(threading.enumerate())
        fds_before = set(os.listdir("/proc/self/fd"))
        broker = FakeBroker().start()
        for _ in range(3):
            broker.restart()
            assert query(broker) == os.getpid()
        assert len(set(threading.enumerate()) - threads_before) == 1
        path = broker.socket_path
        broker.stop()
        assert set(threading.enumerate()) == threads_before
        assert set(os.listdir("/proc/self/fd")) == fds_before
        assert not os.path.exists(os.path.dirname(path))

    def test_only_a_running_broker_restarts(self) -> None:
        broker = FakeBroker()
        with pytest.raises(RuntimeError, match="restarts"):
            broker.restart()
        broker.start()
        broker.stop()
        with pytest.raises(RuntimeError, match="restarts"):
            broker.restart()

    def test_the_restart_leaves_alone_what_it_did_not_make(self) -> None:
        """A file put at the path is not removed; the new bind then fails, and the double stops."""
        broker = FakeBroker().start()
        path = Path(broker.socket_path)
        path.unlink()
        path.write_text("someone else's")
        with pytest.raises(OSError):
            broker.restart()
        assert path.read_text() == "someone else's"
        path.unlink()
        path.parent.rmdir()
        assert repr(broker).startswith("<FakeBroker stopped")


class TestScriptWithTheReactor:
    """The Twisted client against scripts and restarts, with the reactor running."""

    @pytest_twisted.ensureDeferred
    async def test_twisted_client_through_a_script_and_a_restart(
        self, clean_reactor: None
    ) -> None:
        script = [Delay(0.2, then=Reply(pid=31)), Close(), Silent(), Reply(pid=32)]
        with FakeBroker(script=script, deadline=0.4) as broker:
            assert await hostpid.query_host_pid_deferred(broker.policy, broker.environ) == 31
            assert await hostpid.lookup_host_pid_deferred(broker.policy, broker.environ) is None
            with pytest.raises(hostpid.HostPidUnavailable) as caught:
                await hostpid.query_host_pid_deferred(broker.policy, broker.environ)
            assert caught.value.check == "deadline"
            broker.restart()
            assert await hostpid.query_host_pid_deferred(broker.policy, broker.environ) == 32

    @pytest_twisted.ensureDeferred
    async def test_blocking_client_on_the_reactor_thread_against_a_delay(
        self, clean_reactor: None
    ) -> None:
        from twisted.internet import reactor
        from twisted.internet.task import deferLater

        def on_the_reactor() -> int | None:
            assert reactor.running  # type: ignore[attr-defined]
            with FakeBroker(script=[Delay(0.1, then=Reply(pid=33))]) as broker:
                return blocking.lookup_host_pid(broker.policy, broker.environ)

        assert await deferLater(reactor, 0, on_the_reactor) == 33


# --- Downstream: a project's own test module, under trial and under pytest, as UID 1000. ---


def count_tests(source: str) -> int:
    """The test methods of the module's TestCase classes."""
    return sum(
        1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        and item.name.startswith("test")
    )


def run_downstream(source: str, module: str, runner: str, public_tmp: Path) -> None:
    """
    Run C{source} as C{module}.py under C{runner} as a real UID 1000 process,
    in a directory of its own, and check that every test in it passed and
    that its temporary directory is empty afterwards.
    """
    require_root()
    work = public_tmp / "downstream"
    scratch = work / "tmp"
    scratch.mkdir(parents=True)
    (work / f"{module}.py").write_text(source)
    for path in (work, scratch):
        os.chown(path, USER, USER)
    argv = {
        "trial": [sys.executable, "-m", "twisted.trial", module],
        "pytest": [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"{module}.py"],
    }[runner]
    env = subprocess_env(HOME=str(work), TMPDIR=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    env.pop("LIBVGPU_HOSTPID_BROKER", None)
    # A downstream project's own run: not this suite's options (a junit path
    # given to this run, bench/citime's, is not the downstream user's to write).
    env.pop("PYTEST_ADDOPTS", None)
    check = f"import os, sys; sys.exit(os.geteuid() != {USER} or os.getuid() != {USER})"
    whoami = subprocess.run(as_user_argv(USER, [sys.executable, "-c", check]), env=env)
    assert whoami.returncode == 0, f"the downstream run would not be UID {USER}"
    result = subprocess.run(
        as_user_argv(USER, argv), cwd=work, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    expected = count_tests(source)
    assert expected >= 3
    if runner == "trial":
        assert f"PASSED (successes={expected})" in output, output
    else:
        assert re.search(rf"\b{expected} passed\b", output), output
        assert not re.search(r"\b(skipped|failed|errors?)\b", output.splitlines()[-1])
    assert list(scratch.iterdir()) == [], "the fake brokers left files behind"


def docs_examples() -> dict[str, str]:
    """
    The downstream tests in C{docs/client.md}: each Python block right after
    a C{<!-- downstream-example: NAME.py -->} marker, exactly as written.
    """
    text = CLIENT_DOC.read_text()
    found = re.findall(
        r"^<!-- downstream-example: (\w+)\.py -->\n```python\n(.*?)^```$", text, re.M | re.S
    )
    assert found, "docs/client.md has no downstream-example block"
    return dict(found)


def test_the_docs_have_both_downstream_examples() -> None:
    """The parametrized run below would pass vacuously on a renamed marker."""
    assert set(docs_examples()) == {"test_pid_accounting", "test_retrying_client"}


@pytest.mark.privileged
@pytest.mark.parametrize("runner", ["trial", "pytest"])
def test_downstream_module_as_uid_1000(runner: str, public_tmp: Path) -> None:
    run_downstream(DOWNSTREAM.read_text(), "test_hostpid_fake_broker", runner, public_tmp)


@pytest.mark.privileged
@pytest.mark.parametrize("runner", ["trial", "pytest"])
@pytest.mark.parametrize("module", sorted(docs_examples()))
def test_docs_example_as_uid_1000(module: str, runner: str, public_tmp: Path) -> None:
    run_downstream(docs_examples()[module], module, runner, public_tmp)
