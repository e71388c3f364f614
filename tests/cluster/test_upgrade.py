"""
An upgrade across chart versions on the real node, with the documented
command, while GPU pods query.

The release is installed from the chart as it was at L{EARLIER} (C{git
archive} of that commit's chart directory): the first chart with the NRI
plugin, whose plugin followed C{hostPIDBroker.enabled} (no C{nri.gate} yet)
and whose state of C{values.yaml} is one of those C{tests/test_chart_upgrade.py}
upgrades from.  With the broker and the plugin on, two GPU pods query the
broker every 50 ms; then:

1. C{--reuse-values --set hostPIDBroker.enabled=true}, the docs' command as
   it was, is refused by Helm against the API server (a server-side dry run:
   nothing changes): the new chart's schema wants C{nri.gate};
2. C{helm upgrade --reset-then-reuse-values --set nri.gate=true} (the docs'
   flag; the chart's CHANGELOG says to set C{nri.gate} when upgrading from a
   chart before it) to this chart, waited for with C{kubectl rollout status}:
   no query fails across the broker's surge-first handover, every pod now
   carries this chart's version, and a GPU pod created after it still gets
   its host PID through the plugin.

It runs after C{test_rollout.py} on the same node (it replaces that file's
release) and adds one install and one upgrade: 21 s on the shared 2-core machine
(435 queries, 0 failed).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import pytest
import workloads
import yaml
from cluster import Cluster
from deviceplugin import DevicePlugin
from release import CHART, NAMESPACE, Release
from support import REPO, skip_or_fail, wait_for
from test_rollout import RESTRICTED, Loop, failures
from test_rollout import images as images  # noqa: F401  (the module's fixture, shared)

from hostpid.node.lockparent import prepare_lock_parent

#: The earlier chart: the NRI plugin's first chart (fixture 12-b9d413c's state).
EARLIER = "b9d413c"


@pytest.fixture(scope="module")
def earlier_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart directory as it was at L{EARLIER}, from git."""
    out = tmp_path_factory.mktemp("earlier-chart")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", EARLIER, "deploy/helm/hostpid-broker"],
        capture_output=True, check=False)
    if archive.returncode != 0:
        skip_or_fail(f"the chart at commit {EARLIER} is not in this checkout's history "
                     f"(git archive: {archive.stderr.decode().strip()})")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out / "deploy" / "helm" / "hostpid-broker"


@pytest.fixture(scope="module")
def release(kube: Cluster, gpus: DevicePlugin, images: dict[str, str]  # noqa: F811
            ) -> Iterator[Release]:
    kube.namespace(RESTRICTED, {"pod-security.kubernetes.io/enforce": "restricted"})
    chart = Release(kube, images["repository"], images["tag"])
    chart.uninstall()  # test_rollout.py's, when it ran first
    try:
        yield chart
    finally:
        chart.uninstall()
        chart.close()


def chart_labels(kube: Cluster, selector: str = "app.kubernetes.io/part-of=hostpid"
                 ) -> set[str]:
    """The C{helm.sh/chart} labels of the release's running pods (C{""}: none)."""
    pods = kube.get("pods", "-n", NAMESPACE, "-l", selector)["items"]
    return {p["metadata"]["labels"].get("helm.sh/chart", "") for p in pods
            if "deletionTimestamp" not in p["metadata"]}


def test_upgrade_from_an_earlier_chart_while_gpu_pods_query(
        kube: Cluster, release: Release, earlier_chart: Path) -> None:
    old_version = yaml.safe_load((earlier_chart / "Chart.yaml").read_text())["version"]
    new_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    # This node's lock parent is not directly in /tmp, which today's chart makes the operator
    # allow by name; the earlier chart had no such value (its schema refuses it): given on
    # the upgrade instead, as an operator with such a node would.
    outside_tmp = release.base["nri"].pop("allowLockParentOutsideTmp")
    # The earlier chart runs today's image (no image of its era is built here), whose plugin
    # gives the broker mount only on an immutable mountpoint, and that chart's plugin has no
    # CAP_LINUX_IMMUTABLE to seal it: root's preparation on the node seals it, as
    # `hostpid allocate` and the units' `hostpid prepare-lock-parent` do on a node.
    prepared = prepare_lock_parent(str(release.paths.lock_parent), broker_enabled=True)
    assert prepared.mountpoint_immutable, prepared.immutable_problem
    release.install("hostPIDBroker.enabled=true", "nri.enabled=true", chart=earlier_chart)
    print(release.rollout("daemonset", "hostpid-broker"))
    print(release.rollout("daemonset", "hostpid-nri"))
    # The earlier chart labelled only the broker's pods with its version.
    assert chart_labels(kube, "app.kubernetes.io/component=broker") == \
        {f"hostpid-broker-{old_version}"}

    loop = Loop(kube, "upgrade")
    try:
        wait_for(lambda: all(len(v) >= 5 for v in loop.lines().values()),
                 "the loop pods' first answers", 60.0)
        # The old docs' command (docs/rollout.md step 2, as it was): the new chart's
        # schema wants nri.gate, which the old release's values never had.
        with pytest.raises(helm.HelmError) as refused:
            release.upgrade("hostPIDBroker.enabled=true", reuse="--reuse-values",
                            dry_run="server")
        print(f"\n[cluster] --reuse-values from {EARLIER}: {refused.value}")
        assert "missing property 'gate'" in str(refused.value)

        allowed = f"nri.allowLockParentOutsideTmp={str(outside_tmp).lower()}"
        release.upgrade("nri.gate=true", allowed)
        print(release.rollout("daemonset", "hostpid-broker"))
        print(release.rollout("daemonset", "hostpid-nri"))
    finally:
        lines = loop.stop()
    total, failed = failures(lines)
    print(f"\n[cluster] upgrade from the chart at {EARLIER} ({old_version}) to "
          f"{new_version}: {total} queries, {failed} failed")
    assert total > 0
    assert failed == 0, [line for v in lines.values() for line in v if not line.startswith("ok")]
    assert chart_labels(kube) == {f"hostpid-broker-{new_version}"}, "every pod, the plugin's too"

    run = workloads.run(kube, workloads.pod(RESTRICTED, "after-upgrade"))
    assert run.exit_code == 0, run.stdout
    assert run.answer() == (run.host_pid, 1)
