"""
Run the kernel matrix (or part of it) by hand:

    .venv/bin/python tests/kernels/run.py [--kernel 6.1 ...] [--init systemd] [-- PYTEST ARGS]

With C{HOSTPID_REPEAT=N} in the environment, the guest's pytest runs each
test N times in a row (tests/budget.py), the way to hunt a flake on the
kernel that showed it::

    HOSTPID_REPEAT=30 .venv/bin/python tests/kernels/run.py --kernel 6.16 --budget 3600 -- \\
        -x -q tests/integration/test_attack_slow_sender.py

Without pytest arguments it runs the kernel-sensitive subset
(L{kernels.schedule.subset_arguments}); it prints each kernel's counts and the guest
tests that failed, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import matrix  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--kernel", action="append", help="a series (5.10, 6.1, ...)")
    parser.add_argument(
        "--init", choices=("script", "systemd"), default="script",
        help="the guest's PID 1: its own script, or the host's systemd (as test_systemd.py)",
    )
    parser.add_argument(
        "--budget", type=float, default=matrix.VM_BUDGET,
        help=f"the CPU seconds the VM's QEMU may use (default: the matrix's, {matrix.VM_BUDGET:g})",
    )
    parser.add_argument("pytest_args", nargs="*")
    options = parser.parse_args()
    failed = False
    for kernel in matrix.selected(options.kernel):
        run = matrix.run_kernel(
            kernel, options.pytest_args or None, init=options.init,
            budget=options.budget,
        )
        matrix.record(kernel, run)
        print(run.summary(), flush=True)
        print(f"  job directory: {run.job}", flush=True)
        for outcome in run.failed():
            print(f"  FAILED {outcome.nodeid}: {outcome.message[:200]}", flush=True)
        problem = matrix.problem(run)
        if problem:
            print(f"  {problem}", flush=True)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
