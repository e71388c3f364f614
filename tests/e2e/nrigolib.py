"""
NRI's own Go code, built offline for the tests: C{nrigo} (the runtime side,
C{pkg/adaptation}, driving a plugin) and C{nristub} (a control plugin on
C{pkg/stub}).

Debian packages NRI (C{golang-github-containerd-nri-dev}: 0.6.1 in trixie,
0.8.0 in forky) but bookworm does not, so the sources are fetched the way
the CRI test fetches containerd (L{crilib.unpacked_package}: a private apt
configuration for the other suite, C{apt-get download}, C{dpkg-deb -x},
cached) and put first on a GOPATH whose rest is bookworm's own
C{/usr/share/gocode} (grpc, genproto, gogo protobuf, protobuf, logrus,
x/sys, the OCI runtime spec and tools, sigs.k8s.io/yaml, moby/sys: the
packages C{.ci/run} installs).  What bookworm lacks or has too old comes
from the NRI release's own suite: ttrpc (bookworm's 1.1 predates the
message-size error NRI 0.8 names), containerd/log (ttrpc 1.2.7 logs
through it) and the CRI API (NRI's C{pkg/api} converts its resources).
Built in GOPATH mode with bookworm's Go 1.19, nothing downloaded by Go.

Debian builds each containerd against its own suite's NRI, so the two
releases are the runtime sides of the two containerds the end-to-end tests
run: trixie's 1.7.24 links NRI 0.6.1, forky's 2.1.9 links 0.8.0 (its
binary names ttrpc's C{OversizedMessageErr}, which 0.6.1's ttrpc lacks).

Go's build cache is kept beside the fetched packages (content-addressed,
safe to share between runs and builds): the two releases share most of
their dependencies, and a second session builds in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import attrs
from crilib import unpacked_package
from support import require_tool

HERE = Path(__file__).resolve().parent

#: Where Debian installs Go sources.
SYSTEM_GOPATH = Path("/usr/share/gocode")


@attrs.frozen
class NriRelease:
    """One Debian release of NRI's Go code and the sources its build needs beside bookworm's."""

    name: str
    suite: str
    packages: tuple[str, ...]


NRI_RELEASES = {
    "0.6.1": NriRelease("0.6.1", "trixie", (
        "golang-github-containerd-nri-dev", "golang-github-containerd-ttrpc-dev",
        "golang-github-kubernetes-cri-api-dev")),
    "0.8.0": NriRelease("0.8.0", "forky", (
        "golang-github-containerd-nri-dev", "golang-github-containerd-ttrpc-dev",
        "golang-github-containerd-log-dev", "golang-github-kubernetes-cri-api-dev")),
}

#: The cri-api sources come from trixie for both (forky's is newer than Go 1.19 builds).
CRI_API_SUITE = "trixie"


def gopath(release: NriRelease) -> str:
    parts = []
    for package in release.packages:
        cri_api = package == "golang-github-kubernetes-cri-api-dev"
        suite = CRI_API_SUITE if cri_api else release.suite
        parts.append(str(unpacked_package(suite, package) / "usr" / "share" / "gocode"))
    parts.append(str(SYSTEM_GOPATH))
    return ":".join(parts)


@attrs.frozen
class NriPrograms:
    """The two programs built against one NRI release."""

    release: NriRelease
    nrigo: Path
    nristub: Path


def build(release: NriRelease, out: Path) -> NriPrograms:
    """Build both programs into C{out}, offline (GOPATH mode, no module downloads)."""
    from kernels import debian

    go = require_tool("go")
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(out),
           "GOPATH": gopath(release), "GO111MODULE": "off", "GOFLAGS": "", "GOPROXY": "off",
           "GOCACHE": str(debian.CACHE / "gocache"), "CGO_ENABLED": "0"}
    built = {}
    for name in ("nrigo", "nristub"):
        binary = out / name
        done = subprocess.run([go, "build", "-o", str(binary), str(HERE / name / "main.go")],
                              env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        assert done.returncode == 0, (release, name, done.stderr)
        built[name] = binary
    return NriPrograms(release, built["nrigo"], built["nristub"])


def kv(pairs: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in pairs.items()]


def nri_pod(name: str, uid: str, namespace: str = "default",
            labels: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """An NRI C{PodSandbox} (protobuf JSON), as containerd fills it from the sandbox's config."""
    return {"id": f"sandbox-{uid[:8]}", "name": name, "uid": uid, "namespace": namespace,
            "labels": labels or {}, "annotations": annotations or {}}


