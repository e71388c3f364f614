"""
What C{bench/run} and C{bench/soak} share: building the load generator,
starting a server under test in its own process, and reading its CPU time,
memory and descriptors from C{/proc}.

Standard library only, and nothing from C{hostpid}: the bench measures
whatever server it is given, so it must not depend on the code it measures.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LOADGEN_SOURCE = BENCH / "loadgen.c"
#: The fair yardstick: a C server doing the broker's work per connection.
YARDSTICK_SOURCE = BENCH / "yardstick.c"
#: Where every tool writes its report by default: one folder per UTC day,
#: one entry per run in it.  Reports are generated and kept out of docs/,
#: which holds the guides; docs/performance.md names the latest.
REPORTS = BENCH / "reports"

#: The one request of protocol version 1 ("HPID", version 1, command 1).
REQUEST = b"HPID\x00\x01\x00\x01"
RESPONSE = struct.Struct("!4sHHI")

#: Descriptors a server or generator may need: 5000 silent clients and more.
NOFILE_WANTED = 65536

#: The project's broker, from this working tree.  Placeholders are filled by
#: L{ServerProcess}; C{{python}} is this interpreter, so a venv run measures
#: the venv's Twisted.
HOSTPID_COMMAND = (
    "{python} -c 'from twisted.scripts.twistd import run; run()' --nodaemon --pidfile= "
    "hostpid-broker --directory {dir} --max-connections {max_connections} --deadline {deadline}"
)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def default_report(kind: str, suffix: str = "") -> Path:
    """
    A new report's path: C{bench/reports/DATE/KIND-TIME}C{suffix}, in UTC,
    so that runs of one day sit together and never overwrite each other.
    """
    import datetime

    now = datetime.datetime.now(datetime.UTC)
    return REPORTS / now.strftime("%Y-%m-%d") / f"{kind}-{now.strftime('%H%M%SZ')}{suffix}"


def build_c(out_dir: Path, source: Path, name: str) -> Path:
    """
    Compile C{source} into C{out_dir/name} with the system compiler (C{$CC},
    default C{cc}): the load generator and the C yardstick are built the
    same way, by this one function.
    """
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise SystemExit(
            f"bench: no C compiler {compiler!r} on PATH (install gcc, or set CC); "
            "the load generator is C so that it is never the bottleneck"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / name
    subprocess.run(
        [compiler, "-O2", "-Wall", "-o", str(binary), str(source), "-lm"], check=True
    )
    return binary


def build_loadgen(out_dir: Path, source: Path = LOADGEN_SOURCE) -> Path:
    """
    Compile C{source} (by default C{bench/loadgen.c}; another generator
    with the same closed-loop options and JSON fields will do).  C: a
    Python generator would cost more CPU per transaction than the server
    it measures.
    """
    return build_c(out_dir, source, "loadgen")


def build_yardstick(out_dir: Path, source: Path = YARDSTICK_SOURCE) -> Path:
    """
    Compile C{bench/yardstick.c}, the C server that makes the broker's
    system calls per connection (see its header): the fair yardstick.
    """
    return build_c(out_dir, source, "yardstick")


def yardstick_command(binary: Path, mode: str) -> str:
    """
    A L{ServerProcess} command line for the yardstick in descriptor mode
    C{mode} (C{refused} or C{received}), with the broker's limit, deadline
    and listen backlog.
    """
    return (
        f"{shlex.quote(str(binary))} --mode {mode} --socket {{socket}} "
        "--limit {max_connections} --deadline {deadline} --backlog 1024"
    )


def raise_nofile(want: int = NOFILE_WANTED) -> None:
    """
    Raise this process's RLIMIT_NOFILE soft limit towards C{want} (and the hard
    limit too when privileged).  Used as a C{preexec_fn}, so the server and the
    generator get room for thousands of connections whatever C{ulimit -n} says.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return
        except (ValueError, OSError):
            pass
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def child_setup(cpu: int | None) -> Callable[[], None]:
    """A C{preexec_fn}: raise the descriptor limit and pin to C{cpu} if given."""

    def setup() -> None:
        raise_nofile()
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    return setup


