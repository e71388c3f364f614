"""
The suite's own budget rules (tests/budget.py), run in a real pytest of
their own: a test past its cap stops the run with one line naming it, a
test marked with a larger cap is left alone, a test on a loaded machine
(busy processes on every core, measured by tests/load.py) gets its cap
times the load, and C{HOSTPID_REPEAT=N} runs each test N times.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import REPO

HANGS = """
import threading, time
import pytest

def test_hangs():
    threading.Event().wait()

@pytest.mark.cap(30)
def test_may_take_longer():
    time.sleep(1.5)
"""

SLOWED = """
import os, subprocess, sys, time

def test_slowed_by_the_load():
    # One busy process per core at a lower niceness, in this session's
    # scheduling group, while the test runs; killed with this pytest even when
    # its cap stops it (os._exit runs no finally).
    hogs = [subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "nice", "-n", "-10",
                              sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(3)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
"""

COUNTS = """
import os

def test_counted(tmp_path_factory):
    with open(os.environ["COUNT_FILE"], "a") as f:
        f.write("x")
"""


#: This run's own settings, which the pytest under test must not inherit
#: (this file run with HOSTPID_REPEAT=30 would repeat the tests inside too).
OUTER = ("PYTEST_ADDOPTS", "HOSTPID_REPEAT", "HOSTPID_TEST_CAP")


def _pytest(
    tmp_path: Path, source: str, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_subject.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "budget", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), str(tmp_path / "test_subject.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        env={**{k: v for k, v in os.environ.items() if k not in OUTER},
             "PYTHONPATH": str(REPO / "tests"), "HOSTPID_TIME_SCALE": "1", **env},
    )


def test_a_test_past_its_cap_stops_the_run_naming_it(tmp_path: Path) -> None:
    run = _pytest(tmp_path, HANGS, "-k", "hangs", HOSTPID_TEST_CAP="1")
    assert run.returncode == 7, (run.returncode, run.stdout, run.stderr)
    lines = [line for line in run.stderr.splitlines() if line.startswith("hostpid:")]
    assert lines == [
        "hostpid: test_subject.py::test_hangs ran past its cap of 1 s (HOSTPID_TEST_CAP); "
        "stopping the run"
    ], run.stderr


def test_a_marked_cap_lets_a_test_run_longer(tmp_path: Path) -> None:
    run = _pytest(tmp_path, HANGS, "-k", "longer", HOSTPID_TEST_CAP="1")
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "1 passed" in run.stdout


def test_repeat_runs_each_test_that_many_times(tmp_path: Path) -> None:
    count = tmp_path / "count"
    run = _pytest(tmp_path, COUNTS, "-rA", HOSTPID_REPEAT="3", COUNT_FILE=str(count))
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert count.read_text() == "xxx"
    assert "PASSED test_subject.py::test_counted[repeat-3-of-3]" in run.stdout


def test_a_loaded_machine_stretches_the_cap(tmp_path: Path) -> None:
    # The test loads every core while it runs: the load probe gets about a
    # tenth of a core, so the cap of 1 s becomes about 10 s, past the 3 s the
    # test takes (a test that hangs on a quiet machine stops at its cap, as
    # the one above).
    run = _pytest(tmp_path, SLOWED, HOSTPID_TEST_CAP="1")
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    assert "1 passed" in run.stdout