def nri_container(name: str, pod: dict[str, Any], *, env: dict[str, str] | None = None,
                  mounts: Sequence[tuple[str, str, Sequence[str]]] = (),
                  devices: Sequence[str] = (), annotations: dict[str, str] | None = None,
                  ) -> dict[str, Any]:
    """
    An NRI C{Container} (protobuf JSON) as containerd makes it at
    CreateContainer from the OCI spec it generated: env as C{KEY=VALUE}
    strings, mounts with their options, device nodes under C{linux.devices}.
    """
    container: dict[str, Any] = {
        "id": f"ctr-{name}-{pod['uid'][:8]}", "podSandboxId": pod["id"], "name": name,
        "state": "CONTAINER_CREATED", "annotations": annotations or {},
        "args": ["/bin/sh"], "env": [f"{k}={v}" for k, v in (env or {}).items()],
        "mounts": [{"destination": d, "source": s, "type": "bind", "options": list(o)}
                   for d, s, o in mounts],
    }
    if devices:
        container["linux"] = {"devices": [
            {"path": path, "type": "c", "major": "195", "minor": str(minor),
             "fileMode": {"value": 0o666}, "uid": {"value": 0}, "gid": {"value": 0}}
            for minor, path in enumerate(devices)]}
    return container


@attrs.frozen
class Driven:
    """What nrigo answered: the synchronize outcome and one response per case."""

    answer: dict[str, Any]
    stderr: str

    @property
    def cases(self) -> list[dict[str, Any]]:
        cases: list[dict[str, Any]] = self.answer["cases"]
        return cases

    def adjustment(self, index: int) -> dict[str, Any]:
        """
        The merged adjustment of case C{index}, without the empty parts the
        runtime side fills in before any plugin answers (C{hooks: {}},
        C{linux.resources.memory: {}}...).
        """
        case = self.cases[index]
        assert case["error"] == "", (case, self.stderr)
        adjust: dict[str, Any] = pruned((case["response"] or {}).get("adjust", {})) or {}
        return adjust


def pruned(value: Any) -> Any:
    """C{value} without empty objects and lists, recursively (None when nothing is left)."""
    if isinstance(value, dict):
        kept = {k: v for k, v in ((k, pruned(v)) for k, v in value.items()) if v is not None}
        return kept or None
    if isinstance(value, list):
        return [pruned(v) if isinstance(v, dict | list) else v for v in value] or None
    return value


@contextmanager
def plugin_process(argv: Sequence[str], env: dict[str, str] | None = None,
                   log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A plugin process, terminated (then killed) at the end."""
    output = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=output,
                               stderr=subprocess.STDOUT, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if log:
            output.close()  # type: ignore[union-attr]


@attrs.frozen
class PluginRun:
    """A plugin process to start once the runtime side listens."""

    argv: Sequence[str]
    env: dict[str, str] | None = None
    log: Path | None = None


def drive(programs: NriPrograms, plugins: Sequence[PluginRun], request: dict[str, Any],
          socket: Path, timeout: float = 120.0) -> Driven:
    """
    Run nrigo on C{socket}, start the plugins once it listens, and return
    nrigo's answer once every plugin has registered and every case has been
    sent (the plugins are stopped then).
    """
    document = {"socket": str(socket), "plugins": len(plugins), "waitSeconds": 30, **request}
    with tempfile.TemporaryFile() as stdin:
        stdin.write(json.dumps(document).encode())
        stdin.seek(0)
        runtime = subprocess.Popen([str(programs.nrigo)], stdin=stdin, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
    try:
        assert runtime.stdout is not None
        # nrigo prints this line once it listens, or exits (EOF) if it cannot.
        first = runtime.stdout.readline()
        assert json.loads(first or b"null") == {"listening": str(socket)}, (
            first, runtime.stderr.read() if runtime.stderr else "")
        with ExitStack() as stack:
            for plugin in plugins:
                stack.enter_context(plugin_process(plugin.argv, plugin.env, plugin.log))
            out, err = runtime.communicate(timeout=timeout)
    finally:
        if runtime.poll() is None:
            runtime.kill()
            runtime.wait()
    assert runtime.returncode == 0, err.decode(errors="replace")
    return Driven(json.loads(out), err.decode(errors="replace"))
