"""
The kernel matrix under pytest: one test per Debian kernel of
L{kernels.debian.KERNELS}, each booting that kernel under QEMU and running
the kernel-sensitive subset (C{pytest -m kernel}) inside as root.

The guests boot in the background while the host's tests run
(tests/kernels/schedule.py): one beside them, two at a time once they have
ended; these tests wait for them at the end of the session.  The guests
take about half an hour between them (15 minutes of wall time after the
host's tests, two at a time), so they run
when C{HOSTPID_KERNEL_MATRIX=1} or C{HOSTPID_REQUIRE_PRIVILEGED=1} (CI:
C{.ci/run}); otherwise each test says so and skips.  C{HOSTPID_KERNEL_MATRIX=0}
switches it off explicitly (the guests set it, so a guest never boots another).
A test fails naming the guest tests that failed, or why the VM gave no results.
Each guest is capped by its progress (the CPU seconds its QEMU uses,
L{vm.run}), not by the clock: its host test has no wall-time cap of its own
(C{cap(None)}, tests/budget.py), and its boot time is reported, not bounded.
"""

from __future__ import annotations

import json

import pytest

from kernels import debian, guest_canary, matrix, schedule

#: The kernel whose guest also runs the canary (tests/kernels/guest_canary.py).
CANARY_KERNEL = debian.KERNELS[1]

#: The order the guests boot in: the two that take half as long (their kernels
#: have SO_PEERPIDFD) beside the host's tests, the older two once those have ended,
#: two at a time with nothing else (tests/kernels/schedule.py).
ORDER = sorted(debian.KERNELS, key=lambda kernel: kernel.series not in ("6.12", "6.16"))

#: Each kernel's guest: the kernel-sensitive subset.
JOBS = {
    kernel: matrix.job(kernel, budget=matrix.VM_BUDGET, canary=kernel == CANARY_KERNEL)
    for kernel in ORDER
}


@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param(kernel, marks=[pytest.mark.guest(job), pytest.mark.cap(None)])
        for kernel, job in JOBS.items()
    ],
    ids=[k.name for k in ORDER],
)
def test_kernel_sensitive_tests_pass_on(kernel: debian.Kernel) -> None:
    matrix.wanted()
    run = schedule.result(JOBS[kernel])
    print(run.summary())
    print(f"job directory: {run.job}")
    print("features:", json.dumps({k: v.get("present") for k, v in run.features.items()}))
    matrix.record(kernel, run)
    problem = matrix.problem(run)
    assert problem is None, f"{kernel.name} ({run.package}): {problem}"


@pytest.mark.guest(JOBS[CANARY_KERNEL])
@pytest.mark.cap(None)
def test_guest_writes_never_reach_the_host() -> None:
    """
    After its tests, the 6.1 guest writes the host's C{/tmp/vgpulock/hostpid}
    and a file in the host's tree (tests/kernels/guest_canary.py);
    afterwards the host's C{/tmp/vgpulock} is as it was and the file does
    not exist here: what a guest writes lands in its tmpfs overlay (or its
    own tmpfs C{/tmp}).
    """
    matrix.wanted()
    assert not guest_canary.CANARY.exists(), f"{guest_canary.CANARY} exists before the run"
    run = schedule.result(JOBS[CANARY_KERNEL])
    assert run.canary_rc == 0 and guest_canary.DONE in run.canary_log, (
        f"the guest's canary did not run (rc {run.canary_rc}): {run.canary_log[-2000:]}"
    )
    assert run.host_lock_parent_changed is None, run.host_lock_parent_changed
    assert not guest_canary.CANARY.exists(), "a guest's write reached the host's tree"
