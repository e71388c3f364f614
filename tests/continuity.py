"""
Continuous HAMi-core-like load across broker restarts and handovers: the C
load generator C{tests/c/hamiload.c} (a new client process every few
milliseconds, each checking the PID it is answered is its own), started,
stopped, and its one-line JSON report read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support import REPO, require_tool, scaled

SOURCE = REPO / "tests" / "c" / "hamiload.c"

#: One client every 5 ms, as the issue's measurement did.
INTERVAL_US = 5000


def build_hamiload(out_dir: Path) -> Path:
    """Compile the load generator with the system C compiler."""
    cc = require_tool("cc")
    binary = out_dir / "hamiload"
    subprocess.run(
        [cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(SOURCE)],
        check=True, timeout=120,
    )
    return binary


@contextmanager
def continuous_load(
    binary: Path, socket_path: Path | str, report: dict[str, object],
    interval_us: int = INTERVAL_US,
) -> Iterator[subprocess.Popen[str]]:
    """
    Clients run for the duration of the block; C{report} is filled with the
    generator's figures when it ends (its clients all finished: each within
    its own 0.5 s deadline).
    """
    process = subprocess.Popen(
        [str(binary), str(socket_path), str(interval_us), "500"],
        stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        if out.strip():
            report.update(json.loads(out.strip().splitlines()[-1]))


def no_fallbacks(report: dict[str, object]) -> str:
    """The report, as an assertion message names it."""
    return ", ".join(f"{key} {value}" for key, value in report.items()) + f" (pid {os.getpid()})"


def assert_never_gone(report: dict[str, object]) -> None:
    """No client found the socket gone or refused, and none got a wrong PID."""
    by_reason = report["by_reason"]
    assert isinstance(by_reason, dict)
    assert report["wrong"] == 0, no_fallbacks(report)
    assert by_reason.get("ENOENT", 0) == 0, no_fallbacks(report)
    assert by_reason.get("ECONNREFUSED", 0) == 0, no_fallbacks(report)
