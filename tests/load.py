"""
How loaded this machine is now, measured rather than assumed: the factor a
bound on the clock is multiplied by so that load cannot break it.

A busy probe process runs for a second at a given niceness and reports the
share of a core it got; the factor is one over that share.  It sees what a
process of that niceness, in this session's scheduling group (the kernel's
autogroup), would get: 1 on a quiet machine, about 2 beside one busy process
per core, far more beside a build at a lower niceness in the same session.
Used where a cap must hold on a loaded 2-core machine: the guests' clocks
(tests/kernels/vm.py) and the per-test cap (tests/budget.py).
"""

from __future__ import annotations

import subprocess
import sys

#: How long the probe runs, and the largest factor reported.
PROBE_SECONDS = 1.0
MAX_FACTOR = 20.0

PROBE = """\
import sys, time
wall, cpu = time.monotonic(), time.process_time()
while time.monotonic() - wall < float(sys.argv[1]):
    pass
print((time.process_time() - cpu) / (time.monotonic() - wall))
"""


def factor(niceness: int = 0, seconds: float = PROBE_SECONDS) -> float:
    """
    How many times slower than on a quiet machine a busy process at
    C{niceness} runs now (1 to L{MAX_FACTOR}, one decimal); 1 when the
    probe cannot run.
    """
    try:
        result = subprocess.run(
            ["nice", "-n", str(niceness), sys.executable, "-I", "-c", PROBE, str(seconds)],
            capture_output=True, text=True, timeout=60 + 10 * seconds, check=False,
        )
        share = float(result.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return 1.0
    return round(min(MAX_FACTOR, max(1.0, 1.0 / max(share, 1e-3))), 1)
