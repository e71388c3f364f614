"""
Keep C{bench/nri} honest: run it very briefly (two containers, one round)
and check that the report is complete and every side measured what it
names (the bench itself refuses a container adjusted on the side without
the plugin, or not adjusted on the side with it).  Speed is never asserted
here: it lives in the benchmark's report.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, require_root, subprocess_env

pytestmark = pytest.mark.privileged


def test_bench_nri_runs_and_reports(tmp_path: Path) -> None:
    require_root()
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "nri"), "--containers", "2", "--rounds", "1",
         "--round-trips", "20", "--decisions", "100", "--out", str(out)],
        env=subprocess_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == {"raw.json.gz", "summary.md", "environment.json"}
    with gzip.open(out / "raw.json.gz", "rt") as raw:
        results = json.load(raw)
    assert set(results["decision"]) == {
        "GPU container", "plain container",
        "GPU container, 16384 mounts under /tmp/vgpulock",
        "GPU container, 2 M environment entries (oversized)"}
    assert [len(v) for v in results["round_trips"].values()] == [20, 20]
    sides = results["containerd"]["sides"]
    assert {side: len(data["sequential"]) for side, data in sides.items()} == {
        "without plugin": 2, "with plugin": 2}
    assert results["memory"]["vmrss_kb"] > 0
    assert "Added by the plugin" in (out / "summary.md").read_text()
