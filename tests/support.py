"""
Shared test support: real brokers in real processes, raw clients, and the
privileged-test rule.

Everything here talks to real sockets and real processes; nothing is mocked.
Waits are bounded polls on a condition, never a bare sleep.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import load
import pytest

from hostpid import defaults, wire
from hostpid.peercred import peer_credentials

REPO = Path(__file__).resolve().parent.parent
REQUIRE_PRIVILEGED = os.environ.get("HOSTPID_REQUIRE_PRIVILEGED") == "1"

#: How many times slower than an ordinary machine this one runs: 1 here; the
#: kernel matrix's emulated guests (tests/kernels/vm.py, TCG: measured 8-13x
#: slower) set C{HOSTPID_TIME_SCALE}.  It is the one factor every timing
#: bound is multiplied by (L{scaled}): what a bound asserts (answered before
#: the attacker's linger ends, within the deadline) stays the same; only the
#: unit of time grows.
TIME_SCALE = float(os.environ.get("HOSTPID_TIME_SCALE", "1") or "1")


def scaled(seconds: float) -> float:
    """C{seconds} of an ordinary machine's time on this one (L{TIME_SCALE})."""
    return seconds * TIME_SCALE


#: Used for every bounded wait: generous, since CI machines are shared.
WAIT_SECONDS = scaled(15.0)

#: A raw client's socket timeout (L{connect}, L{exchange}, L{ask_pid}).
CLIENT_TIMEOUT = scaled(5.0)

def skip_or_fail(reason: str) -> None:
    """
    Skip with C{reason}, except under C{HOSTPID_REQUIRE_PRIVILEGED=1}, where
    a test that cannot run is a failure: CI must not go green by skipping.
    """
    if REQUIRE_PRIVILEGED:
        pytest.fail(f"HOSTPID_REQUIRE_PRIVILEGED=1 but {reason}")
    pytest.skip(reason)


def require_root() -> None:
    if os.geteuid() != 0:
        skip_or_fail("this test needs root (real namespaces, setuid children, root-owned paths)")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"this test needs {name!r} on PATH")
        raise AssertionError("unreachable")
    return path


