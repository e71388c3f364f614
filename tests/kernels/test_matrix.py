"""
The kernel matrix under pytest: one test per Debian kernel of
L{kernels.debian.KERNELS}, each booting that kernel under QEMU and running
the kernel-sensitive subset (C{pytest -m kernel}) inside as root.

It takes about half an hour for the four kernels (emulated CPU), so it runs
when C{HOSTPID_KERNEL_MATRIX=1} or C{HOSTPID_REQUIRE_PRIVILEGED=1} (CI:
C{.ci/run}); otherwise each test says so and skips.  C{HOSTPID_KERNEL_MATRIX=0}
switches it off explicitly (the guests set it, so a guest never boots another).
A test fails naming the guest tests that failed, or why the VM gave no results.
"""

from __future__ import annotations

import json

import pytest

from kernels import debian, guest_canary, matrix, vm


@pytest.mark.parametrize("kernel", debian.KERNELS, ids=[k.name for k in debian.KERNELS])
def test_kernel_sensitive_tests_pass_on(kernel: debian.Kernel) -> None:
    matrix.wanted()
    run = matrix.run_kernel(kernel, timeout=matrix.VM_TIMEOUT)
    print(run.summary())
    print(f"job directory: {run.job}")
    print("features:", json.dumps({k: v.get("present") for k, v in run.features.items()}))
    matrix.record(kernel, run)
    problem = matrix.problem(run)
    assert problem is None, f"{kernel.name} ({run.package}): {problem}"
    assert run.boot_seconds is not None and run.boot_seconds < vm.BOOT_BOUND, (
        f"{kernel.name} took {run.boot_seconds} s to boot (bound {vm.BOOT_BOUND} s)"
    )


def test_guest_writes_never_reach_the_host() -> None:
    """
    The guest writes the host's C{/tmp/vgpulock/hostpid} and a file in the
    host's tree (tests/kernels/guest_canary.py); afterwards the host's
    C{/tmp/vgpulock} is as it was and the file does not exist here: what a
    guest writes lands in its tmpfs overlay (or its own tmpfs C{/tmp}).
    """
    matrix.wanted()
    assert not guest_canary.CANARY.exists(), f"{guest_canary.CANARY} exists before the run"
    kernel = debian.KERNELS[1]
    run = matrix.run_kernel(
        kernel,
        # No conftest: its session guard would rightly fail the guest run
        # for the /tmp/vgpulock the canary makes (in the guest).
        ["-q", "--noconftest", str(guest_canary.CANARY.with_name("guest_canary.py"))],
        timeout=300,
    )
    assert run.count("passed") == 1, f"the guest's canary did not run: {matrix.problem(run)}"
    assert run.host_lock_parent_changed is None, run.host_lock_parent_changed
    assert not guest_canary.CANARY.exists(), "a guest's write reached the host's tree"
