"""
The real plugin process (C{twistd hostpid-nri}) and the host it looks at,
against a fake runtime on a real Unix socket (L{nrilib.FakeRuntime}).

Why each check exists:

- C{/readyz}: 200 only once the runtime has configured the plugin (it was
  200 after the registration alone, before the runtime had sent anything),
  503 with the reason while the last look found the lock parent missing, the missing lock
  parent warned about once per change of state (not once per container),
  and once more when it is back.
- The broker mountpoint: a symlink planted at C{<lock parent>/hostpid} is
  repaired before the adjustment (its target untouched), counted; where
  the repair is impossible (the lock parent's parent is not the trusted
  UID's), the container gets the lock parent alone, no broker mount and no
  gate, counted C{mountpoint_unsafe}, and C{/readyz} says why.
- Bounded: a container with two million entries (a 4 MiB frame, NRI's cap)
  took 2.06 s to decide, past the runtime's 2 s request timeout; every
  shape up to the cap is now decided in under 0.1 s and answered well
  inside the timeout.  One CreateContainer with megabyte names and
  annotations wrote 3.9 MB of log; now a few hundred bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kernelfeatures import kernel_feature
from nrilib import FakeRuntime, NRIPluginProcess, container, gpu_container, host_tree, http_get, pod
from support import WAIT_SECONDS, remove_tree, require_root, scaled, wait_for

from hostpid.nri import api_pb2

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = kernel_feature("immutable_tmp")


#: NRI's frame cap (ttrpc's C{messageLengthMax}), less room for the request's envelope.
FRAME_CAP = 4 * 1024 * 1024 - 256


@pytest.fixture
def where(tmp_path: Path) -> Path:
    require_root()
    return host_tree(tmp_path)


def plugin(where: Path, lock_parent: Path | None = None) -> NRIPluginProcess:
    return NRIPluginProcess(where / "nri.sock", [
        "--broker-dir", str(where / "broker"),
        "--lock-parent", str(lock_parent or where / "tmp" / "vgpulock")],
        metrics=where / "metrics.sock")


def readyz(where: Path) -> tuple[int, str]:
    return http_get(where / "metrics.sock", "/readyz")


def test_ready_only_once_configured_and_while_the_lock_parent_exists(where: Path) -> None:
    lock_parent = where / "tmp" / "vgpulock"
    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.register()
        wait_for(lambda: "registered with the runtime" in process.output(), "registration")
        code, body = readyz(where)
        assert code == 503 and "not yet configured" in body, body
        connection.configure()
        connection.synchronize()
        wait_for(lambda: readyz(where)[0] == 200, "ready once configured")

        remove_tree(lock_parent)
        for _ in range(3):
            assert connection.create_container(pod(), gpu_container()).adjust == \
                api_pb2.ContainerAdjustment()
        # /readyz reports the look each creation made (it never looks itself).
        code, body = readyz(where)
        assert code == 503 and f"missing on the host: {lock_parent}" in body, body
        assert process.metric("hostpid_nri_containers_total", reason="broker_absent") == 3
        assert process.output().count("missing on the host") == 1, process.output()

        lock_parent.mkdir()
        assert len(connection.create_container(pod(), gpu_container()).adjust.mounts) == 2
        assert readyz(where)[0] == 200
        assert "exist again" in process.output()
        assert process.output().count("missing on the host") == 1


def test_planted_symlink_is_repaired_before_the_adjustment(where: Path) -> None:
    lock_parent = where / "tmp" / "vgpulock"
    target = where / "elsewhere"
    target.mkdir()
    (target / "kept").write_text("the link's target is never touched")
    os.chmod(lock_parent, 0o777)  # as HAMi's device plugin leaves it
    (lock_parent / "hostpid").symlink_to(target)
    os.lchown(lock_parent / "hostpid", 1000, 1000)
    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        adjustment = connection.create_container(pod(), gpu_container()).adjust
        assert [m.destination for m in adjustment.mounts] == [
            "/tmp/vgpulock", "/tmp/vgpulock/hostpid"]
        entry = os.lstat(lock_parent / "hostpid")
        assert not (lock_parent / "hostpid").is_symlink() and entry.st_uid == 0
        assert oct(os.stat(lock_parent).st_mode & 0o7777) == oct(0o1777)
        assert (target / "kept").read_text().startswith("the link's target")
        assert process.metric("hostpid_nri_mountpoint_repairs_total") == 1
        assert "repaired the broker mountpoint" in process.output()
        wait_for(lambda: readyz(where)[0] == 200, "ready")


def test_unrepairable_mountpoint_gives_the_lock_parent_alone(where: Path) -> None:
    """
    The lock parent's parent belongs to UID 1000: preparation refuses it
    (that user could swap the lock parent itself), so the planted file
    stays, and the container gets the lock parent alone.
    """
    lock_parent = where / "tmp" / "vgpulock"
    os.chown(where / "tmp", 1000, 1000)
    (lock_parent / "hostpid").write_text("planted")
    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        adjustment = connection.create_container(pod(), gpu_container()).adjust
        assert [(m.destination, m.source) for m in adjustment.mounts] == [
            ("/tmp/vgpulock", str(lock_parent))]
        assert list(adjustment.env) == []
        assert (lock_parent / "hostpid").read_text() == "planted"
        assert process.metric("hostpid_nri_containers_total", reason="mountpoint_unsafe") == 1
        code, body = readyz(where)
        assert code == 503 and "mountpoint is unsafe" in body and "regular file" in body, body
        assert process.output().count("cannot be repaired") == 1, process.output()


def _many(field: Callable[[api_pb2.Container], object], count: int) -> api_pb2.Container:
    ctr = gpu_container()
    for _ in range(count):
        field(ctr)
    return ctr


def _devices(count: int, last: str | None = None) -> api_pb2.Container:
    """Devices that do not match the signals (a long path each), and C{last}."""
    ctr = container()
    for index in range(count):
        ctr.linux.devices.add(path=f"/dev/nvidia{index}x" + "n" * 200)
    if last is not None:
        ctr.linux.devices.add(path=last)
    return ctr


def _shapes() -> dict[str, api_pb2.Container]:
    """Containers as large as one frame carries, one list at a time."""
    env = gpu_container()
    env.env.extend([""] * 2_000_000)
    long_paths = gpu_container()
    for _ in range(FRAME_CAP // 4200):
        long_paths.mounts.add(destination="/tmp/vgpulock/x/" + "./" * 2038, source="/dev/null")
    return {
        "2M environment entries": env,
        "1M mounts": _many(lambda c: c.mounts.add(), 1_000_000),
        "1M devices": _many(lambda c: c.linux.devices.add(), 1_000_000),
        "1M CDI devices": _many(lambda c: c.CDI_devices.add(), 1_000_000),
        "16000 mounts under /tmp/vgpulock": _many(
            lambda c: c.mounts.add(destination="/tmp/vgpulock/./" + "a" * 200,
                                   source="/dev/null/" + "b" * 20), 16_000),
        "16000 devices, no GPU among them": _devices(16_000),
        "16000 devices, the GPU last": _devices(16_000, "/dev/nvidia0"),
        "long paths through the lock parent": long_paths,
        "one 4 MB mount destination": container(devices=["/dev/nvidia0"], mounts=[
            ("/tmp/vgpulock/" + "/." * (FRAME_CAP // 2 - 200), "/dev/null", [])]),
    }


def test_any_container_up_to_the_frame_cap_is_decided_in_time(where: Path) -> None:
    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        times = {}
        for name, ctr in _shapes().items():
            request = api_pb2.CreateContainerRequest(pod=pod(), container=ctr)
            assert request.ByteSize() < FRAME_CAP, (name, request.ByteSize())
            before = process.metric("hostpid_nri_decision_seconds_sum") or 0.0
            started = time.monotonic()
            connection.create_container(pod(), ctr, timeout=scaled(2.0))
            answered = time.monotonic() - started
            decided = (process.metric("hostpid_nri_decision_seconds_sum") or 0.0) - before
            times[name] = (decided, answered)
        print("\n[nri] decided, answered (s): " + "; ".join(
            f"{name}: {d:.4f}, {a:.3f}" for name, (d, a) in times.items()))
        for name, (decided, answered) in times.items():
            # The plugin's own measure of the decision, and the whole round
            # trip (encoding, 4 MiB through the socket, decoding) inside half
            # of the runtime's request timeout (2 s).
            assert decided < scaled(0.1), (name, decided)
            assert answered < scaled(1.0), (name, answered)
        assert "took" not in process.output(), process.output()


def test_log_lines_are_bounded(where: Path) -> None:
    """Megabyte names and details: the log stays a few kilobytes."""
    big = "n" * 400_000  # seven of them in one request: under the frame cap
    with FakeRuntime(where / "nri.sock") as runtime, plugin(where) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        before = len(process.output())
        shadowing = gpu_container(mounts=[("/tmp/vgpulock", "/" + "s" * 400_000, [])])
        shadowing.name = big
        shadowing.annotations["a"] = big
        connection.create_container(pod(name=big, namespace=big), shadowing)
        adjusted = gpu_container()
        adjusted.name = big
        connection.create_container(pod(name=big, namespace=big), adjusted)
        wait_for(lambda: process.output().count("hostpid-nri: nnn") >= 2, "two log lines")
        grown = len(process.output()) - before
        print(f"\n[nri] log written for two CreateContainer with 400 KB names: {grown} bytes")
        assert grown < 4096, grown