def release_immutable(path: Path | str) -> None:
    """
    Clear the immutable attribute on every directory below C{path} (never
    following a link): a prepared broker mountpoint carries it
    (L{hostpid.fileattr}), and neither C{rmtree} nor C{rm -rf} can
    remove an immutable directory.  Best effort: what cannot be opened or
    cleared is left for the removal to report.
    """
    from hostpid import fileattr

    for top, directories, _ in os.walk(path, topdown=False, followlinks=False):
        for name in [*directories, ""]:
            try:
                fd = os.open(os.path.join(top, name) if name else top,
                             os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fileattr.clear_immutable(fd)
            except OSError:
                pass
            finally:
                os.close(fd)


def remove_tree(path: Path | str, ignore_errors: bool = False) -> None:
    """C{shutil.rmtree} of a tree that may hold a prepared, immutable broker mountpoint."""
    release_immutable(path)
    shutil.rmtree(path, ignore_errors=ignore_errors)


def wait_for(
    condition: Callable[[], object], what: str, timeout: float = WAIT_SECONDS
) -> object:
    """
    Poll C{condition} until it returns something true, failing after
    C{timeout} times the machine's load: when C{timeout} has passed, the load
    is measured once (tests/load.py) and the wait goes on until C{timeout}
    times that factor, so that a loaded machine slows what is awaited
    without failing the wait (on a quiet one the factor is 1).
    """
    started = time.monotonic()
    allowed, factor = timeout, None
    delay = 0.001
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() - started > allowed:
            if factor is None:
                factor = load.factor()
                allowed = timeout * factor
                continue
            loaded = f" (times the load factor {factor:g})" if factor != 1 else ""
            raise AssertionError(f"timed out after {timeout}s{loaded} waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def subprocess_env(extra: dict[str, str] | None = None, **more: str) -> dict[str, str]:
    """
    This process's environment with the working tree first on C{PYTHONPATH},
    so that child processes run the code under test (and find its twistd
    plugin) whether or not the package is installed.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
    )
    env.pop("NOTIFY_SOCKET", None)
    # Children keep the bytecode they compile, as an installed package has
    # its own: without it every broker a test starts compiles the tree's
    # hundred-odd modules again (a tenth of a second no installed broker
    # spends), and restart tests would measure the compiler.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if extra:
        env.update(extra)
    env.update(more)
    return env


TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]


def twistd_argv(*broker_args: str) -> list[str]:
    return [*TWISTD, "--nodaemon", "--pidfile=", "hostpid-broker", *broker_args]


def as_user_argv(uid: int, argv: Sequence[str], gid: int | None = None) -> list[str]:
    """
    C{argv} run as C{uid} (a real UID and effective UID change via setpriv).

    The process keeps one capability, CAP_DAC_READ_SEARCH, as an ambient
    capability: the interpreter lives under C{/root} (mode 0700) and a CI
    checkout may sit in a 0700 temporary directory, and this is what lets a
    non-root process load them.  It changes nothing the tests check: the
    kernel still reports UID C{uid} through SO_PEERCRED, the process still
    cannot write what C{uid} cannot write, and C{geteuid()} is C{uid}.
    """
    require_tool("setpriv")
    group = uid if gid is None else gid
    return [
        "setpriv", f"--reuid={uid}", f"--regid={group}", "--clear-groups",
        "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
        *argv,
    ]


def hostpid_argv(*args: str) -> list[str]:
    """The C{hostpid} command, run from the working tree."""
    return [sys.executable, "-m", "hostpid.cli", *args]


class BrokerProcess:
    """
    A real broker: C{twistd hostpid-broker} in its own process.

    Output goes to a file so a chatty broker can never block on a full pipe.
    """

    def __init__(
        self,
        directory: Path | str | None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        gate: str | None = "1",
        preexec_fn: Callable[[], None] | None = None,
        argv_prefix: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.directory = Path(directory if directory is not None else "/var/run/hami/hostpid")
        self.socket_path = self.directory / "broker.sock"
        where = ["--directory", str(self.directory)] if directory is not None else []
        if TIME_SCALE != 1 and not any(a.startswith("--deadline") for a in args):
            # The broker's own timing bound: scaled like the tests' (TIME_SCALE).
            args = [*args, "--deadline", str(scaled(defaults.DEADLINE))]
        extra = dict(env or {})
        environment = subprocess_env(extra)
        environment.pop("LIBVGPU_HOSTPID_BROKER", None)
        if gate is not None:
            environment["LIBVGPU_HOSTPID_BROKER"] = gate
        self._log = tempfile.TemporaryFile()
        self.argv = [
            *argv_prefix,
            *twistd_argv(*where, *args),
        ]
        self.process = subprocess.Popen(
            self.argv,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
            cwd=tempfile.gettempdir(),
            pass_fds=tuple(pass_fds),
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def wait_listening(self, timeout: float = WAIT_SECONDS) -> None:
        """Wait until the broker answers a request, or fail with its output."""

        def answering() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"broker exited {self.process.returncode} before listening:\n"
                    + self.output()
                )
            try:
                return exchange(self.socket_path) is not None
            except OSError:
                return False

        wait_for(answering, f"the broker at {self.socket_path}", timeout)

    def wait_exit(self, timeout: float = WAIT_SECONDS) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"broker did not exit within {timeout}s:\n{self.output()}"
            ) from None

    def terminate(self, timeout: float = WAIT_SECONDS) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
        self._log.close()


@contextmanager
def running_broker(directory: Path | str, *args: str, **kwargs: object) -> Iterator[BrokerProcess]:
    """A broker started, waited for, and stopped with SIGTERM afterwards."""
    with BrokerProcess(directory, args, **kwargs) as broker:  # type: ignore[arg-type]
        broker.wait_listening()
        yield broker
        broker.terminate()


def connect(path: Path | str, timeout: float = CLIENT_TIMEOUT) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except BaseException:
        sock.close()
        raise
    return sock


def stale_socket(path: Path | str) -> None:
    """Leave a socket file with no listener behind, as a killed broker does."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.close()


def read_until_eof(sock: socket.socket, limit: int = 64) -> bytes:
    chunks = []
    total = 0
    while total < limit:
        chunk = sock.recv(limit - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def exchange(
    path: Path | str, payload: bytes = wire.GET_HOST_PID_REQUEST, timeout: float = CLIENT_TIMEOUT
) -> bytes:
    """Send C{payload} on a fresh connection and return everything until EOF."""
    with connect(path, timeout) as sock:
        sock.sendall(payload)
        return read_until_eof(sock)


def ask_pid(path: Path | str, timeout: float = CLIENT_TIMEOUT) -> int | None:
    """The PID the broker reports for this process, or C{None} on any failure."""
    try:
        reply = exchange(path, timeout=timeout)
    except OSError:
        return None
    if len(reply) != wire.RESPONSE_SIZE:
        return None
    response = wire.parse_response(reply)
    if response.status != wire.Status.OK:
        return None
    return response.pid


@contextmanager
def attacker_process(source: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], object]]:
    """
    A real UID 1000 process running C{python -c source args}: yields it and
    the JSON line it prints first (what it did), and kills it afterwards.
    """
    process = subprocess.Popen(
        as_user_argv(1000, [sys.executable, "-c", source, *args]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        yield process, json.loads(process.stdout.readline())
    finally:
        process.kill()
        process.wait()


#: The clients of L{each_answered} and L{paced_clients}: argv socket path,
#: count, bound, this folder (for L{ask_pid}), whether to go on after a
#: client that was not answered ("all") or stop ("first"), and the pause
#: between clients.  Prints its PID and, per client, the PID answered (or
#: null) and the wait.
_CLIENTS = r"""
import json, os, signal, sys, time
sys.path.insert(0, sys.argv[4])
from support import ask_pid
signal.signal(signal.SIGALRM, lambda *_: None)
signal.siginterrupt(signal.SIGALRM, True)
signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
path, count, bound = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
every, pause = sys.argv[5] == "all", float(sys.argv[6])
results = []
for _ in range(count):
    started = time.monotonic()
    pid = ask_pid(path, timeout=bound)
    results.append((pid, round(time.monotonic() - started, 3)))
    if pid is None and not every:
        break
    if pause:
        time.sleep(pause)
signal.setitimer(signal.ITIMER_REAL, 0)  # before finalization restores SIGALRM's default
print(json.dumps([os.getpid(), results]), flush=True)
"""


def _clients_argv(
    path: Path | str, count: int, bound: float, every: bool, pause: float
) -> list[str]:
    return [sys.executable, "-c", _CLIENTS, os.fspath(path), str(count), str(bound),
            str(Path(__file__).resolve().parent), "all" if every else "first", str(pause)]


def each_answered(path: Path | str, count: int, bound: float) -> list[float]:
    """
    C{count} real clients, one after another, each answered with its own
    PID within C{bound} seconds; their waits.

    The clients run in a child process whose own closes an interval timer
    interrupts: on kernels before 6.10 the Unix garbage collector runs in
    whichever process next closes a Unix socket, and an attacker's in-flight
    garbage holding a lingering socket would otherwise hang the test itself
    (with nothing to interrupt it) rather than the broker.
    """
    done = subprocess.run(
        _clients_argv(path, count, bound, every=False, pause=0.0),
        capture_output=True, text=True, env=subprocess_env(), timeout=count * bound + WAIT_SECONDS,
    )
    assert done.returncode == 0, f"clients exited {done.returncode}: {done.stderr}"
    own, results = json.loads(done.stdout)
    waits = [wait for _, wait in results]
    assert len(results) == count and all(pid == own for pid, _ in results), (
        f"a real client was not answered: {results}"
    )
    assert max(waits) < bound
    return waits


class PacedClients:
    """
    C{count} real clients started in the background (as L{each_answered}'s,
    in a child process), one after another with C{pause} seconds between
    them, each a fresh connection with C{bound} on each step; unlike
    L{each_answered} every one is tried, answered or not, so that a test
    can count how many were answered while something else goes on.
    """

    def __init__(self, path: Path | str, count: int, bound: float, pause: float) -> None:
        self.count = count
        self.bound = bound
        self.process = subprocess.Popen(
            _clients_argv(path, count, bound, every=True, pause=pause),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
        )
        self.timeout = count * (bound + pause) + WAIT_SECONDS

    def results(self) -> list[tuple[bool, float]]:
        """Each client: whether it was answered with its own PID, and its wait."""
        try:
            out, err = self.process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise AssertionError(f"the clients did not finish within {self.timeout}s") from None
        assert self.process.returncode == 0, f"clients exited {self.process.returncode}: {err}"
        own, results = json.loads(out)
        assert len(results) == self.count
        return [(pid == own, wait) for pid, wait in results]

    def answered_within(self, bound: float) -> tuple[int, list[float]]:
        """How many were answered within C{bound}, and every wait."""
        results = self.results()
        return sum(1 for ok, wait in results if ok and wait < bound), [w for _, w in results]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def in_child(work, uid: int | None = None) -> tuple[int, int]:
    """
    Fork; in the child optionally become C{uid}, run C{work()} -> int and
    report it.  No exec: the child is this very program, as a workload is.

    @return: (child's PID, what C{work} returned; -1 on failure).
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(read_end)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            result = work()
            os.write(write_end, struct.pack("q", -1 if result is None else result))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        data = reader.read()
    os.waitpid(pid, 0)
    assert len(data) == 8, "the child reported nothing"
    return pid, struct.unpack("q", data)[0]


def nspid(pid: int) -> list[int]:
    """The C{NSpid} line of C{/proc/PID/status}: host PID first, innermost last."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(field) for field in line.split()[1:]]
    raise AssertionError(f"no NSpid in /proc/{pid}/status")


def open_fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def descriptor_links(pid: int) -> dict[str, str]:
    """Each open descriptor of C{pid} and what it names (C{""} if closed meanwhile)."""
    links = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            links[fd] = ""
    return links


def descriptors_since(pid: int, before: dict[str, str]) -> int:
    """
    How many descriptors C{pid} holds beyond those of C{before}
    (L{descriptor_links}) it still has.  A count measured against a number
    taken earlier is not this: the broker opens short-lived descriptors of
    its own at moments a test cannot choose, so a baseline count taken while
    one was open is never reached again once it is closed.
    """
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if fd not in before:
            count += 1
            continue
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") != before[fd]
        except OSError:
            count += 1
    return count


def _names_listener(local: str, users: str, path: Path | str) -> bool:
    """
    Whether an C{ss} row's bound name is the socket at C{path}: either that
    path, or C{/proc/self/fd/N/NAME} (the broker binds through its directory's
    descriptor) where descriptor N of the owning process is C{path}'s directory.
    """
    path = os.fspath(path)
    if local == path:
        return True
    bound = re.fullmatch(r"/proc/self/fd/(\d+)/(.+)", local)
    if bound is None or bound.group(2) != os.path.basename(path):
        return False
    try:
        directory = os.stat(os.path.dirname(path))
    except OSError:
        return False
    for pid in re.findall(r"pid=(\d+)", users):
        try:
            if os.path.samestat(os.stat(f"/proc/{pid}/fd/{bound.group(1)}"), directory):
                return True
        except OSError:
            continue
    return False


def _listener_queue(path: Path | str) -> tuple[int, int]:
    ss = require_tool("ss")
    rows = subprocess.run(
        [ss, "-xlnHp"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for row in rows:
        fields = row.split()
        if len(fields) > 4 and _names_listener(fields[4], row, path):
            return int(fields[2]), int(fields[3])
    return 0, 0


def listen_queue(path: Path | str) -> int:
    """
    Connections waiting in the accept queue of the listener at C{path}
    (the C{Recv-Q} that C{ss} reports for a listening Unix socket).
    """
    return _listener_queue(path)[0]


def listen_backlog(path: Path | str) -> int:
    """The accept queue's capacity (C{ss}'s C{Send-Q} for a listener)."""
    return _listener_queue(path)[1]


def thread_states(pid: int) -> str:
    """
    Each thread of C{pid}: its name, state and where in the kernel it waits
    (C{wchan}), for the message of a test that found a process stuck.
    """
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            state = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
            name = task.joinpath("comm").read_text().strip()
        except OSError:
            continue
        try:
            wchan = task.joinpath("wchan").read_text().strip() or "-"
        except OSError:
            wchan = "?"
        lines.append(f"{tid} {name} {state} {wchan}")
    return "; ".join(lines)


def revision() -> str:
    """This checkout's C{git describe --always --dirty}, for a report ("?" outside git)."""
    result = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                            capture_output=True, text=True, check=False)
    return result.stdout.strip() or "?"


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process C{pid}, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def private_tmp(
    report: str = "-", keep: Sequence[str | Path] = (), private_run: bool = False
) -> Iterator[list[str]]:
    """
    The command prefix, ending in C{--}, that runs a command under
    C{privatetmp.py}: in a private mount namespace whose C{/tmp} is a fresh
    tmpfs (and C{/run} too with C{private_run}), C{keep} still visible at
    their own paths, C{report} the descriptor for its report (C{-}: none).
    The stage directory it mounts over is made here and removed afterwards.
    """
    require_root()
    unshare = require_tool("unshare")
    require_tool("mount")
    options = [option for path in keep for option in ("--keep", str(path))]
    if private_run:
        options.append("--private-run")
    stage = tempfile.mkdtemp(prefix="hostpid-privatetmp-", dir="/tmp")
    try:
        yield [unshare, "--mount", "--propagation", "private", sys.executable,
               str(REPO / "tests" / "privatetmp.py"), stage, report, *options, "--"]
    finally:
        os.rmdir(stage)


class DefaultLayout:
    """
    A private mount namespace whose C{/run} is an empty tmpfs and whose
    C{/tmp} is private too (C{privatetmp.py}), so that a broker can run as
    root with its default paths (C{/var/run/hami/hostpid}, and the shipped
    DaemonSet's C{--lock-parent /tmp/vgpulock}) without touching the host's;
    commands are run in it with C{nsenter}, and the test reaches its socket
    through C{/proc/PID/root}.
    """

    def __init__(self) -> None:
        self.nsenter = require_tool("nsenter")
        self._private = ExitStack()
        prefix = self._private.enter_context(private_tmp(private_run=True))
        self.holder = subprocess.Popen(
            [*prefix, "sh", "-c", "echo ready && exec cat"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.holder.stdout is not None
        assert self.holder.stdout.readline() == "ready\n"

    @property
    def prefix(self) -> list[str]:
        return [self.nsenter, f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"]

    def seen_from_here(self, path: str) -> Path:
        """
        C{path} in the namespace, reached from here.  Symlinks on the way
        (C{/var/run -> /run}) are resolved first: an absolute link met under
        C{/proc/PID/root} would be resolved against this process's root.
        """
        return Path(f"/proc/{self.holder.pid}/root{os.path.realpath(path)}")

    def close(self) -> None:
        assert self.holder.stdin is not None
        self.holder.stdin.close()
        self.holder.wait(WAIT_SECONDS)
        self._private.close()

    def __enter__(self) -> DefaultLayout:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_with_private_tmp(
    argv: Sequence[str], input: bytes = b"", env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, dict[str, int] | None]]:
    """
    Run C{argv} in a private mount namespace whose C{/tmp} is a fresh tmpfs,
    for tests of the default paths (C{/tmp/vgpulock}): the host's lock parent
    is never touched.  Returns the result and what C{/tmp/vgpulock} and
    C{/tmp/vgpulock/hostpid} were in that private C{/tmp} afterwards.
    """
    read_end, write_end = os.pipe()
    try:
        with private_tmp(str(write_end)) as prefix:
            result = subprocess.run(
                [*prefix, *argv],
                input=input, env=env if env is not None else subprocess_env(),
                capture_output=True, timeout=60, check=False, pass_fds=(write_end,),
            )
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as report:
            read_end = -1
            text = report.read().decode()
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    import json

    return result, json.loads(text) if text else {}


def accepted_from_exited_child(path: Path) -> socket.socket:
    """
    A server-side connection whose client process connected, exited, and was
    reaped before the server looked at it.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(path))
    listener.listen(1)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(os.fspath(path))
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    connection, _ = listener.accept()
    listener.close()
    assert peer_credentials(connection).pid == child
    return connection
