"""
Container runtimes built from their own source at a tagged release, once.

Debian ships containerd 1.7 and 2.1 and runc 1.1.5; clusters that upgrade run
newer ones, and CRI-O is not in Debian at all.  Each L{GoBuild} names a Go
module at one version, the commands to build from it and the build tags;
L{obtain} builds it into C{CACHE/NAME-VERSION/bin} (the kernel matrix's cache,
keyed by version) and returns that directory.  Nothing is installed on the
host.

How a build runs: C{go mod download} brings the module's source from the Go
module proxy into the module cache (read-only there); the source is copied to
a temporary directory, made writable, and each command is built there with
C{go build -mod=mod}, so that the module's own C{go.mod} (with its C{replace}
directives, which C{go install module@version} refuses) decides every
dependency.  C parts (CRI-O's C{pinns}) are built with C{make} in the same
copy.  The result is assembled in a temporary directory beside the final
one and renamed into place, so a build that fails or is interrupted leaves
nothing that looks finished; a later run reuses what is there.

Go's own caches (the module cache and the build cache) live under the same
cache directory (L{go_caches}) unless C{GOMODCACHE} or C{GOCACHE} say
otherwise, so that a cache directory pointed at an empty one
(C{HOSTPID_KERNEL_CACHE}) starts every build cold.

Run as a script (C{python tests/e2e/builds.py [NAME...]}) to build these ahead
of the tests and print each build's versions and time; C{tests/prebuild.py}
(what C{.ci/run} runs) builds them with everything else the suite builds or
fetches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.debian import CACHE, filling  # noqa: E402

#: A cold build on this project's 2-core machines takes minutes (CRI-O most).
BUILD_TIMEOUT = 3600.0


@attrs.frozen
class GoBuild:
    """
    One Go module at one version and what to build from it.

    C{commands} maps each binary's name to its package's path inside the
    module; C{ldflags} may use C{{version}}; C{make} lists directories of
    the module to run C{make} in and the file each produces.
    """

    name: str
    module: str
    version: str
    commands: tuple[tuple[str, str], ...]
    tags: tuple[str, ...] = ()
    ldflags: str = ""
    cgo: bool = True
    make: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


#: runc 1.5: idmapped mounts (runc 1.2+), the runtime of today's containerds.
#: Its Makefile builds with C{seccomp} (libseccomp through cgo).
RUNC = GoBuild(
    "runc", "github.com/opencontainers/runc", "v1.5.3",
    (("runc", "."),),
    tags=("seccomp", "urfave_cli_no_docs"),
    ldflags="-X main.version={bare}",
)

#: containerd 2.4: the daemon, its runc shim and ctr (Makefile C{COMMANDS}).
#: The snapshotters the tests do not use are left out by their tags.
CONTAINERD = GoBuild(
    "containerd", "github.com/containerd/containerd/v2", "v2.4.2",
    (("containerd", "cmd/containerd"),
     ("containerd-shim-runc-v2", "cmd/containerd-shim-runc-v2"),
     ("ctr", "cmd/ctr")),
    tags=("no_btrfs", "no_devmapper", "no_zfs", "urfave_cli_no_docs"),
    ldflags="-X github.com/containerd/containerd/v2/version.Version={version}",
)

#: CRI-O: the newest release the module proxy serves here (1.34.0; the
#: later ones it refuses).  Tags as its Makefile's for a build with neither
#: btrfs, devicemapper, ostree nor gpgme; seccomp through libseccomp.  Its
#: C{pinns} (namespace pinning, C) is built from the same source, and so is
#: its test tool C{copyimg}, which copies an image from an C{oci-archive:}
#: into a containers-storage root (CRI-O has no C{ctr images import}, and no
#: registry is reachable here).
CRIO = GoBuild(
    "crio", "github.com/cri-o/cri-o", "v1.34.0",
    (("crio", "cmd/crio"), ("copyimg", "test/copyimg")),
    tags=("containers_image_openpgp", "containers_image_ostree_stub",
          "exclude_graphdriver_btrfs", "exclude_graphdriver_devicemapper", "seccomp"),
    make=(("pinns", "bin/pinns"),),
)

BUILDS = {build.name: build for build in (RUNC, CONTAINERD, CRIO)}


def go_caches(cache: Path = CACHE) -> dict[str, str]:
    """
    Go's module and build caches: C{GOMODCACHE} and C{GOCACHE} from the
    environment, else under C{cache} (C{go/mod}, C{go/build}).  Go makes the
    module cache read-only: C{go clean -modcache} (or C{chmod -R u+w}) first
    to delete it.
    """
    return {"GOMODCACHE": os.environ.get("GOMODCACHE") or str(cache / "go" / "mod"),
            "GOCACHE": os.environ.get("GOCACHE") or str(cache / "go" / "build")}


def _go_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"GOFLAGS": "-mod=mod", "GOTOOLCHAIN": env.get("GOTOOLCHAIN", "local"),
                "HOME": env.get("HOME", str(home)), **go_caches(home.parent)})
    return env


def module_source(build: GoBuild, env: dict[str, str]) -> Path:
    """The module's extracted source in the module cache (downloaded once)."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{build.module}@{build.version}"],
        capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(),
        timeout=BUILD_TIMEOUT, check=False)
    info = json.loads(result.stdout or "{}")
    if result.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"go mod download {build.module}@{build.version} failed: "
                           f"{info.get('Error') or result.stderr.strip()}")
    return Path(info["Dir"])


