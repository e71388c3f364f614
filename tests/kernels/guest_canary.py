"""
Run inside a guest only (tests/kernels/test_matrix.py passes this file to the
guest's pytest): writes where a test could reach the host if the overlay did
not hold, so that the host can check that nothing arrived.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Beside this file: in the host's tree, which the guest sees read-only
#: under its tmpfs overlay.
CANARY = Path(__file__).resolve().with_name(".guest-canary")


def test_writes_in_the_guest() -> None:
    assert os.environ.get("HOSTPID_KERNEL_MATRIX") == "0", "run only inside a matrix guest"
    os.makedirs("/tmp/vgpulock/hostpid", exist_ok=True)
    CANARY.write_text("written in the guest\n")
    assert CANARY.read_text() == "written in the guest\n"
