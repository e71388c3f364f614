"""
Podman as a real CDI consumer, for the e2e tests and the CDI benchmark.

Debian's podman 4.3 has no C{--cdi-spec-dir}: it reads specs from
C{/etc/cdi} and C{/var/run/cdi} only.  So a L{CdiNode} holds a private mount
namespace (a C{sleep} started by C{unshare -m --propagation private}) with
fresh tmpfs mounts on those two directories, and runs C{hostpid cdi}, the
broker and podman inside it by C{nsenter}: nothing on the host's real spec
directories is read or changed.  (If the host lacks the two mountpoints they
are created, and removed again afterwards if still empty.)

Each container: C{--rootfs} on a directory (no image, no registry) holding
only the C{/bin}-style symlinks, with the host's C{/usr} and C{/etc} and this
Python and working tree bound read-only (L{PythonLayout}, the same as the
runc e2e test) and a tmpfs C{/tmp}; C{--runtime runc} (crun fails on this
machine's hybrid cgroup layout); private C{--root}, C{--runroot} and
C{--tmpdir}; no network; the ulimits this machine needs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import stat
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from support import require_tool, wait_for
from test_runc import ContainerRun, PythonLayout, make_rootfs, query_script

PODMAN_TIMEOUT = 120.0
#: The spec directories podman 4.3 reads (C{/var/run} is C{/run} here).
SPEC_DIRECTORIES = ("/etc/cdi", "/run/cdi")


class CdiNode:
    """A private mount namespace with empty CDI spec directories, and podman in it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.podman = require_tool("podman")
        self.runc = require_tool("runc")
        unshare = require_tool("unshare")
        sleep = os.path.realpath(require_tool("sleep"))
        self.nsenter = require_tool("nsenter")
        self._created: list[str] = []
        for directory in SPEC_DIRECTORIES:
            if not os.path.lexists(directory):
                os.mkdir(directory, 0o755)
                self._created.append(directory)
        self.holder = subprocess.Popen(
            [unshare, "-m", "--propagation", "private", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
        )
        ours = os.readlink("/proc/self/ns/mnt")
        # The namespace is new as soon as unshare(2) returns, but its mounts
        # are still shared with ours (so with the host's) until unshare(1)
        # has made them private, which it does before it execs sleep: a
        # mount made inside before then would appear on the host as well.
        wait_for(
            lambda: self._namespace() not in (None, ours) and self._executable() == sleep,
            "the private mount namespace",
        )
        for directory in SPEC_DIRECTORIES:
            self.inside(["mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", directory])
        self.rootfs = make_rootfs(workdir)
        self.python = PythonLayout.of_this_process()
        self.runs: list[ContainerRun] = []

    def _executable(self) -> str | None:
        try:
            return os.readlink(f"/proc/{self.holder.pid}/exe")
        except OSError:
            return None

    def _namespace(self) -> str | None:
        try:
            return os.readlink(f"/proc/{self.holder.pid}/ns/mnt")
        except OSError:
            return None

    @property
    def prefix(self) -> list[str]:
        """Run a command inside the private mount namespace."""
        return [self.nsenter, "-t", str(self.holder.pid), "-m", "--"]

    def inside(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.prefix, *argv], capture_output=True, text=True, timeout=PODMAN_TIMEOUT,
            check=False, **kwargs,  # type: ignore[call-overload]
        )
        assert result.returncode == 0, (argv, result.stdout, result.stderr)
        return result  # type: ignore[no-any-return]

    def podman_argv(self) -> list[str]:
        return [
            self.podman, "--root", str(self.workdir / "root"),
            "--runroot", str(self.workdir / "runroot"),
            "--tmpdir", str(self.workdir / "podman-tmp"),
            "--cgroup-manager", "cgroupfs", "--events-backend", "file",
            "--runtime", self.runc,
        ]

    def run(
        self,
        name: str,
        *,
        devices: Sequence[str] = (),
        volumes: Sequence[str] = (),
        envs: dict[str, str] | None = None,
        uid: int = 1000,
        args: Sequence[str] | None = None,
        quiet: bool = False,
    ) -> ContainerRun:
        """One C{podman run --rm} to completion: what it printed, its host PID, its time."""
        pid_file = self.workdir / f"pid-{uuid.uuid4().hex[:12]}"
        binds = [f"{host}:{inside}:ro" for host, inside in
                 (("/usr", "/usr"), ("/etc", "/etc"), *self.python.binds)]
        env = {
            "PYTHONPATH": ":".join(self.python.pythonpath),
            "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": "/",
            **(envs or {}),
        }
        argv = [
            *self.prefix, *self.podman_argv(), "run", "--rm", "--rootfs",
            "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096",
            "--user", f"{uid}:{uid}", "--pidfile", str(pid_file),
            "--tmpfs", "/tmp:rw,nosuid,nodev,mode=1777,size=16m",
            *(option for bind in binds for option in ("-v", bind)),
            *(option for volume in volumes for option in ("-v", volume)),
            *(option for device in devices for option in ("--device", device)),
            *(option for key, value in env.items() for option in ("-e", f"{key}={value}")),
            str(self.rootfs),
            *(args or ["/bin/sh", "-c", query_script(self.python.executable)]),
        ]
        started = time.monotonic()
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=PODMAN_TIMEOUT, check=False)
        seconds = time.monotonic() - started
        host_pid = int(pid_file.read_text()) if pid_file.exists() else None
        run = ContainerRun(name, result.returncode, host_pid, result.stdout, result.stderr,
                           seconds)
        self.runs.append(run)
        if not quiet:
            print(f"\n[podman] {name}: uid={uid} devices={list(devices)} exit={run.exit_code} "
                  f"host_pid={host_pid} printed={run.printed_pid()} seconds={seconds:.3f} "
                  f"facts={run.facts()} stderr={run.stderr.strip()!r}")
        return run

    def close(self) -> None:
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait()
        for directory in self._created:
            try:
                os.rmdir(directory)
            except OSError:
                pass
        shutil.rmtree(self.workdir / "root", ignore_errors=True)