def cpu_plan(server_cpu: int | None = None, load_cpu: int | None = None) -> tuple[
    int | None, int | None
]:
    """
    Server on one CPU and load on another, where there are two: the server's
    figures must not depend on how busy the generator keeps the other core.
    On one CPU nothing is pinned.
    """
    available = sorted(os.sched_getaffinity(0))
    if server_cpu is not None or load_cpu is not None:
        return server_cpu, load_cpu
    if len(available) >= 2:
        return available[0], available[1]
    return None, None


def exchange(path: str, timeout: float = 2.0) -> bytes:
    """One request on a fresh connection; everything the server sent until EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(REQUEST)
        data = b""
        while len(data) < 64:
            chunk = sock.recv(64)
            if not chunk:
                break
            data += chunk
        return data


def answers_own_pid(path: str, timeout: float = 2.0) -> bool:
    try:
        reply = exchange(path, timeout)
    except OSError:
        return False
    if len(reply) != RESPONSE.size:
        return False
    magic, version, status, pid = RESPONSE.unpack(reply)
    return (magic, version, status, pid) == (b"HPID", 1, 0, os.getpid())


class ProcStats:
    """The figures the bench reads about a running process, from C{/proc}."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process (every thread), in seconds."""
        return sum(self.user_and_system())

    def user_and_system(self) -> tuple[float, float]:
        """utime and stime of the whole process (every thread), in seconds."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        # The command name is in parentheses and may hold spaces: split after it.
        fields = stat[stat.rindex(")") + 2 :].split()
        return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS

    def status_kb(self, field: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    def vmhwm_kb(self) -> int:
        """Peak resident set size so far."""
        return self.status_kb("VmHWM")

    def vmrss_kb(self) -> int:
        return self.status_kb("VmRSS")

    def nofile_limit(self) -> int | None:
        """The soft RLIMIT_NOFILE the process actually runs with."""
        for line in Path(f"/proc/{self.pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return None if soft == "unlimited" else int(soft)
        return None

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


class ServerProcess:
    """
    A server under test, started from a command line with placeholders:
    C{{socket}}, C{{dir}}, C{{max_connections}}, C{{deadline}}, C{{python}}.

    The command is split with shlex and run without a shell, so the PID we
    hold is the server's own and C{/proc/PID} describes the server, not a
    shell around it.  Output goes to a file: a chatty server can never block
    on a full pipe.
    """

    def __init__(
        self,
        command: str,
        *,
        cpu: int | None,
        max_connections: int,
        deadline: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="hostpid-bench-"))
        # The broker requires 0711 on its directory; other servers do not care.
        os.chmod(self.directory, 0o711)
        self.socket_path = str(self.directory / "broker.sock")
        values = {
            "socket": self.socket_path,
            "dir": str(self.directory),
            "max_connections": str(max_connections),
            "deadline": f"{deadline:g}",
            "python": shlex.quote(sys.executable),
        }
        self.argv = shlex.split(command.format(**values))
        environment = dict(os.environ if env is None else env)
        environment["LIBVGPU_HOSTPID_BROKER"] = "1"
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), environment.get("PYTHONPATH", "")) if p
        )
        environment.pop("NOTIFY_SOCKET", None)
        self.log_path = self.directory.with_suffix(".log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.argv,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=child_setup(cpu),
            cwd=tempfile.gettempdir(),
        )
        self.stats = ProcStats(self.process.pid)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the server answers this process with its own PID."""
        deadline = time.monotonic() + timeout
        delay = 0.005
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"server exited {self.process.returncode} before answering: "
                    f"{shlex.join(self.argv)}\n{self.output()}"
                )
            if answers_own_pid(self.socket_path):
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        raise RuntimeError(
            f"server not answering after {timeout}s: {shlex.join(self.argv)}\n{self.output()}"
        )

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it will not go; the directory is removed."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            self.log_path.unlink()
        except OSError:
            pass
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def run_json(argv: Sequence[str], cpu: int | None, timeout: float) -> dict[str, object]:
    """Run the load generator (pinned to C{cpu}) and parse its one JSON line."""
    done = subprocess.run(
        list(argv),
        capture_output=True,
        preexec_fn=child_setup(cpu),
        timeout=timeout,
        check=False,
    )
    lines = done.stdout.decode().strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"load generator failed ({done.returncode}): {shlex.join(argv)}\n"
            + done.stderr.decode(errors="replace")
        )
    result: dict[str, object] = json.loads(lines[-1])
    return result


