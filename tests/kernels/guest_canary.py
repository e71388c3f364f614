"""
Run inside a guest only, after its tests (tests/kernels/guest-init.sh runs
it with the guest's interpreter when the job asks for it, as the 6.1 guest
of tests/kernels/test_matrix.py does): writes where a test could reach the
host if the overlay did not hold, so that the host can check that nothing
arrived.  A plain script, not a pytest run: a pytest of its own cost a
guest under emulation some 45 s to start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Beside this file: in the host's tree, which the guest sees read-only
#: under its tmpfs overlay.
CANARY = Path(__file__).resolve().with_name(".guest-canary")

#: What the guest writes, and what it prints once it has read it back.
WRITTEN = "written in the guest\n"
DONE = "canary written and read back"


def main() -> int:
    if os.environ.get("HOSTPID_KERNEL_MATRIX") != "0":
        print("run only inside a matrix guest", file=sys.stderr)
        return 2
    os.makedirs("/tmp/vgpulock/hostpid", exist_ok=True)
    CANARY.write_text(WRITTEN)
    if CANARY.read_text() != WRITTEN:
        print(f"{CANARY} does not read back what was written", file=sys.stderr)
        return 1
    print(DONE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
