"""
The project's container image, built from C{deploy/container/Containerfile}
with podman, from no registry: the one place the tests build it.

No container registry is reachable from the project's machines, so the
Containerfile's two bases (its C{BASE} and C{BUILD_BASE} build arguments)
are made here from Debian's packages: C{mmdebstrap --variant=essential} of
L{SUITE} with L{RUN_PACKAGES} (the image's Python and its venv module) or
L{BUILD_PACKAGES} (plus the compiler and headers the wheel's C part needs),
from the archive this machine's apt sources name
(L{kernels.debian.machine_source}, as the kernel matrix and the runtime
tests fetch Debian's packages), imported with C{podman import}.  Each root
file system is cached under the kernels' cache directory
(L{kernels.debian.CACHE}C{/image/bases}), keyed by suite, variant, package
list and source, so a warm run makes none.

The build stage reaches PyPI through pip, as this machine's pip does: its
effective configuration (C{pip config list}: files and C{PIP_*} variables)
becomes a pip configuration file handed to the build as the C{pipconf}
secret, and the CA bundle it trusts (C{cert}; the index may sit behind a
TLS-inspecting proxy) the C{cacert} secret.  Nothing names an index or a
mirror here.  Settings that name a path on this machine (C{find-links},
C{client-cert}) are left out: the build cannot see them.

Podman keeps its own store under the cache directory
(C{/image/podman}), so a rebuild reuses the cached layers; builds run with
C{--isolation chroot} (no runtime, no network namespace to set up: the
build stage uses this machine's network, as pip on it does).

For the Kubernetes tier: L{project_image} returns a C{docker-archive}
tarball of the image named as the chart's default values expect it
(L{REPOSITORY}C{:tag}, C{image.repository} in
C{deploy/helm/hostpid-broker/values.yaml}; the chart's default tag is its
C{appVersion}, L{DEFAULT_TAG}), ready for C{ctr images import} (see
L{crilib.Containerd.ctr}: C{ctr -n k8s.io images import --platform
linux/amd64 ARCHIVE}).  Every tag is built from the same tree with one label
added (C{io.hostpid.test.tag=TAG}): the layers are shared and cost nothing
more, but each tag is an image of its own (its own config, so its own image
ID and manifest digest), as a real new release would be: a roll-forward from
L{DEFAULT_TAG} to L{ROLL_FORWARD_TAG} changes the pod template's image and
the image containerd runs.  Archives are cached by the hash of everything
the build reads (the Containerfile, the files its C{COPY} lines name, the
bases' keys) and the tag: a second call in a run, or in a later run on an
unchanged tree, returns the same file at once (other trees' archives are
removed once six hours old).  Builds are serialized by a
lock file, so parallel callers build once.  Root, podman and mmdebstrap are
needed (missing: a skip naming it, a failure under
C{HOSTPID_REQUIRE_PRIVILEGED=1}).  In use::

    import imagelib
    first = imagelib.project_image(imagelib.DEFAULT_TAG)       # REPOSITORY:0.1.0
    second = imagelib.project_image(imagelib.ROLL_FORWARD_TAG)  # REPOSITORY:0.1.0-rollforward
    containerd.ctr("images", "import", "--platform", "linux/amd64", str(first))
    # helm: --set image.tag=0.1.0, then --set image.tag=0.1.0-rollforward

Cost on this machine: cold (no cached base) about 2 minutes, most of it
mmdebstrap; a changed tree about 25 s (pip fetches the dependencies again);
an unchanged tree under a second to build plus about 3 s to save each tag.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs
import yaml
from support import REPO, require_root, require_tool, skip_or_fail

CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"
CHART = REPO / "deploy" / "helm" / "hostpid-broker"

#: The Debian release the bases are made of: the CI machines' own, whose
#: Python (3.11) is the project's minimum.
SUITE = "bookworm"
#: mmdebstrap's smallest variant that still has a shell and dpkg: the
#: Essential packages and what the named ones depend on (no apt).
VARIANT = "essential"
#: The image's base: a Python with its venv module (and the pip wheel that
#: C{python3 -m venv} installs from, offline).
RUN_PACKAGES = ("python3", "python3-venv")
#: The build stage's base: the same Python, a compiler and its headers.
BUILD_PACKAGES = (*RUN_PACKAGES, "python3-dev", "gcc", "libc6-dev")
#: Files no image needs (documentation, manual pages, translations).
DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*",
                 "/usr/share/info/*")
#: Bumped when the way a base is made changes (invalidates cached bases).
BASE_FORMAT = 1

#: The PATH of the imported bases (an imported tarball has no config).
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: The label that tells one tag's image from another's.
TAG_LABEL = "io.hostpid.test.tag"

BUILD_TIMEOUT = 1800.0


def chart_image() -> tuple[str, str]:
    """The chart's default C{image.repository} and tag (its C{appVersion})."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return values["image"]["repository"], values["image"]["tag"] or str(chart["appVersion"])


