"""
The shipped systemd units under the host's real systemd, booted as PID 1 in
a kernel-matrix guest (C{init="systemd"}): the guest runs
tests/kernels/systemd_units.py, which installs deploy/systemd as the
operations guide does and restarts the broker with C{systemctl} under
continuous HAMi-core-like load, with socket activation and with the
descriptor store alone, and once by SIGKILL and C{Restart=on-failure}, and
reloads it (a handover to a new broker that systemd follows by C{MAINPID=}).

One guest, on the 6.12 kernel (any would do: what is tested is systemd's
side and the units); it runs with the kernel matrix (see L{matrix.wanted}).
"""

from __future__ import annotations

import pytest

from kernels import debian, matrix, schedule

#: The guest's tests (see systemd_units.py).
GUEST_TESTS = ("-q", "-ra", "-s", "tests/kernels/systemd_units.py")
#: How many of them must pass.
EXPECTED = 4
#: The reloads systemd_units.py makes.
RELOADS = 3
#: The CPU seconds QEMU may use (L{vm.run}): boot, systemd's own start and
#: four broker starts a test, all emulated.
BUDGET = 900.0


#: The guest: one 6.12 kernel with systemd as PID 1.
(KERNEL,) = (k for k in debian.KERNELS if k.series == "6.12")
#: Alone: its reloads count every client that falls back, each a 50 ms client
#: against 0.5 s deadlines in an emulated machine, measured with no other guest.
JOB = matrix.job(KERNEL, GUEST_TESTS, budget=BUDGET, init="systemd", alone=True)


@pytest.mark.guest(JOB)
@pytest.mark.cap(None)
def test_the_shipped_units_under_real_systemd() -> None:
    matrix.wanted()
    run = schedule.result(JOB)
    print(run.summary())
    print(f"job directory: {run.job}")
    print(run.pytest_log()[-3000:])
    problem = matrix.problem(run)
    assert problem is None, f"{KERNEL.name} under systemd ({run.package}): {problem}"
    assert run.count("passed") == EXPECTED, run.summary()
    # systemd's own word (no journald runs: it writes to the console): each
    # reload ended, and it ignored no notification, which it does (and says)
    # for one from a process other than the main one (NotifyAccess=main).
    console = run.console()
    assert console.count("Reloaded hostpid-broker.service") == RELOADS, console[-3000:]
    assert "Got notification message" not in console, console[-3000:]
    # And each new main process was its child: systemd does not wait, on a
    # stop, for the exit of a main process it calls alien, but kills it.
    assert "which is not our child" not in console, console[-3000:]
