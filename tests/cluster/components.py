"""
The Kubernetes components of the cluster tier, built or fetched once into
the cache directory the kernel matrix uses (L{kernels.debian.CACHE}), keyed
by version, and never installed on the host.

- C{kube-apiserver}, C{kube-controller-manager}, C{kube-scheduler},
  C{kubelet} and C{kubectl} are built from the Go module proxy at one
  release: a module of our own requires C{k8s.io/kubernetes} at
  L{KUBERNETES_VERSION} and replaces every staging module
  (C{k8s.io/api}, C{k8s.io/client-go}, ...) by its published C{v0.X.Y}
  release.  The list of staging modules is k8s.io/kubernetes's own: its
  C{go.mod} (read from the proxy with C{go mod download -json}) replaces each
  with C{./staging/src/k8s.io/NAME}, a path that exists only in its Git tree,
  which is why a plain C{go install k8s.io/kubernetes/cmd/kubelet@v1.36.3}
  fails.  The version is stamped the way the project's own build stamps it
  (C{hack/lib/version.sh} C{kube::version::ldflags}: C{-X} on
  C{k8s.io/component-base/version}), so each component reports its release.
- etcd is Debian forky's C{etcd-server}, fetched and unpacked as the kernels
  and containerd are (L{crilib.unpacked_package}).

A build goes to a temporary directory beside its final place and is renamed
into place only once every binary exists, so a build killed half-way leaves
nothing that a later run would take for complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from kernels.debian import CACHE, filling

#: The Kubernetes release the tier runs (user namespaces and DRA GA).
KUBERNETES_VERSION = "v1.36.3"

#: The commands built, in the order they are started.
COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")

#: etcd: Debian forky's package (3.5 at the time of writing; Kubernetes 1.36
#: supports etcd 3.5 and 3.6).
ETCD_SUITE = "forky"
ETCD_PACKAGE = "etcd-server"

#: A build of five large Go commands on two cores, cold: generous.
BUILD_TIMEOUT = 3 * 3600


def staging_version(version: str) -> str:
    """C{v1.36.3} -> C{v0.36.3}: the tag every staging module is published under."""
    match = re.fullmatch(r"v1\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a Kubernetes release: {version!r}")
    return f"v0.{match.group(1)}.{match.group(2)}"


def staging_modules(upstream_go_mod: str) -> list[str]:
    """
    The modules k8s.io/kubernetes's C{go.mod} replaces by a directory of its
    own tree (C{k8s.io/api => ./staging/src/k8s.io/api}), in its order.
    """
    modules = []
    for line in upstream_go_mod.splitlines():
        match = re.match(r"^\s*(?:replace\s+)?(\S+)\s+=>\s+\./staging/src/(\S+)\s*$", line)
        if match is not None:
            modules.append(match.group(1))
    if not modules:
        raise ValueError("k8s.io/kubernetes's go.mod replaces no staging module")
    return modules


def go_mod(version: str, upstream_go_mod: str, go_version: str) -> str:
    """
    The build module's C{go.mod}: requires k8s.io/kubernetes at C{version}
    and replaces each of its staging modules by the matching release.
    """
    target = staging_version(version)
    replaces = "".join(f"\t{module} => {module} {target}\n"
                       for module in staging_modules(upstream_go_mod))
    return (f"module hostpid.test/k8sbuild\n\ngo {go_version}\n\n"
            f"require k8s.io/kubernetes {version}\n\nreplace (\n{replaces})\n")


def tools_go() -> str:
    """A file that imports each command, so that C{go mod tidy} keeps what they need."""
    imports = "".join(f'\t_ "k8s.io/kubernetes/cmd/{command}"\n' for command in COMMANDS)
    return f"//go:build tools\n\npackage tools\n\nimport (\n{imports})\n"


def ldflags(version: str) -> str:
    """
    The version stamp C{hack/lib/version.sh} gives a release build
    (C{kube::version::ldflags}), without the build date, so that two builds
    of one release are the same.
    """
    major, minor = version.lstrip("v").split(".")[:2]
    package = "k8s.io/component-base/version"
    stamps = {"gitVersion": version, "gitMajor": major, "gitMinor": minor,
              "gitTreeState": "clean"}
    return " ".join(f"-X {package}.{name}={value}" for name, value in stamps.items())


def build_argv(version: str, out: str) -> list[str]:
    """The C{go build} command line (static, paths trimmed, stamped)."""
    return ["go", "build", "-trimpath", f"-ldflags={ldflags(version)}", "-o", out,
            *(f"k8s.io/kubernetes/cmd/{command}" for command in COMMANDS)]


def go_env(workdir: Path) -> dict[str, str]:
    """
    The Go toolchain's environment: the machine's Go, the module and build
    caches the runtimes' builds use (L{builds.go_caches}: under the cache
    directory unless the environment names others; a rebuild of the same
    flags is a cache hit), no cgo (the release binaries are static too), the
    module proxy only.
    """
    from builds import go_caches

    env = {key: value for key, value in os.environ.items()
           if key in ("PATH", "HOME", "GOPATH", "GOCACHE", "GOMODCACHE", "GOPROXY",
                      "GONOSUMDB", "GOSUMDB", "GOTOOLCHAIN", "http_proxy", "https_proxy",
                      "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "no_proxy")}
    env.setdefault("HOME", "/root")
    env.update(go_caches(CACHE))
    env.update(CGO_ENABLED="0", GOFLAGS="", GOWORK="off", PWD=str(workdir))
    return env


def _go(workdir: Path, *args: str, timeout: float = 1800) -> str:
    result = subprocess.run(["go", *args], cwd=workdir, env=go_env(workdir),
                            capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"go {' '.join(args)} failed ({result.returncode}):\n"
                           f"{result.stderr[-4000:]}")
    return result.stdout


def go_version() -> str:
    """The machine's Go (C{go1.26.8} -> C{1.26.0}), the module's C{go} line."""
    output = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True,
                            check=True, timeout=60).stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", output)
    if match is None:
        raise RuntimeError(f"cannot read Go's version from {output!r}")
    return f"{match.group(1)}.{match.group(2)}.0"


def kubernetes_dir(version: str = KUBERNETES_VERSION, cache: Path = CACHE) -> Path:
    return cache / f"kubernetes-{version}"


def kubernetes(version: str = KUBERNETES_VERSION, cache: Path = CACHE) -> Path:
    """
    The directory holding the built commands (C{bin/}) and the module they
    were built from (C{go.mod}, C{go.sum}): built on the first call for
    C{version}, reused afterwards.
    """
    def build(work: Path) -> None:
        download = json.loads(_go(work.parent, "mod", "download", "-json",
                                  f"k8s.io/kubernetes@{version}"))
        upstream = Path(download["GoMod"]).read_text()
        (work / "go.mod").write_text(go_mod(version, upstream, go_version()))
        (work / "tools.go").write_text(tools_go())
        _go(work, "mod", "tidy")
        _go(work, *build_argv(version, "bin/")[1:], timeout=BUILD_TIMEOUT)
        missing = [command for command in COMMANDS if not (work / "bin" / command).is_file()]
        if missing:
            raise RuntimeError(f"go build left no {', '.join(missing)} in {work / 'bin'}")

    return _cached(kubernetes_dir(version, cache), "Kubernetes", build)


def _cached(final: Path, what: str, build: Callable[[Path], None]) -> Path:
    """
    C{final}, made by C{build} in the suite's one cache-filling helper
    (L{kernels.debian.filling}: a build killed half-way leaves nothing a
    later run would take for complete); reused when there.
    """
    if (final / ".complete").is_file():
        return final
    if shutil.which("go") is None:
        raise RuntimeError(f"building {what} needs Go on PATH (1.26 or newer)")
    with filling(final, ".complete") as work:
        build(work)
        (work / ".complete").touch()
    return final


#: KWOK (Kubernetes WithOut Kubelet), the simulated nodes of the fleet
#: (L{kwok}): its controller C{kwok}, which needs Go 1.26.
KWOK_MODULE = "sigs.k8s.io/kwok"
KWOK_VERSION = "v0.8.0"

#: The module's own default stages, as C{kwokctl} gives a cluster
#: (C{pkg/kwokctl/runtime/cluster.go} C{getDefaultNodeStages} with a node
#: lease, C{getDefaultPodStages}): copied beside the binary from the
#: module's source, so that the stages are the release's.
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)


def kwok_go_mod(version: str, go_version: str) -> str:
    return (f"module hostpid.test/kwokbuild\n\ngo {go_version}\n\n"
            f"require {KWOK_MODULE} {version}\n")


def kwok(version: str = KWOK_VERSION, cache: Path = CACHE) -> Path:
    """
    The directory holding C{bin/kwok}, built from the Go module proxy at
    C{version} (stamped as its release stamps it, C{hack/releases.sh}), and
    C{stages/}, the module's default stages: built on the first call,
    reused afterwards.
    """
    def build(work: Path) -> None:
        download = json.loads(_go(work.parent, "mod", "download", "-json",
                                  f"{KWOK_MODULE}@{version}"))
        (work / "go.mod").write_text(kwok_go_mod(version, go_version()))
        (work / "tools.go").write_text(
            f'//go:build tools\n\npackage tools\n\nimport _ "{KWOK_MODULE}/cmd/kwok"\n')
        _go(work, "mod", "tidy")
        stamp = f"-X {KWOK_MODULE}/pkg/consts.Version={version.lstrip('v')}"
        _go(work, "build", "-trimpath", f"-ldflags={stamp}", "-o", "bin/kwok",
            f"{KWOK_MODULE}/cmd/kwok", timeout=BUILD_TIMEOUT)
        (work / "stages").mkdir()
        for path in KWOK_STAGES:
            shutil.copyfile(Path(download["Dir"]) / path, work / "stages" / Path(path).name)

    return _cached(cache / f"kwok-{version}", "KWOK", build)


def etcd() -> Path:
    """The directory forky's etcd-server is unpacked in (its binary: C{usr/bin/etcd})."""
    from crilib import unpacked_package

    return unpacked_package(ETCD_SUITE, ETCD_PACKAGE)


def versions(kubernetes_bin: Path, etcd_bin: Path | None = None) -> Mapping[str, str]:
    """Each component's own account of its version, as it prints it (etcd's when given)."""
    found = {}
    for command in COMMANDS:
        argv = [str(kubernetes_bin / command), "--version"]
        if command == "kubectl":
            argv = [str(kubernetes_bin / command), "version", "--client"]
        output = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                check=False).stdout
        found[command] = output.strip().splitlines()[0] if output.strip() else "?"
    if etcd_bin is None:
        return found
    output = subprocess.run([str(etcd_bin), "--version"], capture_output=True, text=True,
                            timeout=60, check=False).stdout
    found["etcd"] = output.strip().splitlines()[0] if output.strip() else "?"
    return found