#: The name the chart's default values give the image, and the tag they use.
REPOSITORY, DEFAULT_TAG = chart_image()
#: The second tag, for a roll forward (same tree, its own image: see above).
ROLL_FORWARD_TAG = f"{DEFAULT_TAG}-rollforward"


def cache_dir() -> Path:
    from kernels import debian

    return debian.CACHE / "image"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on C{path} (parallel test processes build once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- the Containerfile, read -----------------------------------------------------------


def containerfile_instructions(path: Path = CONTAINERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def copied_sources(path: Path = CONTAINERFILE) -> list[str]:
    """What the Containerfile copies from the build context (not from a stage)."""
    sources = []
    for keyword, arguments in containerfile_instructions(path):
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(arguments)
        if any(word.startswith("--from=") for word in words):
            continue
        sources += [word for word in words[:-1] if not word.startswith("--")]
    return sources


def _context_files(sources: Sequence[str]) -> Iterator[Path]:
    for source in sources:
        top = REPO / source
        if top.is_dir():
            for directory, subdirs, files in os.walk(top):
                subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
                for name in sorted(files):
                    if not name.endswith((".pyc", ".so")):
                        yield Path(directory, name)
        else:
            yield top


# --- podman, with a store of its own --------------------------------------------------


@attrs.frozen
class Podman:
    """podman with its store under the cache directory, and this machine's quirks."""

    root: Path

    @classmethod
    def cached(cls) -> Podman:
        require_root()
        require_tool("podman")
        return cls(cache_dir() / "podman")

    @property
    def _root_key(self) -> str:
        return hashlib.sha256(bytes(self.root)).hexdigest()[:8]

    def argv(self, *args: str) -> list[str]:
        return [
            require_tool("podman"), "--root", str(self.root / "storage"),
            # Locks and transient state: per boot, so under /run.
            "--runroot", f"/run/hostpid-image-podman-{self._root_key}",
            "--tmpdir", str(self.root / "tmp"),
            # This machine's hybrid cgroup layout: cgroupfs, and runc (crun fails here).
            "--cgroup-manager", "cgroupfs", "--events-backend", "file",
            "--runtime", require_tool("runc"),
            *args,
        ]

    def run(self, *args: str, timeout: float = 300.0, stdin: bytes | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            self.argv(*args), input=stdin.decode() if stdin is not None else None,
            capture_output=True, text=True, timeout=timeout, check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"podman {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return result

    def exists(self, reference: str) -> bool:
        return self.run("image", "exists", reference, check=False).returncode == 0


# --- the bases, from Debian's packages -------------------------------------------------


@attrs.frozen
class DebianBase:
    """A base image made by mmdebstrap from L{SUITE}'s packages."""

    name: str
    packages: tuple[str, ...]
    suite: str = SUITE

    def key(self, source_line: str) -> str:
        described = json.dumps({
            "suite": self.suite, "variant": VARIANT, "packages": sorted(self.packages),
            "source": source_line, "excludes": DPKG_EXCLUDES, "format": BASE_FORMAT,
        }, sort_keys=True)
        return hashlib.sha256(described.encode()).hexdigest()[:16]

    def reference(self, source_line: str) -> str:
        return f"localhost/hostpid-test-base:{self.name}-{self.suite}-{self.key(source_line)}"


RUN_BASE = DebianBase("run", RUN_PACKAGES)
BUILD_BASE = DebianBase("build", BUILD_PACKAGES)


def _source_line(suite: str) -> str:
    from kernels import debian

    try:
        return debian.machine_source().line(suite).strip()
    except (RuntimeError, OSError) as error:
        skip_or_fail(f"no Debian apt source to make the image's base from: {error}")
        raise AssertionError("unreachable") from error


def debian_base(base: DebianBase, podman: Podman) -> str:
    """
    The reference of C{base} in C{podman}'s store: made (once) with
    mmdebstrap into a cached root file system tarball, imported (once).
    """
    line = _source_line(base.suite)
    reference = base.reference(line)
    if podman.exists(reference):
        return reference
    tarball = cache_dir() / "bases" / f"{base.name}-{base.suite}-{base.key(line)}.tar"
    if not tarball.is_file():
        mmdebstrap = require_tool("mmdebstrap")
        partial = tarball.with_suffix(".partial.tar")
        partial.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [mmdebstrap, "--quiet", f"--variant={VARIANT}",
             f"--include={','.join(base.packages)}",
             *(f"--dpkgopt=path-exclude={pattern}" for pattern in DPKG_EXCLUDES),
             base.suite, str(partial), line],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False,
        )
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            skip_or_fail(f"mmdebstrap could not make the {base.name} base from {line!r}: "
                         f"{result.stderr.strip()[-2000:]}")
        partial.rename(tarball)
    podman.run("import", "--change", f"ENV PATH={BASE_PATH}", str(tarball), reference,
               timeout=BUILD_TIMEOUT)
    return reference


# --- this machine's pip configuration, for the build stage -------------------------------

#: Settings that name a file or directory on this machine: the build cannot see them.
_HOST_PATHS = ("cert", "client-cert", "find-links")


def host_pip_configuration() -> tuple[str, Path | None]:
    """
    This machine's effective pip configuration as a pip configuration file
    (text), and the CA bundle pip trusts here (its C{cert} setting, else
    C{REQUESTS_CA_BUNDLE} or C{CURL_CA_BUNDLE}, which its HTTP library
    honours), or None.  Environment variables win over files, as in pip.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    files: dict[tuple[str, str], str] = {}
    environment: dict[tuple[str, str], str] = {}
    for line in listed.splitlines():
        name, _, quoted = line.partition("=")
        if not quoted:
            continue
        value = (shlex.split(quoted) or [""])[0]
        if name.startswith(":env:."):
            environment[("global", name[len(":env:."):])] = value
        else:
            section, _, key = name.partition(".")
            files[(section, key)] = value
    merged = {**files, **environment}
    cert = merged.get(("global", "cert")) or os.environ.get("REQUESTS_CA_BUNDLE") or \
        os.environ.get("CURL_CA_BUNDLE")
    sections: dict[str, list[str]] = {}
    for (section, key), value in merged.items():
        if key in _HOST_PATHS:
            continue
        sections.setdefault(section, []).append(f"{key} = {value}")
    text = "".join(f"[{section}]\n" + "".join(f"{line}\n" for line in lines)
                   for section, lines in sorted(sections.items()))
    return text, Path(cert) if cert and Path(cert).is_file() else None


# --- the project's image ---------------------------------------------------------------


def source_hash(bases: Sequence[str]) -> str:
    """Everything the build reads: the Containerfile, what it copies, the bases."""
    digest = hashlib.sha256()
    for path in [CONTAINERFILE, *_context_files(copied_sources())]:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    for base in bases:
        digest.update(base.encode() + b"\0")
    return digest.hexdigest()[:16]


@attrs.frozen
class Built:
    """One build of the image: its reference in the store and what it cost."""

    reference: str
    seconds: float
    output: str


def build_image(tag: str, podman: Podman | None = None,
                containerfile: Path = CONTAINERFILE) -> Built:
    """
    Build C{containerfile} from the repository root as C{REPOSITORY:tag},
    on the bases made from Debian's packages, with this machine's pip
    configuration and CA bundle as the build's secrets.  Fails with the
    build's output when podman does.
    """
    podman = podman or Podman.cached()
    with _locked(cache_dir() / "build.lock"):
        run_base = debian_base(RUN_BASE, podman)
        build_base = debian_base(BUILD_BASE, podman)
        pip_conf, cert = host_pip_configuration()
        reference = f"{REPOSITORY}:{tag}"
        with tempfile.TemporaryDirectory(prefix="hostpid-image-") as secrets:
            conf = Path(secrets) / "pip.conf"
            conf.write_text(pip_conf)
            argv = [
                "build", "--isolation", "chroot", "--pull=never", "--layers",
                "--file", str(containerfile),
                "--build-arg", f"BASE={run_base}", "--build-arg", f"BUILD_BASE={build_base}",
                "--secret", f"id=pipconf,src={conf}",
                *(["--secret", f"id=cacert,src={cert}"] if cert else []),
                "--label", f"{TAG_LABEL}={tag}",
                "--tag", reference, str(REPO),
            ]
            started = time.monotonic()
            result = podman.run(*argv, timeout=BUILD_TIMEOUT, check=False)
            seconds = time.monotonic() - started
        output = result.stdout + result.stderr
        if result.returncode != 0:
            raise AssertionError(
                f"podman build of {containerfile.relative_to(REPO)} exited "
                f"{result.returncode}:\n{output[-6000:]}")
        return Built(reference, seconds, output)


def project_image(tag: str = DEFAULT_TAG) -> Path:
    """
    A C{docker-archive} tarball of the project's image as
    C{REPOSITORY:tag} (what the chart's C{image.repository} and C{tag}
    name), built from this tree if no archive of it exists yet; for
    C{ctr -n k8s.io images import --platform linux/amd64 PATH}.  Cached per
    source-tree hash and tag (see the module's docstring); fails (skips
    outside CI) with the reason when podman, mmdebstrap or Debian's archive
    is missing.
    """
    podman = Podman.cached()
    line = _source_line(SUITE)
    digest = source_hash([RUN_BASE.reference(line), BUILD_BASE.reference(line)])
    archive = cache_dir() / "archives" / digest / f"{tag}.tar"
    if archive.is_file():
        return archive
    with _locked(cache_dir() / "archive.lock"):
        if archive.is_file():
            return archive
        built = build_image(tag, podman)
        archive.parent.mkdir(parents=True, exist_ok=True)
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        podman.run("save", "--format", "docker-archive", "--output", str(partial),
                   built.reference, timeout=BUILD_TIMEOUT)
        partial.rename(archive)
        _prune_archives(keep=archive.parent)
    return archive


#: Archives of other trees older than this are removed when a new one is written.
ARCHIVES_MAX_AGE = 6 * 3600.0


def _prune_archives(keep: Path) -> None:
    """
    Remove the archives of other source trees not written for a while: one
    tree's pair is about 0.4 GB, and every change to the tree makes a new
    pair (podman's store keeps the layers, so a rebuild stays cheap).  A
    recent one is kept: another run on another tree may be importing it.
    """
    now = time.time()
    for directory in keep.parent.iterdir():
        if directory == keep or not directory.is_dir():
            continue
        if now - directory.stat().st_mtime > ARCHIVES_MAX_AGE:
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()


def image_size(reference: str, podman: Podman | None = None) -> int:
    """The image's size in bytes, as podman reports it (its layers, uncompressed)."""
    podman = podman or Podman.cached()
    return int(podman.run("image", "inspect", "--format", "{{.Size}}", reference).stdout)