class RootlessPodman:
    """
    Podman run by UID 1000 (rootless), with C{runc}: the container's root is
    UID 1000 on the host, in a user namespace of its own (a single mapping:
    this machine's C{/etc/subuid} has no range, and podman says so and
    falls back to it).  Same root filesystem and Python as the runc e2e
    tests; a private C{HOME}, C{XDG_RUNTIME_DIR} and storage, all under
    C{workdir} (which must be reachable by UID 1000).
    """

    UID = 1000

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.podman = require_tool("podman")
        self.runc = require_tool("runc")
        require_tool("newuidmap")
        self.home = workdir / "home"
        self.runtime_dir = workdir / "xdg-run"
        for directory, mode in ((self.home, 0o755), (self.runtime_dir, 0o700)):
            directory.mkdir(mode=mode)
            os.chown(directory, self.UID, self.UID)
        self.rootfs = make_rootfs(workdir)
        # podman creates /etc and the mountpoints in it as the rootless user.
        os.chown(self.rootfs, self.UID, self.UID)
        self.python = PythonLayout.of_this_process()
        self.extra_binds: list[tuple[str, str]] = []
        self.runs: list[ContainerRun] = []

    def run(self, name: str, mounts: Sequence[tuple[str, str, bool]], envs: dict[str, str],
            args: Sequence[str]) -> ContainerRun:
        """One rootless C{podman run --rm} to completion."""
        pid_file = self.home / f"pid-{uuid.uuid4().hex[:12]}"  # written by UID 1000
        binds = [f"{host}:{inside}:ro" for host, inside in
                 (("/usr", "/usr"), ("/etc", "/etc"), *self.python.binds, *self.extra_binds)]
        binds += [f"{host}:{inside}:{'ro' if read_only else 'rw'}"
                  for inside, host, read_only in mounts]
        env = {"PYTHONPATH": ":".join(self.python.pythonpath), "PYTHONDONTWRITEBYTECODE": "1",
               "HOME": "/", **envs}
        # A bind source UID 1000 cannot reach (a checkout in a 0700 temporary
        # folder, a Python under /root) is bound, in a private mount
        # namespace of this run alone, to a stage path it can reach: the
        # rootless podman has no capability to pass the folders above it.
        staged: list[tuple[str, str]] = []
        for index, bind in enumerate(binds):
            source, rest = bind.split(":", 1)
            if not _reachable_by_others(source):
                stage = self.workdir / "stage" / str(index)
                if os.path.isdir(source):
                    stage.mkdir(parents=True, exist_ok=True)
                else:
                    stage.parent.mkdir(parents=True, exist_ok=True)
                    stage.touch()
                staged.append((source, str(stage)))
                binds[index] = f"{stage}:{rest}"
        prefix: list[str] = []
        if staged:
            mounts_sh = " && ".join(
                f"mount --bind {shlex.quote(source)} {shlex.quote(stage)}"
                for source, stage in staged)
            prefix = ["unshare", "--mount", "--propagation", "private",
                      "sh", "-c", f'{mounts_sh} && exec "$@"', "stage"]
        argv = [
            *prefix,
            "setpriv", f"--reuid={self.UID}", f"--regid={self.UID}", "--clear-groups",
            "env", "-i", f"HOME={self.home}", f"XDG_RUNTIME_DIR={self.runtime_dir}",
            "PATH=/usr/bin:/usr/sbin:/bin",
            self.podman, "--root", str(self.home / "storage"),
            "--runroot", str(self.runtime_dir / "runroot"),
            "--cgroup-manager", "cgroupfs", "--events-backend", "file", "--runtime", self.runc,
            "run", "--rm", "--rootfs", "--network", "none", "--pidfile", str(pid_file),
            "--tmpfs", "/tmp:rw,nosuid,nodev,mode=1777,size=16m",
            *(option for bind in binds for option in ("-v", bind)),
            *(option for key, value in env.items() for option in ("-e", f"{key}={value}")),
            str(self.rootfs), *args,
        ]
        started = time.monotonic()
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=PODMAN_TIMEOUT, check=False, cwd=self.workdir)
        seconds = time.monotonic() - started
        host_pid = int(pid_file.read_text()) if pid_file.exists() else None
        # Podman's warnings about the single mapping are not the workload's.
        stderr = "\n".join(line for line in result.stderr.splitlines()
                           if "level=warning" not in line and "level=error" not in line)
        run = ContainerRun(name, result.returncode, host_pid, result.stdout, stderr, seconds)
        self.runs.append(run)
        print(f"\n[podman rootless] {name}: exit={run.exit_code} host_pid={host_pid} "
              f"printed={run.printed_pid()} seconds={seconds:.3f} stderr={stderr.strip()!r}")
        return run

    def close(self) -> None:
        """
        End what rootless podman leaves behind: its pause process, which
        holds the user namespace for later runs and outlives the run, the
        test and the workdir.  Found by its C{XDG_RUNTIME_DIR} (ours alone),
        since its pid file goes with the workdir.
        """
        mine = f"XDG_RUNTIME_DIR={self.runtime_dir}".encode()
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != self.UID:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if mine not in environ.read().split(b"\0"):
                        continue
                os.kill(int(entry), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                continue
            left.append(entry)
        wait_for(lambda: not any(_alive(pid) for pid in left),
                 "rootless podman's pause process to exit", timeout=10)


def _alive(pid: str) -> bool:
    """Whether C{pid} still runs (a zombie, waiting for its reaper, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _reachable_by_others(path: str) -> bool:
    """Whether a user other than the owner can reach C{path} (every folder above it searchable)."""
    current = os.path.realpath(path)
    while True:
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return False
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(current)
        if parent == current:
            return True
        current = parent
