"""
Debian's own kernel packages, fetched with Debian's own tools.

The matrix boots the standard C{amd64} flavour of four Debian kernels (the
C{cloud} flavour has no 9p).  They come from the archive this machine is
already configured for: the URIs, components and keyring are read from its
apt sources (C{/etc/apt/sources.list.d/*.sources} or C{sources.list}) and
only the suite is changed, in a private apt configuration (its own sources
list, state and cache under L{CACHE}) so that the machine's own apt state is
never touched.  Packages are fetched with C{apt-get download} and unpacked
with C{dpkg-deb -x}; everything is cached, so a rerun costs one look at the
cached package lists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

#: Where downloads, unpacked packages and private apt state live.
CACHE = Path(os.environ.get("HOSTPID_KERNEL_CACHE", "/var/cache/hostpid-kernels"))

@contextmanager
def filling(final: Path, marker: str) -> Iterator[Path]:
    """
    A temporary directory beside C{final} for the body to fill, renamed to
    C{final} once the body has returned: a build or download that fails or is
    interrupted leaves nothing that looks finished.  When another run put
    C{final} (with its C{marker} file) in place first, that copy is kept.
    Every cached build and download of the suite's components is made so.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield staging
        try:
            staging.rename(final)
        except OSError:
            if not (final / marker).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


#: Package lists older than this are refreshed (a new point release may
#: have replaced the package the lists name, and the old .deb is gone).
LISTS_MAX_AGE = 24 * 3600.0


@attrs.frozen
class Kernel:
    """One kernel of the matrix: a series and the Debian suite that ships it."""

    series: str
    suite: str

    @property
    def name(self) -> str:
        return f"{self.series}-{self.suite}"


#: The matrix: what production GPU nodes run.  Debian 13 (trixie)
#: itself ships 6.12; its 6.16 is in trixie-backports.
KERNELS: tuple[Kernel, ...] = (
    Kernel("5.10", "bullseye"),
    Kernel("6.1", "bookworm"),
    Kernel("6.12", "bookworm-backports"),
    Kernel("6.16", "trixie-backports"),
)


@attrs.frozen
class AptSource:
    """The parts of a configured apt source that a private one copies."""

    uris: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None

    def line(self, suite: str) -> str:
        """A one-line C{sources.list} entry for C{suite} (first URI)."""
        option = f"[signed-by={self.signed_by}] " if self.signed_by else ""
        return f"deb {option}{self.uris[0]} {suite} {' '.join(self.components)}\n"


def _deb822_stanzas(text: str) -> Iterable[dict[str, str]]:
    stanza: dict[str, str] = {}
    key = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if stanza:
                yield stanza
            stanza, key = {}, None
            continue
        if raw[0] in " \t" and key is not None:
            stanza[key] += "\n" + raw.strip()
            continue
        key, _, value = raw.partition(":")
        key = key.strip().lower()
        stanza[key] = value.strip()
    if stanza:
        yield stanza


def _configured_sources(etc: Path) -> Iterable[tuple[AptSource, tuple[str, ...]]]:
    """Every C{deb} source configured under C{etc} (an C{/etc/apt}), with its suites."""
    parts = etc / "sources.list.d"
    for path in sorted(parts.glob("*.sources")) if parts.is_dir() else ():
        for stanza in _deb822_stanzas(path.read_text()):
            if "deb" not in stanza.get("types", "").split():
                continue
            if stanza.get("enabled", "yes").lower() == "no":
                continue
            yield (
                AptSource(
                    tuple(stanza.get("uris", "").split()),
                    tuple(stanza.get("components", "").split()),
                    stanza.get("signed-by") or None,
                ),
                tuple(stanza.get("suites", "").split()),
            )
    lists = [etc / "sources.list"]
    lists += sorted(parts.glob("*.list")) if parts.is_dir() else []
    for path in lists:
        if not path.is_file():
            continue
        for raw in path.read_text().splitlines():
            match = re.fullmatch(r"\s*deb\s+(\[[^]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)", raw)
            if match is None:
                continue
            signed = re.search(r"signed-by=(\S+?)\s*\]?$", (match.group(1) or "").rstrip("] "))
            yield (
                AptSource(
                    (match.group(2),), tuple(match.group(4).split()),
                    signed.group(1) if signed else None,
                ),
                (match.group(3),),
            )


def machine_codename(os_release: Path = Path("/etc/os-release")) -> str | None:
    for line in os_release.read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip().strip('"') or None
    return None


def machine_source(etc: Path = Path("/etc/apt"), codename: str | None = None) -> AptSource:
    """
    The machine's main Debian archive source: the one that serves its own
    release's suite (the codename in C{/etc/os-release}).  Security and
    update suites live elsewhere or carry a suffix, and are not it.
    """
    codename = codename or machine_codename()
    for source, suites in _configured_sources(etc):
        if source.uris and (codename in suites if codename else True):
            return source
    raise RuntimeError(f"no apt source under {etc} serves the suite {codename!r}")


