"""
The cluster tier's fixtures: one real single-node Kubernetes for the whole
session (L{cluster.Cluster}), started on first use and torn down at the
session's end, and the device plugin, the images and the chart's releases
the scenarios share.

Every test here is marked C{cluster} (C{pytest -m cluster} runs the tier
alone) and C{privileged} (it needs root; a skip is a failure under
C{HOSTPID_REQUIRE_PRIVILEGED=1}).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent
# The CRI harness (tests/e2e/crilib.py) is imported, never copied.
for path in (HERE, HERE.parent / "e2e"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import crilib  # noqa: E402
from support import require_root, skip_or_fail  # noqa: E402

#: The per-test cap (tests/budget.py, multiplied by the load measured when it
#: is reached) of the tier's tests: under .ci/run the Kubernetes and image
#: builds are made before the tests (tests/prebuild.py), but a run of the tier
#: alone on a cold cache pays for them in the first test's setup (about 8 and
#: 10 minutes on 2 cores); every wait inside a test has its own, shorter bound.
CAP = 1500


def in_tier(item: pytest.Item | None) -> bool:
    return item is not None and HERE in Path(str(item.fspath)).resolve().parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if in_tier(item):
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.privileged)
            item.add_marker(pytest.mark.cap(CAP))


#: What stops the node: called when the run leaves the tier, so the rest of
#: the suite does not share two cores with a running Kubernetes.
_closers: list[object] = []


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if in_tier(item) and not in_tier(nextitem):
        while _closers:
            close = _closers.pop()
            assert callable(close)
            close()
        print(f"\ncluster: the node is stopped after {item.nodeid}")


@pytest.fixture(scope="session")
def cluster_cri_messages() -> Iterator[ModuleType]:
    out = Path(tempfile.mkdtemp(prefix="hostpid-cluster-pb-"))
    try:
        yield crilib.compile_messages(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster_test_image() -> Iterator[Path]:
    """The CRI tests' image (busybox and the static C contract client)."""
    require_root()
    build = Path(tempfile.mkdtemp(prefix="hostpid-cluster-image-"))
    try:
        image = build / "image.tar"
        crilib.write_image(image, crilib.static_busybox(), crilib.build_static_client(build))
        yield image
    finally:
        shutil.rmtree(build, ignore_errors=True)


@pytest.fixture(scope="session")
def kube(cluster_test_image: Path, cluster_cri_messages: ModuleType) -> Iterator[object]:
    """The running node (started once per session)."""
    require_root()
    if shutil.which("go") is None:
        skip_or_fail("the cluster tier builds Kubernetes and needs Go (1.26) on PATH")
    from cluster import Cluster

    node = Cluster(cluster_test_image, cluster_cri_messages)
    node.start()
    _closers.append(node.close)
    try:
        yield node
    finally:
        node.close()


#: GPUs the device plugin advertises: enough for the burst (24 pods) and the rest.
GPU_COUNT = 40


@pytest.fixture(scope="session")
def deviceplugin_messages() -> Iterator[ModuleType]:
    import components
    import deviceplugin

    out = Path(tempfile.mkdtemp(prefix="hostpid-cluster-dp-"))
    try:
        proto = deviceplugin.api_proto(components.staging_version(components.KUBERNETES_VERSION))
        yield deviceplugin.compile_messages(proto, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def gpus(kube: object, deviceplugin_messages: ModuleType) -> Iterator[object]:
    """The device plugin, device-node mode, registered; the node shows its GPUs."""
    from cluster import NODE_NAME, Cluster
    from deviceplugin import DevicePlugin
    from support import wait_for

    assert isinstance(kube, Cluster)
    plugin = DevicePlugin(deviceplugin_messages, kube.workdir / "dev", GPU_COUNT, "devices")
    plugin.start()
    _closers.append(plugin.stop)
    try:
        wait_for(lambda: kube.get("node", NODE_NAME)["status"].get("allocatable", {})
                 .get("nvidia.com/gpu") == str(GPU_COUNT),
                 "the node to show the plugin's GPUs", 60.0)
        yield plugin
    finally:
        plugin.stop()


#: GPUs the DRA driver publishes (C{hami-gpu-0} ..): the claim scenarios use a few.
DRA_GPU_COUNT = 8


@pytest.fixture(scope="session")
def dra_messages() -> Iterator[tuple[ModuleType, ModuleType]]:
    import components
    import deviceplugin
    import draplugin

    out = Path(tempfile.mkdtemp(prefix="hostpid-cluster-dra-"))
    try:
        module = deviceplugin.kubelet_module(
            components.staging_version(components.KUBERNETES_VERSION))
        yield draplugin.compile_messages(module, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def dra_gpus(kube: object, dra_messages: tuple[ModuleType, ModuleType]) -> Iterator[object]:
    """The DRA driver, registered with the kubelet; its ResourceSlice and DeviceClass published."""
    from cluster import Cluster
    from draplugin import DraPlugin
    from release import Paths

    assert isinstance(kube, Cluster)
    plugin = DraPlugin(dra_messages, kube, kube.workdir / "dev-dra", DRA_GPU_COUNT,
                       kube.containerd.cdi_dir, Paths(kube).lock_parent)
    yield from _session_part(plugin, plugin.start, plugin.stop)


def _session_part(part: object, start: Callable[[], object],
                  stop: Callable[[], object]) -> Iterator[object]:
    """C{part} started for the session, stopped when the run leaves the tier or at its end."""
    start()
    _closers.append(stop)
    try:
        yield part
    finally:
        stop()


@pytest.fixture(scope="session")
def kwok(kube: object) -> Iterator[object]:
    """
    KWOK's controller for simulated nodes on the tier's API server
    (L{kwok.Kwok}): started by the test that sizes the fleet, stopped (its
    nodes deleted) when the run leaves the tier.
    """
    from cluster import Cluster
    from kwok import Kwok

    assert isinstance(kube, Cluster)
    controller = Kwok(kube)
    _closers.append(controller.stop)
    try:
        yield controller
    finally:
        controller.stop()
