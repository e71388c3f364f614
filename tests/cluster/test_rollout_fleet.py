"""
The chart's rollouts on a fleet: the real node plus L{FLEET} simulated GPU
nodes (KWOK, C{kwok.py}) on the tier's own API server, controller manager
and scheduler, half of them labelled by HAMi (C{gpu: "on"}) and half by
NVIDIA's feature discovery (C{nvidia.com/gpu.present: "true"}):

- both DaemonSets want every GPU node, whichever labelled it (the former
  C{nodeSelector: {gpu: "on"}} wanted half the fleet);
- a roll forward and a roll back at the default surge (10%): each done
  (C{kubectl rollout status}'s rule), no node ever seen without an available
  pod of either DaemonSet, and the nodes surged at once about the surge's
  10% (the former C{maxSurge: 1} surged one node at a time).

The simulated pods take the time the real node's took (measured here first,
on the same release's first upgrade).  CI runs L{FLEET} nodes; C{bench/fleet.py}
runs 1,000 and 5,000 with the same code (C{HOSTPID_FLEET_NODES}), the former
surge of 1 over a window (C{HOSTPID_FLEET_TODAY_WINDOW}), and writes a report
(C{HOSTPID_FLEET_REPORT}).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster
from fleet import DAEMONSETS, NAMESPACE, RELEASE, VALUES, measure_node, roll, surge, wait_rolled
from kwok import Kwok
from release import Release
from support import revision
from test_rollout import images  # noqa: F401  (the fixture: both tags imported)

#: CI's fleet: a few hundred nodes, a few minutes.
FLEET = int(os.environ.get("HOSTPID_FLEET_NODES", "") or "200")
#: Seconds the former surge of 1 is rolled for, to measure its rate (0: not run).
TODAY_WINDOW = float(os.environ.get("HOSTPID_FLEET_TODAY_WINDOW", "") or "0")
REPORT = os.environ.get("HOSTPID_FLEET_REPORT", "")
DEFAULT_SURGE = 0.10


@pytest.mark.cap(1500 + FLEET)
def test_fleet_rollouts(kube: Cluster, kwok: Kwok, images: dict[str, str]) -> None:  # noqa: F811
    release = Release(kube, images["repository"], images["tag"], name=RELEASE,
                      namespace=NAMESPACE)
    report: dict[str, Any] = {
        "fleet": FLEET, "revision": revision(), "versions": dict(kube.versions),
        "kwok": kwok.version(), "nproc": os.cpu_count(), "load": os.getloadavg(),
        "kernel": platform.release(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                               time.gmtime()),
    }
    try:
        release.install(*VALUES, f"broker.directory={release.paths.broker_dir}-fleet")
        for name in DAEMONSETS.values():
            print(release.rollout("daemonset", name))
        # The real node: one upgrade and back, pod by pod.
        delays = measure_node(kube, release, [f"image.tag={images['next']}"])
        report["real_node"] = {c: {"ready": d.ready, "gone": d.gone} for c, d in delays.items()}
        print(f"\n[fleet] the real node's pods: {report['real_node']}")
        measure_node(kube, release, [f"image.tag={images['tag']}"])

        kwok.start(delays)
        started = time.monotonic()
        kwok.add_nodes(FLEET)
        report["nodes_created_seconds"] = time.monotonic() - started
        wait_rolled(kube, 120.0 + FLEET, nodes=FLEET + 1)
        report["fleet_installed_seconds"] = time.monotonic() - started
        kwok.check()

        rollouts = [roll(kube, release, "forward", [f"image.tag={images['next']}"],
                         count_pods=FLEET <= 1000),
                    roll(kube, release, "back", [f"image.tag={images['tag']}"],
                         count_pods=FLEET <= 1000)]
        if TODAY_WINDOW:
            rollouts.append(roll(kube, release, "forward, surge 1 (the former default)",
                                 [f"image.tag={images['next']}", *surge(1)],
                                 window=TODAY_WINDOW))
            rollouts.append(roll(kube, release, "forward, the rest at 10%",
                                 list(surge("10%"))))
            rollouts.append(roll(kube, release, "back after", [f"image.tag={images['tag']}"]))
        report["rollouts"] = [r.report() for r in rollouts]
        kwok.check()
    finally:
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if REPORT:
            Path(REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
        release.uninstall()
        release.close()
        kwok.remove_nodes()

    wanted = FLEET + 1
    surged = math.ceil(DEFAULT_SURGE * wanted)
    for rollout in rollouts[:2]:
        for name in DAEMONSETS.values():
            # Every GPU node, HAMi's and NVIDIA's, and the real one.
            assert rollout.desired[name] == wanted, (rollout.label, name, rollout.desired)
            assert rollout.seconds[name] is not None, (rollout.label, name)
            # Surge-first: never a node without an available pod.
            assert rollout.fewest_available[name] == wanted, (rollout.label, name, rollout)
            if FLEET <= 1000:
                # Waves of the surge's size (the controller counts a node against it
                # until its new pod is available, so the old pod's deletion trails
                # it: a few more), never one node at a time.
                assert surged // 2 <= rollout.most_surged[name] <= 2 * surged, (
                    rollout.label, name, rollout)
