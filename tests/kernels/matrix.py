"""
The kernel matrix: which kernels, which tests, and what counts as a failure.

The subset is C{pytest -m kernel} (the C{kernel} mark, tests/kernelfeatures.py
says which tests carry it and why), given only the files that hold it
(L{schedule.subset_arguments}).  A kernel's run fails when a guest test
failed, when the VM produced no results (it did not boot, timed out, or
pytest did not finish), or when the host's C{/tmp/vgpulock} changed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from support import REQUIRE_PRIVILEGED, require_root, require_tool

from kernels import debian, schedule, vm

#: Each VM's cap in the matrix, in CPU seconds of its QEMU (L{vm.run}): a
#: guest's progress, which a loaded machine delays but does not use up.  The
#: subset's tests take 6-12 minutes of wall time a kernel on a quiet machine
#: (docs/kernels.md's table: 360-740 s), with about one of the guest's two
#: emulated CPUs busy, so about as many CPU seconds; 1,800 (the 18 minutes the
#: old wall-clock cap allowed, now of CPU) leaves room for a slower CPU and still
#: ends a guest that spins.
VM_BUDGET = 1800.0


SWITCH = os.environ.get("HOSTPID_KERNEL_MATRIX")


def wanted() -> None:
    """
    Skip a test that boots a guest unless asked for (C{HOSTPID_KERNEL_MATRIX=1},
    or C{HOSTPID_REQUIRE_PRIVILEGED=1} as in CI); C{HOSTPID_KERNEL_MATRIX=0}
    (set in every guest) switches guests off, so a guest never boots another.
    """
    if SWITCH == "0":
        pytest.skip("HOSTPID_KERNEL_MATRIX=0: the kernel matrix is switched off")
    if SWITCH != "1" and not REQUIRE_PRIVILEGED:
        pytest.skip(
            "the kernel matrix (~30 min under QEMU) runs with HOSTPID_KERNEL_MATRIX=1 "
            "or HOSTPID_REQUIRE_PRIVILEGED=1"
        )
    require_root()
    require_tool("qemu-system-x86_64")
    require_tool("apt-get")
    require_tool("dpkg-deb")


def selected(series: Sequence[str] | None) -> list[debian.Kernel]:
    if not series:
        return list(debian.KERNELS)
    chosen = [kernel for kernel in debian.KERNELS if kernel.series in series]
    unknown = set(series) - {kernel.series for kernel in chosen}
    if unknown:
        raise SystemExit(f"no kernel {sorted(unknown)} in the matrix {debian.KERNELS}")
    return chosen


def job(
    kernel: debian.Kernel, pytest_args: Sequence[str] | None = None,
    budget: float = vm.DEFAULT_BUDGET, init: str = "script", canary: bool = False,
    alone: bool = False,
) -> schedule.GuestJob:
    """A guest run; without C{pytest_args}, the kernel-sensitive subset."""
    return schedule.GuestJob(
        kernel, tuple(pytest_args) if pytest_args else None, budget, init, canary, alone
    )


def run_kernel(
    kernel: debian.Kernel, pytest_args: Sequence[str] | None = None,
    budget: float = vm.DEFAULT_BUDGET, init: str = "script",
) -> vm.GuestRun:
    """Run a guest now, in the foreground (tests/kernels/run.py)."""
    return schedule.run(job(kernel, pytest_args, budget, init))


def problem(run: vm.GuestRun) -> str | None:
    """Why C{run} failed, or C{None}: one line naming what went wrong."""
    if run.host_lock_parent_changed:
        return f"the host's {vm.HOST_LOCK_PARENT} changed: {run.host_lock_parent_changed}"
    if run.returncode is None:
        return f"the VM was killed ({run.stopped}); console: {run.job / 'console.log'}"
    if not run.outcomes:
        capped = [line for line in run.pytest_log().splitlines() if line.startswith("hostpid: ")]
        if capped:
            return f"the guest's pytest stopped (rc {run.pytest_rc}): {capped[0]}"
        tail = "\n".join(run.console().splitlines()[-15:])
        return f"the guest reported no test results (pytest rc {run.pytest_rc}); console:\n{tail}"
    failed = run.failed()
    if failed:
        # Each failure with its junit message: the guest's job directory is
        # on the machine that ran it, so the message is all a CI log keeps.
        return f"{len(failed)} failed on {run.release}: " + "; ".join(
            f"{o.nodeid}: {_first_lines(o.message)}" for o in failed
        )
    if run.pytest_rc not in (0,):
        return f"the guest's pytest exited {run.pytest_rc}; log: {run.job / 'pytest.log'}"
    return None


def _first_lines(message: str, limit: int = 600) -> str:
    """A failure's message on one line, cut at C{limit} characters."""
    flat = " | ".join(line.strip() for line in message.splitlines() if line.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def record(kernel: debian.Kernel, run: vm.GuestRun, cache: Path = debian.CACHE) -> Path:
    """
    Keep C{run}'s summary (kernel, release, counts, times, probes, failures)
    as JSON in its job directory and as the kernel's latest under
    C{CACHE/results}, which L{kernels.doctable} turns into docs/kernels.md's table.
    """
    summary = {
        "kernel": kernel.name, "suite": kernel.suite, "package": run.package,
        "release": run.release, "features": run.features,
        "passed": run.count("passed"), "not_applicable": run.count("not applicable"),
        "failed": run.count("failed"), "skipped": run.count("skipped"),
        "failures": [o.nodeid for o in run.failed()],
        "not_applicable_tests": [
            o.nodeid for o in run.outcomes if o.outcome == "not applicable"
        ],
        "boot_seconds": run.boot_seconds, "test_seconds": run.test_seconds,
        "wall_seconds": run.wall_seconds, "cpu_seconds": run.cpu_seconds,
        "boot_cpu_seconds": run.boot_cpu_seconds, "load_factor": run.load_factor,
        "problem": problem(run),
    }
    text = json.dumps(summary, indent=1, sort_keys=True) + "\n"
    (run.job / "summary.json").write_text(text)
    results = cache / "results"
    results.mkdir(parents=True, exist_ok=True)
    latest = results / f"{kernel.name}.json"
    latest.write_text(text)
    return latest
