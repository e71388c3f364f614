"""
Run clients in the production layout, as PID 1 of a new PID namespace inside
a private mount namespace (started by C{unshare}; see
C{test_client_layout.py}).

It builds, in this mount namespace only, what a workload container sees::

    /tmp                    a tmpfs (the host's /tmp is untouched)
    /tmp/vgpulock           01777, like the prepared lock parent
    /tmp/vgpulock/hostpid   the broker directory, bind-mounted read-only
    /tmp/work               the test's work directory (the C client binary)
    (and the checkout and interpreter, at their own paths, if they live under /tmp)

then starts the requested clients, reads what each printed, and lets each
exit *without reaping it* (C{waitid(WNOWAIT)}): a zombie keeps its PID and its
C{/proc/PID/status}, so the test on the host can compare every reported host
PID with the kernel's C{NSpid} of that very process.  It prints one JSON line,
waits for end of file on stdin, then reaps everything and exits.

Usage: nslayout.py BROKER_DIR STAGE WORK (ro|rw) COMMAND [ARG...]
  COMMAND: query | doctor | c-client BINARY | c-storm BINARY COUNT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def kept_under_tmp() -> list[str]:
    """
    What the clients need that may live under the host's /tmp (a checkout or
    a virtualenv there): kept visible at the same path over the private /tmp.
    """
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    needed = {
        os.path.realpath(path)
        for path in (repo, sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))
    }
    under = sorted(path for path in needed if path.startswith("/tmp/"))
    # A path inside another kept path comes with it.
    return [p for p in under if not any(p.startswith(q + "/") for q in under if q != p)]


def build_layout(broker_dir: str, stage: str, work: str, read_only: bool) -> None:
    mount("--make-rprivate", "/")
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", stage)
    os.mkdir(f"{stage}/vgpulock")
    os.chmod(f"{stage}/vgpulock", 0o1777)
    os.mkdir(f"{stage}/vgpulock/hostpid")
    os.mkdir(f"{stage}/work")
    mount("--bind", work, f"{stage}/work")
    mount("--bind", broker_dir, f"{stage}/vgpulock/hostpid")
    for path in kept_under_tmp():
        inside = f"{stage}/{os.path.relpath(path, '/tmp')}"
        os.makedirs(inside, exist_ok=True)
        mount("--rbind", path, inside)
    mount("--rbind", stage, "/tmp")
    if read_only:
        mount("-o", "remount,bind,ro", "/tmp/vgpulock/hostpid")


def spawn(argv: list[str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=pass_fds,
    )


def collect(processes: list[subprocess.Popen[bytes]]) -> list[dict[str, object]]:
    results = []
    for process in processes:
        assert process.stdout is not None and process.stderr is not None
        out = process.stdout.read().decode()
        err = process.stderr.read().decode()
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        assert info is not None
        status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        results.append({"ns_pid": process.pid, "status": status, "stdout": out, "stderr": err})
    return results


def main(argv: list[str]) -> int:
    broker_dir, stage, work, mode, command, *args = argv
    build_layout(broker_dir, stage, work, read_only=(mode == "ro"))
    processes: list[subprocess.Popen[bytes]] = []
    if command in ("query", "doctor"):
        processes.append(spawn([sys.executable, "-m", "hostpid.cli", command]))
    elif command == "c-client":
        processes.append(spawn([args[0]]))
    elif command == "c-storm":
        binary, count = args[0], int(args[1])
        barrier_read, barrier_write = os.pipe()
        for _ in range(count):
            processes.append(
                spawn([binary, "--barrier-fd", str(barrier_read)], pass_fds=(barrier_read,))
            )
        os.close(barrier_read)
        os.close(barrier_write)  # every client starts now
    else:
        raise SystemExit(f"unknown command {command!r}")
    mounts = open("/proc/self/mountinfo").read()
    print(json.dumps({"results": collect(processes), "mountinfo": mounts}), flush=True)
    sys.stdin.read()
    for process in processes:
        process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