@attrs.frozen
class PrivateApt:
    """An apt configuration of its own for one suite, under L{CACHE}."""

    suite: str
    root: Path

    @classmethod
    def create(cls, suite: str, source: AptSource, cache: Path = CACHE) -> PrivateApt:
        root = cache / "apt" / suite
        for sub in ("etc", "state/lists/partial", "cache/archives/partial"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        sources = root / "etc" / "sources.list"
        line = source.line(suite)
        if not sources.is_file() or sources.read_text() != line:
            sources.write_text(line)
            stamp = root / "state" / "updated"
            stamp.unlink(missing_ok=True)
        return cls(suite, root)

    def options(self) -> list[str]:
        return [
            "-o", f"Dir::Etc::sourcelist={self.root / 'etc' / 'sources.list'}",
            "-o", "Dir::Etc::sourceparts=-",
            "-o", f"Dir::State={self.root / 'state'}",
            "-o", f"Dir::Cache={self.root / 'cache'}",
            "-o", "Dir::State::status=/dev/null",
            "-o", "APT::Get::List-Cleanup=1",
        ]

    def run(self, tool: str, *args: str, cwd: Path | None = None) -> str:
        result = subprocess.run(
            [tool, "-q", *self.options(), *args], cwd=cwd,
            capture_output=True, text=True, timeout=600,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} ({self.suite}): {result.stderr.strip()}")
        return result.stdout

    def update(self, force: bool = False) -> None:
        stamp = self.root / "state" / "updated"
        try:
            fresh = time.time() - stamp.stat().st_mtime < LISTS_MAX_AGE
        except FileNotFoundError:
            fresh = False
        if fresh and not force:
            return
        self.run("apt-get", "update")
        stamp.touch()


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def standard_flavour(series: str, names: Sequence[str]) -> str | None:
    """
    The newest standard-flavour image package of C{series} among C{names}:
    C{linux-image-6.16.12+deb13-amd64} or C{linux-image-5.10.0-32-amd64},
    never a C{cloud}, C{rt} or C{dbg} one.
    """
    pattern = re.compile(
        rf"linux-image-{re.escape(series)}(\.\d+)*(-\d+|\+deb\d+)?-amd64(-unsigned)?"
    )
    matching = [name for name in names if pattern.fullmatch(name)]
    if not matching:
        return None
    signed = [name for name in matching if not name.endswith("-unsigned")]
    return max(signed or matching, key=_version_key)


def resolve(kernel: Kernel, apt: PrivateApt) -> str:
    """
    The image package for C{kernel}: what the suite's C{linux-image-amd64}
    metapackage depends on when that is of the series (bullseye, bookworm,
    bookworm-backports), else the newest of the series that the suite has
    (trixie-backports, whose metapackage has moved on).
    """
    depends = apt.run("apt-cache", "depends", "linux-image-amd64")
    named = re.findall(r"Depends:\s+(linux-image-\S+)", depends)
    chosen = standard_flavour(kernel.series, named)
    if chosen is None:
        names = apt.run("apt-cache", "pkgnames", f"linux-image-{kernel.series}").split()
        chosen = standard_flavour(kernel.series, names)
    if chosen is None:
        raise RuntimeError(f"{kernel.suite} has no standard-flavour {kernel.series} kernel")
    return chosen


@attrs.frozen
class UnpackedKernel:
    """A kernel package unpacked: its image, its modules, its release."""

    kernel: Kernel
    package: str
    root: Path

    @property
    def _modules_parent(self) -> Path:
        # Packages from trixie on install modules under /usr/lib (merged /usr).
        for parent in (self.root / "lib" / "modules", self.root / "usr" / "lib" / "modules"):
            if parent.is_dir():
                return parent
        raise RuntimeError(f"{self.package} has no modules directory")

    @property
    def release(self) -> str:
        (modules,) = self._modules_parent.iterdir()
        return modules.name

    @property
    def image(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.release}"

    @property
    def modules(self) -> Path:
        return self._modules_parent / self.release


def unpack(apt: PrivateApt, package: str, cache: Path = CACHE) -> Path:
    """
    Download (once) and unpack (once) the candidate version of C{package}
    from C{apt}'s suite: the directory C{dpkg-deb -x} filled.  Shared by the
    kernel matrix and by anything else the tests take from another suite
    (containerd from trixie for the CRI end-to-end test).
    """
    version = apt.run("apt-cache", "show", "--no-all-versions", package)
    (number,) = re.findall(r"^Version: (\S+)$", version, re.M)
    # Go source packages are "Architecture: all", and their file says so.
    (arch,) = re.findall(r"^Architecture: (\S+)$", version, re.M)
    unpacked = cache / "unpacked" / f"{package}_{number}"
    if (unpacked / ".complete").is_file():
        return unpacked
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    deb = debs / f"{package}_{number.replace(':', '%3a')}_{arch}.deb"
    if not deb.is_file():
        apt.run("apt-get", "download", f"{package}={number}", cwd=debs)
    if not deb.is_file():
        raise RuntimeError(f"apt-get download {package}={number} left no {deb}")
    staging = unpacked.with_name(unpacked.name + ".partial")
    subprocess.run(["rm", "-rf", "--", str(staging)], check=True)
    staging.mkdir(parents=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True, timeout=600)
    (staging / ".complete").touch()
    subprocess.run(["rm", "-rf", "--", str(unpacked)], check=True)
    staging.rename(unpacked)
    return unpacked


def obtain(kernel: Kernel, cache: Path = CACHE, source: AptSource | None = None) -> UnpackedKernel:
    """Resolve, download (once) and unpack (once) the kernel package for C{kernel}."""
    apt = PrivateApt.create(kernel.suite, source or machine_source(), cache)
    apt.update()
    package = resolve(kernel, apt)
    return UnpackedKernel(kernel, package, unpack(apt, package, cache))