def _run(argv: Sequence[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        result = subprocess.run(list(argv), cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT, check=False)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{argv[0]} failed ({result.returncode}) in {cwd}:\n{tail}")


def build_into(build: GoBuild, out: Path, env: dict[str, str]) -> dict[str, object]:
    """Build C{build} into C{out/bin}; what was built, with the Go version and seconds taken."""
    started = time.monotonic()
    source = module_source(build, env)
    log = out / "build.log"
    (out / "bin").mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix=f"hostpid-build-{build.name}-") as scratch:
        tree = Path(scratch) / "src"
        shutil.copytree(source, tree)
        subprocess.run(["chmod", "-R", "u+w", str(tree)], check=True)
        build_env = dict(env, CGO_ENABLED="1" if build.cgo else "0")
        ldflags = build.ldflags.format(version=build.version, bare=build.version.lstrip("v"))
        for binary, package in build.commands:
            _run(["go", "build", "-mod=mod", "-trimpath", "-buildvcs=false",
                  "-tags", " ".join(build.tags), "-ldflags", ldflags,
                  "-o", str(out / "bin" / binary), f"./{package}"], tree, build_env, log)
        for directory, product in build.make:
            _run(["make", "-C", directory], tree, build_env, log)
            shutil.copy2(tree / product, out / "bin" / Path(product).name)
    go_version = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True,
                                env=env, check=False).stdout.strip()
    return {"module": build.module, "version": build.version, "go": go_version,
            "tags": list(build.tags), "seconds": round(time.monotonic() - started, 1),
            "binaries": sorted(p.name for p in (out / "bin").iterdir())}


def obtain(build: GoBuild, cache: Path = CACHE) -> Path:
    """
    C{CACHE/NAME-VERSION}, built now if it is not there yet; its C{bin}
    holds the binaries and C{build.json} what L{build_into} recorded.
    """
    final = cache / build.key
    if (final / "build.json").is_file():
        return final
    with filling(final, "build.json") as staging:
        record = build_into(build, staging, _go_env(staging))
        (staging / "build.json").write_text(json.dumps(record, indent=2) + "\n")
        os.chmod(staging, 0o755)
    return final


def recorded(build: GoBuild, cache: Path = CACHE) -> dict[str, object] | None:
    """What the cached build of C{build} recorded, or C{None} if it is not built."""
    path = cache / build.key / "build.json"
    return json.loads(path.read_text()) if path.is_file() else None


def describe(build: GoBuild, directory: Path) -> list[str]:
    """One line per binary of C{build} in C{directory}: its own account of its version."""
    lines = []
    for binary in (recorded(build, directory.parent) or {}).get("binaries", []):  # type: ignore[union-attr]
        path = directory / "bin" / str(binary)
        if binary == "pinns":
            lines.append(f"{binary}: (C, from the same tree; it has no version flag)")
            continue
        flag = "-v" if binary == "containerd-shim-runc-v2" else "--version"
        shown = subprocess.run([str(path), flag], capture_output=True, text=True, check=False)
        printed = [line.strip() for line in (shown.stdout or shown.stderr).splitlines()]
        versioned = [line for line in printed if "version" in line.lower()]
        lines.append(f"{binary}: {(versioned or printed or ['?'])[0]}")
    return lines


def main(argv: Sequence[str]) -> int:
    names = list(argv) or list(BUILDS)
    for name in names:
        build = BUILDS[name]
        started = time.monotonic()
        directory = obtain(build)
        record = recorded(build) or {}
        print(f"{build.key}: {directory} (built in {record.get('seconds')} s with "
              f"{record.get('go')}; this run {time.monotonic() - started:.1f} s)", flush=True)
        for line in describe(build, directory):
            print(f"  {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