def run_json_many(
    argvs: Sequence[Sequence[str]], cpu: int | None, timeout: float
) -> list[dict[str, object]]:
    """
    Run several load generators at once (each pinned to C{cpu} if given) and
    parse each one's JSON line: several tenants attacking together.
    """
    processes = [
        subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=child_setup(cpu))
        for argv in argvs
    ]
    results: list[dict[str, object]] = []
    failure = None
    for argv, process in zip(argvs, processes, strict=True):
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        lines = out.decode().strip().splitlines()
        if process.returncode != 0 or not lines:
            failure = failure or (
                f"load generator failed ({process.returncode}): {shlex.join(argv)}\n"
                + err.decode(errors="replace")
            )
            continue
        results.append(json.loads(lines[-1]))
    if failure is not None:
        raise RuntimeError(failure)
    return results


# --- Evidence: what produced the figures. ---


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def command_output(argv: list[str]) -> str:
    """A command's stdout, stripped; empty when it fails or is missing."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False,
                              cwd=REPO, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def revision() -> dict[str, Any]:
    """The source revision; read-only git calls (no index refresh)."""
    head = command_output(["git", "rev-parse", "HEAD"])
    status = command_output(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"commit": head or None, "dirty": bool(status) if head else None,
            "dirty_files": status.splitlines()[:50]}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_environment() -> dict[str, Any]:
    """The machine, the interpreter and the revision a report was measured on."""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hostpid_origin = command_output([
        sys.executable, "-c", "import hostpid, twisted; print(hostpid.__file__)",
    ])
    try:
        somaxconn = Path("/proc/sys/net/core/somaxconn").read_text().strip()
    except OSError:
        somaxconn = None
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "kernel_version": platform.version(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_available": sorted(os.sched_getaffinity(0)),
        "loadavg_end": os.getloadavg(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "packages": {
            name: _version(name)
            for name in ("hostpid-broker", "twisted", "zope.interface", "attrs", "matplotlib")
        },
        "hostpid_imported_from": hostpid_origin or None,
        "cc": command_output([os.environ.get("CC", "cc"), "--version"]).splitlines()[:1],
        "somaxconn": somaxconn,
        "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "revision": revision(),
    }


# --- Progress on stderr. ---


def clock_text(seconds: float) -> str:
    """C{m:ss} (or C{h:mm:ss}): what a reader takes in at a glance."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """
    What a long run is doing, on stderr (stdout carries the report alone):
    the step, the server, the time elapsed and an estimate of what is left.

    On a terminal it is one line rewritten in place (carriage return, clear
    to end of line) a few times a second; anywhere else (a pipe, a CI log) it
    is a plain line at each new step and then every C{every} seconds, so a
    log shows progress without drowning in it.  A ticker thread keeps the
    line moving while the main thread blocks in a step; L{set} changes what
    it says, L{note} prints a line that stays.
    """

    def __init__(
        self,
        name: str,
        stream: Any = None,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (0.5 if self.tty else 10.0)
        self.clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self._step = ""
        self._server: str | None = None
        self._remaining: Callable[[], float | None] = lambda: None
        self._on_screen = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        elapsed = self.clock() - self.started
        server = f" [{self._server}]" if self._server else ""
        left = self._remaining()
        estimate = f", about {clock_text(left)} left" if left is not None else ""
        return f"{self.name}: {self._step}{server}; elapsed {clock_text(elapsed)}{estimate}"

    def _write(self, text: str, stays: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if stays else ""))
            self._on_screen = not stays
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def set(
        self,
        step: str,
        server: str | None = None,
        remaining: Callable[[], float | None] | None = None,
    ) -> None:
        """A new step: shown at once, then kept up to date."""
        with self._lock:
            self._step, self._server = step, server
            self._remaining = remaining or (lambda: None)
            self._write(self.line(), stays=False)

    def tick(self) -> None:
        with self._lock:
            if self._step:
                self._write(self.line(), stays=False)

    def note(self, text: str) -> None:
        """A line that stays (a result, a failure), above the moving one."""
        with self._lock:
            self._write(f"{self.name}: {text}", stays=True)
            if self.tty and self._step:
                self._write(self.line(), stays=False)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.tick()

    def __enter__(self) -> Progress:
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.tty and self._on_screen:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            self._on_screen = False
