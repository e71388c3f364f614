"""
Run a command with a private C{/tmp}, so that nothing it does to
C{/tmp/vgpulock} (the production lock parent) reaches the host's.

Run under C{unshare --mount} (see L{support.run_with_private_tmp}): the mount
namespace is this process's own, C{/tmp} in it is a fresh tmpfs (with the
checkout and interpreter kept at their own paths if they live under the
host's C{/tmp}), and the host's C{/tmp} is untouched.  After the command ends
it reports, as one JSON line on the descriptor given, what C{/tmp/vgpulock}
and C{/tmp/vgpulock/hostpid} are in the private C{/tmp}, then exits with the
command's status.

Usage: privatetmp.py STAGE REPORT_FD [--keep PATH]... [--private-run] -- ARGV...

REPORT_FD C{-}: no report.  C{--keep PATH}: a directory under the host's
C{/tmp} kept visible at its own path too (a test's scratch directory).
C{--private-run}: C{/run} is an empty tmpfs as well (for commands whose
defaults live there: C{/var/run/hami/hostpid}, C{/var/run/cdi}).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration"))

from nslayout import kept_under_tmp  # noqa: E402


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def describe(path: str) -> dict[str, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return {"mode": st.st_mode, "uid": st.st_uid, "ino": st.st_ino}


def main(argv: list[str]) -> int:
    stage, report_fd, *rest = argv
    separator = rest.index("--")
    options, command = rest[:separator], rest[separator + 1:]
    assert command
    keep: list[str] = []
    private_run = False
    while options:
        option = options.pop(0)
        if option == "--keep":
            keep.append(os.path.realpath(options.pop(0)))
        else:
            assert option == "--private-run", option
            private_run = True
    mount("--make-rprivate", "/")
    if private_run:
        mount("-t", "tmpfs", "-o", "mode=0755", "hostpid-test", "/run")
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", stage)
    kept = kept_under_tmp() + [path for path in keep if path.startswith("/tmp/")]
    for path in kept:
        inside = f"{stage}/{os.path.relpath(path, '/tmp')}"
        os.makedirs(inside, exist_ok=True)
        mount("--rbind", path, inside)
    mount("--rbind", stage, "/tmp")
    status = subprocess.run(command, check=False).returncode
    if report_fd != "-":
        report = {path: describe(path) for path in ("/tmp/vgpulock", "/tmp/vgpulock/hostpid")}
        with os.fdopen(int(report_fd), "w") as out:
            out.write(json.dumps(report) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
