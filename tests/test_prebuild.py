"""
C{.ci/run} builds and fetches everything before the tests (tests/prebuild.py),
so that on a cold machine no test's setup pays for a build and no kernel guest
boots beside one (a cold run's Kubernetes build, made in the first cluster
test's setup, failed two guests' boot bound and starved a third to its cap).

- C{.ci/run} runs the prebuild step before the README's test command.
- Every component the suite builds or fetches into the cache has a step:
  each runtime build, Kubernetes, each kernel, each Debian-suite containerd,
  etcd, each NRI release's sources, the image, the install tests' wheels.
"""

from __future__ import annotations

import prebuild
from kernels import debian
from support import REPO


def test_ci_builds_everything_before_the_tests() -> None:
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line and not line.startswith("#")]
    (step,) = [n for n, line in enumerate(lines) if "tests/prebuild.py" in line]
    assert step < len(lines) - 1 and lines[-1].endswith(".venv/bin/python -m pytest")


def test_every_component_has_a_step() -> None:
    names = [step.name for step in prebuild.steps()]
    assert len(names) == len(set(names)), names
    wanted = {build.key for build in prebuild.builds.BUILDS.values()}
    wanted |= {f"kernel-{kernel.series}" for kernel in debian.KERNELS}
    wanted |= {f"containerd-{release.name}" for release in prebuild.crilib.RELEASES.values()
               if release.suite}
    wanted |= {f"nri-{name}" for name in prebuild.nrigolib.NRI_RELEASES}
    wanted |= {f"kubernetes-{prebuild.components.KUBERNETES_VERSION}", "etcd", "image",
               "wheelhouse"}
    assert set(names) == wanted
