"""
Keep C{bench/webhook} honest: run it very briefly and check that every
server answered every review allowed and the report is complete.  Speed is
never asserted here: it lives in the benchmark's report.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from support import REPO, subprocess_env


def test_bench_webhook_runs_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "webhook"), "--seconds", "0.5", "--clients", "1",
         "--out", str(out)],
        env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == {"raw.json.gz", "summary.md", "environment.json"}
    with gzip.open(out / "raw.json.gz", "rt") as raw:
        results = json.load(raw)
    assert [r["server"] for r in results] == [
        "bare twisted.web (allow all)", "hostpid-webhook, mode mounts",
        "hostpid-webhook, mode cdi"]
    for result in results:
        assert result["errors"] == 0 and result["reviews"] > 0, result["server"]
        assert len(result["raw_latencies_us"]) == result["reviews"]
    environment = json.loads((out / "environment.json").read_text())
    assert environment["twisted"] and environment["revision"]
