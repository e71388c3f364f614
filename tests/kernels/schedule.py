"""
The guests of a pytest session, booted in the background while the host's
tests run.

A guest spends most of its wall time in emulation, a process of its own,
and most of the host suite waits on real deadlines: run one after the other
they took four fifths of CI; run side by side they share the two cores.  So
this plugin finds the session's guest tests (those marked
C{@pytest.mark.guest(job)}), moves them to the end of the run, and starts
their jobs at once, two guests at a time (L{AT_ONCE}), in the order of the
tests; a job that must run with no guest beside it (the real-systemd one)
waits for the others and runs last.  Each guest test then asks L{result} for its own
run, which is ready or under way by the time the host's tests have ended.

Nothing starts unless the matrix is wanted (L{matrix.wanted}); a test whose
job did not start runs it itself, in the foreground, so a test selected on
its own (C{pytest tests/kernels/test_matrix.py -k 6.1}) behaves as before.

The threads do no printing or logging, so a test that forks while they run
cannot inherit a lock one of them held; its VMs run at C{nice 10} so that the
host's timing tests keep the CPU they ask for first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import load
import pytest

from kernels import debian, vm

WORKTREE = Path(__file__).resolve().parent.parent.parent

#: The host's collection of the subset, on a quiet machine (a few seconds),
#: multiplied by the load measured when it starts (tests/load.py).
COLLECT_TIMEOUT = 300.0


@attrs.frozen
class GuestJob:
    """One VM run: a kernel, the guest's pytest arguments, a CPU budget, an init."""

    kernel: debian.Kernel
    #: C{None}: the kernel-sensitive subset (L{subset_arguments}).
    pytest_args: tuple[str, ...] | None
    #: The CPU seconds its QEMU may use (L{vm.run}).
    budget: float
    init: str = "script"
    #: Run tests/kernels/guest_canary.py after the tests.
    canary: bool = False
    #: Run with no other guest beside it (its tests' bounds were measured so).
    alone: bool = False


def subset_files(worktree: Path = WORKTREE) -> list[str]:
    """
    The test files that hold the kernel-sensitive subset (C{-m kernel}), as
    pytest collects them here.  A guest given only these files imports those
    modules (17 today) instead of every module of the suite, each imported
    under emulation only to be deselected; C{-m kernel} still selects within them.
    The collection also leaves each file's rewritten bytecode in the tree,
    which the guests read through their overlay instead of compiling it.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "kernel",
         "-p", "no:cacheprovider", "tests"],
        cwd=worktree, capture_output=True, text=True, timeout=COLLECT_TIMEOUT * load.factor(),
        check=False,
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
             "HOSTPID_KERNEL_MATRIX": "0"},
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
        unpacked, args, WORKTREE, budget=job.budget, init=job.init, canary=job.canary
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


#: How many guests run at once once the host's tests have ended.  A guest
#: keeps about one of its two emulated CPUs busy (its tests start one process
#: at a time), so two share this machine's two cores; while the host's tests
#: run, which keep about one core busy themselves, one guest runs beside them.
#: A guest starved beyond that falls behind its tests' time scale
#: (tests/kernels/vm.py, TIME_SCALE): seen with three guests and other work on
#: two cores, where a 5.10 guest ran 43 of its tests in 17 minutes.
AT_ONCE = int(os.environ.get("HOSTPID_GUESTS_AT_ONCE", "") or "2")


class Background:
    """
    Runs jobs on threads of its own, in the order given: one until
    L{widen} is called (the host's tests have ended), then C{at_once}; a
    job marked C{alone} waits until every job before it has ended, and runs
    with no other guest beside it.
    """

    def __init__(
        self, jobs: Sequence[GuestJob], at_once: int = AT_ONCE,
        runner: Callable[[GuestJob], vm.GuestRun] | None = None,
        warmer: Callable[[], None] | None = None,
    ) -> None:
        self._runner = runner or run
        self._warmer = warmer or warm
        # The jobs that must run alone go last, so that nothing waits behind them.
        self._jobs = [job for job in jobs if not job.alone] + [job for job in jobs if job.alone]
        self._pending = {job: _Pending() for job in self._jobs}
        self._next = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, name=f"hostpid-guests-{n}", daemon=True)
            for n in range(max(1, at_once))
        ]
        self._warmed = threading.Event()
        self._widened = threading.Event()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _take(self) -> GuestJob | None:
        with self._lock:
            if self._next >= len(self._jobs):
                return None
            job = self._jobs[self._next]
            self._next += 1
            return job

    def _work(self) -> None:
        if self._threads[0] is threading.current_thread():
            try:
                self._warmer()
            except Exception:  # noqa: BLE001 - warming is an optimisation only
                pass
            self._warmed.set()
        else:
            self._widened.wait()
        self._warmed.wait()
        while (job := self._take()) is not None:
            if job.alone:
                for earlier in self._jobs[: self._jobs.index(job)]:
                    self._pending[earlier].done.wait()
            pending = self._pending[job]
            try:
                pending.run = self._runner(job)
            except BaseException as error:  # noqa: BLE001 - handed to the test
                pending.error = error
            pending.done.set()

    def widen(self) -> None:
        """Let the other threads start: the host's tests have ended."""
        self._widened.set()

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
    """
    C{job}'s run: from the background if it was started there, else now.
    The first guest test to ask comes after every host test (they were
    moved to the end), so from then on the guests run two at a time.
    """
    if _background is not None and _background.has(job):
        _background.widen()
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
