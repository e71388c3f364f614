"""
Podman start-to-exit time with the CDI device against the same edits given
as raw C{-v} mounts and C{-e} (what CDI costs at container start; not a test).

Run as root from the repository root:

    .venv/bin/python tests/e2e/bench_cdi_podman.py [--runs 10]

Each run is one C{podman run --rm} of a UID 1000 container that execs
C{hostpid query} (every trust check on) against a real broker, timed from
just before C{podman} is started to its exit; both kinds alternate so that
a change in machine load hits both alike.  Prints the median, min and max of
each kind and the medians' difference, as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]

from podmanlib import CdiNode  # noqa: E402
from support import hostpid_argv, remove_tree, running_broker, subprocess_env  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    options = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root (podman with private storage, mount namespaces)")
    home = Path(tempfile.mkdtemp(prefix="hostpid-bench-cdi-", dir="/tmp"))
    os.chmod(home, 0o755)
    (home / "run").mkdir(mode=0o755)
    (home / "tmp").mkdir(mode=0o755)
    broker_dir, lock_parent = home / "run" / "hostpid", home / "tmp" / "vgpulock"
    workdir = Path(tempfile.mkdtemp(prefix="hostpid-podman-"))
    node = CdiNode(workdir)
    times: dict[str, list[float]] = {"cdi": [], "raw": []}
    try:
        with running_broker(broker_dir):
            env = subprocess_env(LIBVGPU_HOSTPID_BROKER="1")
            node.inside(hostpid_argv("cdi", "--lock-parent", str(lock_parent),
                                     "--broker-dir", str(broker_dir)), env=env)
            raw = {
                "volumes": [f"{lock_parent}:/tmp/vgpulock:rw,nosuid,nodev",
                            f"{broker_dir}:/tmp/vgpulock/hostpid:ro,nosuid,nodev"],
                "envs": {"LIBVGPU_HOSTPID_BROKER": "1"},
            }
            # One untimed run of each warms the page cache and podman's storage.
            node.run("warm-up cdi", devices=["hami.io/hostpid=broker"], quiet=True)
            node.run("warm-up raw", quiet=True, **raw)  # type: ignore[arg-type]
            for index in range(options.runs):
                for kind in ("cdi", "raw"):
                    if kind == "cdi":
                        run = node.run(f"cdi {index}", devices=["hami.io/hostpid=broker"],
                                       quiet=True)
                    else:
                        run = node.run(f"raw {index}", quiet=True, **raw)  # type: ignore[arg-type]
                    if run.exit_code != 0 or run.printed_pid() != run.host_pid:
                        raise SystemExit(f"{kind} run {index} failed: {run}")
                    times[kind].append(run.seconds)
    finally:
        node.close()
        remove_tree(workdir, ignore_errors=True)
        remove_tree(home, ignore_errors=True)
    summary = {
        kind: {"runs": len(values), "median_s": round(statistics.median(values), 4),
               "min_s": round(min(values), 4), "max_s": round(max(values), 4)}
        for kind, values in times.items()
    }
    summary["median_difference_s"] = round(
        summary["cdi"]["median_s"] - summary["raw"]["median_s"], 4)  # type: ignore[index]
    summary["podman"] = subprocess.run(["podman", "--version"], capture_output=True,
                                       text=True, check=False).stdout.strip()
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
