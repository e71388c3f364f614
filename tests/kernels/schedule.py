"""
The guests of a pytest session, booted in the background while the host's
tests run.

A guest spends most of its wall time in emulation, a process of its own,
and most of the host suite waits on real deadlines: run one after the other
they took four fifths of CI; run side by side they share the two cores.  So
this plugin finds the session's guest tests (those marked
C{@pytest.mark.guest(job)}), moves them to the end of the run, and starts
their jobs at once on one thread, one guest at a time (two guests at once
would take each other's CPU and their time scale would no longer hold), in
the order of the tests.  Each guest test then asks L{result} for its own
run, which is ready or under way by the time the host's tests have ended.

Nothing starts unless the matrix is wanted (L{matrix.wanted}); a test whose
job did not start runs it itself, in the foreground, so a test selected on
its own (C{pytest tests/kernels/test_matrix.py -k 6.1}) behaves as before.

The thread does no printing or logging, so a test that forks while it runs
cannot inherit a lock the thread held; its VMs run at C{nice 10} so that the
host's timing tests keep the CPU they ask for first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest

from kernels import debian, vm

WORKTREE = Path(__file__).resolve().parent.parent.parent


@attrs.frozen
class GuestJob:
    """One VM run: a kernel, the guest's pytest arguments, a timeout, an init."""

    kernel: debian.Kernel
    #: C{None}: the kernel-sensitive subset (L{subset_arguments}).
    pytest_args: tuple[str, ...] | None
    timeout: float
    init: str = "script"
    #: Run tests/kernels/guest_canary.py after the tests.
    canary: bool = False


def subset_files(worktree: Path = WORKTREE) -> list[str]:
    """
    The test files that hold the kernel-sensitive subset (C{-m kernel}), as
    pytest collects them here.  A guest given only these files collects
    16 modules instead of every module of the suite, which under emulation
    took minutes of each guest's run; C{-m kernel} still selects within them.
    The collection also leaves each file's rewritten bytecode in the tree,
    which the guests read through their overlay instead of compiling it.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "kernel",
         "-p", "no:cacheprovider", "tests"],
        cwd=worktree, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "HOSTPID_KERNEL_MATRIX": "0"},
    )
    files: list[str] = []
    for line in listed.stdout.splitlines():
        path = line.partition("::")[0]
        if "::" in line and path not in files:
            files.append(path)
    if listed.returncode != 0 or not files:
        raise RuntimeError(
            f"collecting the kernel subset failed (rc {listed.returncode}): "
            f"{listed.stdout[-2000:]}{listed.stderr[-2000:]}"
        )
    return files


def warm(worktree: Path = WORKTREE) -> None:
    """
    Leave in the tree what each guest would otherwise make for itself, in
    memory it throws away: the bytecode of every module, and Twisted's plugin
    cache (without it, each twistd a guest starts imports every plugin).
    """
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", "hostpid", "tests", "twisted"],
        cwd=worktree, capture_output=True, timeout=300, check=False,
    )
    subprocess.run(
        [sys.executable, "-c",
         "from twisted.application.service import IServiceMaker\n"
         "from twisted.plugin import getPlugins\n"
         "list(getPlugins(IServiceMaker))"],
        cwd=worktree, capture_output=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(worktree)},
    )


def run(job: GuestJob) -> vm.GuestRun:
    """Boot C{job}'s kernel and run its pytest: what a guest test asks for."""
    args = job.pytest_args
    if args is None:
        args = subset_arguments()
    unpacked = debian.obtain(job.kernel)
    return vm.run(
        unpacked, args, WORKTREE, timeout=job.timeout, init=job.init, canary=job.canary
    )


_subset: list[str] = []
_subset_lock = threading.Lock()


def subset_arguments() -> tuple[str, ...]:
    """The guest's pytest arguments for the kernel-sensitive subset, quietly."""
    with _subset_lock:
        if not _subset:
            _subset.extend(subset_files())
    # Hypothesis's plugin took half of pytest's start (a second here, far more
    # emulated) and no test of the subset uses it.
    return ("-m", "kernel", "-q", "-ra", "--durations=15", "-p", "no:hypothesispytest",
            *_subset)


@attrs.define
class _Pending:
    done: threading.Event = attrs.field(factory=threading.Event)
    run: vm.GuestRun | None = None
    error: BaseException | None = None


class Background:
    """Runs jobs one after another on a thread of its own."""

    def __init__(self, jobs: Sequence[GuestJob]) -> None:
        self._jobs = list(jobs)
        self._pending = {job: _Pending() for job in self._jobs}
        self._thread = threading.Thread(target=self._work, name="hostpid-guests", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _work(self) -> None:
        try:
            warm()
        except Exception:  # noqa: BLE001 - warming is an optimisation only
            pass
        for job in self._jobs:
            pending = self._pending[job]
            try:
                pending.run = run(job)
            except BaseException as error:  # noqa: BLE001 - handed to the test
                pending.error = error
            pending.done.set()

    def has(self, job: GuestJob) -> bool:
        return job in self._pending

    def result(self, job: GuestJob) -> vm.GuestRun:
        pending = self._pending[job]
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.run is not None
        return pending.run


_background: Background | None = None


def result(job: GuestJob) -> vm.GuestRun:
    """C{job}'s run: from the background if it was started there, else now."""
    if _background is not None and _background.has(job):
        return _background.result(job)
    return run(job)


def _job_of(item: pytest.Item) -> GuestJob | None:
    marker = item.get_closest_marker("guest")
    return marker.args[0] if marker is not None else None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "guest(job): boots a guest for GuestJob job (tests/kernels/schedule.py runs it "
        "in the background and moves the test to the end)",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    global _background
    guests = [item for item in items if _job_of(item) is not None]
    if not guests:
        return
    items[:] = [item for item in items if _job_of(item) is None] + guests
    if config.option.collectonly or not _matrix_wanted():
        return
    jobs: list[GuestJob] = []
    for item in guests:
        job = _job_of(item)
        if job is not None and job not in jobs:
            jobs.append(job)
    _background = Background(jobs)
    _background.start()


def _matrix_wanted() -> bool:
    from kernels import matrix

    try:
        matrix.wanted()
    except pytest.skip.Exception:
        return False
    except pytest.fail.Exception:
        return False
    return True
