"""
What keeps the suite inside CI's time budget and its timing tests honest.

 - A per-test cap: a test that runs past C{HOSTPID_TEST_CAP} seconds
   (default 300) stops the whole run with one line naming it, followed by
   every thread's traceback, so that a hang costs minutes and not CI's
   90.  A test that needs longer says so with C{@pytest.mark.cap(SECONDS)}
   (the cluster tier does); one bounded by its own progress instead says
   C{@pytest.mark.cap(None)} (the kernel guests: their VMs are capped by the
   CPU time they use, tests/kernels/vm.py).  The cap counts from the test's
   setup to its teardown, fixtures included, and grows with the machine's
   load: when it is reached, the load is measured (tests/load.py) and the
   run stops only if the test has also run past the cap times that factor,
   so that a loaded machine slows a test without failing it, while a test
   that hangs on a quiet one still stops at the cap.
   The watchdog is a thread, not C{SIGALRM}: the broker's own code and the
   tests' attackers use C{SIGALRM}, and an exception raised in the reactor's
   callbacks would be logged by Twisted rather than end the test.
 - C{HOSTPID_REPEAT=N}: every collected test runs N times in a row (its ID
   gains C{[repeat-K-of-N]}), the way to hunt a flake in one test, on the
   host or, through C{tests/kernels/run.py}, in a guest::

       HOSTPID_REPEAT=30 .venv/bin/python -m pytest -x tests/test_closer.py::test_name
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import load
import pytest

#: Seconds one test may take (setup, call and teardown) before the run stops.
DEFAULT_CAP = 300.0

#: The cap here: guests under emulation (C{HOSTPID_TIME_SCALE}) get it scaled.
CAP = float(os.environ.get("HOSTPID_TEST_CAP", "") or DEFAULT_CAP) * float(
    os.environ.get("HOSTPID_TIME_SCALE", "") or "1"
)

REPEAT = int(os.environ.get("HOSTPID_REPEAT", "") or "1")

#: The exit status of a run stopped by the cap (pytest's own are 0-5).
STOPPED = 7


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cap(seconds): this test may run longer than HOSTPID_TEST_CAP (its own bound)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if REPEAT > 1:
        metafunc.fixturenames.append("hostpid_repeat")
        metafunc.parametrize(
            "hostpid_repeat", range(1, REPEAT + 1),
            ids=[f"repeat-{k}-of-{REPEAT}" for k in range(1, REPEAT + 1)],
        )


def cap_of(item: pytest.Item) -> float | None:
    """The test's cap in seconds, or C{None} for a test bounded by its own progress."""
    marker = item.get_closest_marker("cap")
    if marker is None:
        return CAP
    if marker.args[0] is None:
        return None
    return max(CAP, float(marker.args[0]))


def _stop(config: pytest.Config, nodeid: str, cap: float) -> None:
    # pytest holds the descriptors 1 and 2 while a test runs: give them back
    # first, or the line goes into a capture that the exit throws away.
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    sys.stderr.write(
        f"\nhostpid: {nodeid} ran past its cap of {cap:.0f} s (HOSTPID_TEST_CAP); "
        "stopping the run\n"
    )
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(STOPPED)


class _Watchdog:
    """
    Stops the run once a test has run past its cap times the machine's load
    factor, measured when the cap is reached (and again at each later check).
    """

    def __init__(self, config: pytest.Config, nodeid: str, cap: float,
                 factor: Callable[[], float] = load.factor) -> None:
        self._config, self._nodeid, self._cap, self._factor = config, nodeid, cap, factor
        self._started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hostpid-test-cap",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        allowed = self._cap
        while not self._done.wait(allowed - (time.monotonic() - self._started)):
            allowed = self._cap * self._factor()
            if time.monotonic() - self._started >= allowed:
                if not self._done.is_set():
                    _stop(self._config, self._nodeid, self._cap)
                return


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    cap = cap_of(item)
    if cap is None:
        yield
        return
    watchdog = _Watchdog(item.config, item.nodeid, cap)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
