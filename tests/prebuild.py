"""
Everything the suite builds or fetches, ahead of the tests: what C{.ci/run}
runs before pytest, so that on a cold machine no test's setup pays for a
build, and no guest of the kernel matrix boots beside one.

Each step calls the one place that obtains its component (the harnesses,
imported, never copied), which caches it under the cache directory
(C{HOSTPID_KERNEL_CACHE}, default C{/var/cache/hostpid-kernels}) keyed by
version, and does nothing once it is there:

 - the runtimes built from the Go module proxy (tests/e2e/builds.py: runc
   1.5, containerd 2.4, CRI-O) and Kubernetes (tests/cluster/components.py);
 - Debian's packages from other suites: the kernels of the matrix and their
   initramfs (tests/kernels/debian.py, vm.py), containerd 1.7 and 2.1
   (tests/e2e/crilib.py), etcd (components.py), NRI's Go sources
   (tests/e2e/nrigolib.py);
 - the project's image, its two tags, and its Debian bases (tests/imagelib.py);
 - the wheels the install tests install offline (tests/wheelhouse.py).

Two lanes run side by side: the compiles, which keep both cores busy, and the
fetches, which mostly wait on the network and the disk.  Each step prints a
line with what it made and how long it took; a step that fails is named, the
others still run, and the script exits 1.  Run by hand::

    .venv/bin/python tests/prebuild.py            # everything
    .venv/bin/python tests/prebuild.py kernel-6.1 image
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

TESTS = Path(__file__).resolve().parent
for _path in (TESTS, TESTS / "e2e", TESTS / "cluster"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import builds  # noqa: E402
import components  # noqa: E402
import crilib  # noqa: E402
import imagelib  # noqa: E402
import nrigolib  # noqa: E402
import wheelhouse  # noqa: E402
from kernels import debian, vm  # noqa: E402


@attrs.frozen
class Step:
    """One component: its name, its lane, and what obtains it (returns lines to print)."""

    name: str
    lane: str
    obtain: Callable[[], list[str]]


def _runtime(build: builds.GoBuild) -> list[str]:
    directory = builds.obtain(build)
    return [str(directory), *builds.describe(build, directory)]


def _kubernetes() -> list[str]:
    directory = components.kubernetes()
    found = components.versions(directory / "bin")
    return [str(directory), *(f"{name}: {line}" for name, line in found.items())]


def _kernel(kernel: debian.Kernel) -> list[str]:
    unpacked = debian.obtain(kernel)
    return [f"{unpacked.package} ({unpacked.release})", f"initramfs: {vm.initrd(unpacked)}"]


def _package(suite: str, package: str) -> list[str]:
    return [str(crilib.unpacked_package(suite, package))]


def _etcd() -> list[str]:
    directory = components.etcd()
    found = subprocess.run([str(directory / "usr" / "bin" / "etcd"), "--version"],
                           capture_output=True, text=True, timeout=60, check=False).stdout
    return [str(directory), *found.strip().splitlines()[:1]]


def _nri(release: nrigolib.NriRelease) -> list[str]:
    return nrigolib.gopath(release).split(":")[:-1]


def _image() -> list[str]:
    return [str(imagelib.project_image(tag))
            for tag in (imagelib.DEFAULT_TAG, imagelib.ROLL_FORWARD_TAG)]


def steps() -> list[Step]:
    """Every step, in the order each lane runs them."""
    compiles = [Step(build.key, "compile", lambda build=build: _runtime(build))
                for build in builds.BUILDS.values()]
    compiles.append(Step(f"kubernetes-{components.KUBERNETES_VERSION}", "compile", _kubernetes))
    fetches = [Step(f"kernel-{kernel.series}", "fetch", lambda kernel=kernel: _kernel(kernel))
               for kernel in debian.KERNELS]
    fetches += [
        Step(f"containerd-{release.name}", "fetch",
             lambda release=release: _package(release.suite, crilib.CONTAINERD_PACKAGE))
        for release in crilib.RELEASES.values() if release.suite
    ]
    fetches.append(Step("etcd", "fetch", _etcd))
    fetches += [Step(f"nri-{release.name}", "fetch", lambda release=release: _nri(release))
                for release in nrigolib.NRI_RELEASES.values()]
    fetches.append(Step("image", "fetch", _image))
    fetches.append(Step("wheelhouse", "fetch", lambda: [str(wheelhouse.dependencies())]))
    return compiles + fetches


def _run_lane(lane: Sequence[Step], failed: list[str], lock: threading.Lock) -> None:
    for step in lane:
        started = time.monotonic()
        try:
            lines = step.obtain()
        except BaseException as error:  # noqa: BLE001 - pytest's skip and fail outcomes too
            if isinstance(error, KeyboardInterrupt):
                raise
            lines, problem = [], f"{type(error).__name__}: {error}"
        else:
            problem = None
        seconds = time.monotonic() - started
        with lock:
            if problem is not None:
                failed.append(step.name)
                print(f"{step.name}: FAILED after {seconds:.0f} s: {problem}", flush=True)
            else:
                print(f"{step.name}: {seconds:.0f} s", flush=True)
                for line in lines:
                    print(f"  {line}", flush=True)


def main(argv: Sequence[str]) -> int:
    chosen = steps()
    if argv:
        unknown = set(argv) - {step.name for step in chosen}
        if unknown:
            print(f"no step {sorted(unknown)}; steps: {[s.name for s in chosen]}", flush=True)
            return 2
        chosen = [step for step in chosen if step.name in argv]
    print(f"cache: {debian.CACHE}; Go's caches: {builds.go_caches()}", flush=True)
    started = time.monotonic()
    failed: list[str] = []
    lock = threading.Lock()
    lanes = [
        threading.Thread(target=_run_lane, name=f"prebuild-{lane}",
                         args=([s for s in chosen if s.lane == lane], failed, lock))
        for lane in ("compile", "fetch")
    ]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    summary = f"{len(chosen) - len(failed)} of {len(chosen)} steps ready"
    if failed:
        summary += f"; failed: {', '.join(failed)}"
    print(f"prebuild: {summary} in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
