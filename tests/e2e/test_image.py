"""
The project's container image, built for real and run as the DaemonSet runs it.

C{deploy/container/Containerfile} is built by podman from the repository
root (L{imagelib.build_image}: its bases made from Debian's packages, since
no registry is reachable; pip in the build stage reaching PyPI with this
machine's pip configuration and CA bundle), as a user without Docker Hub
follows C{docs/image.md}.  Then, with the image:

- the broker runs as the shipped DaemonSet's container states it (its
  command and arguments, its securityContext: root with every capability
  dropped, no privilege escalation, a read-only root file system; the host's
  PID namespace; its volumes as private host directories), with the gate on
  as C{kubectl set env} would set it.  The DaemonSet's own exec probes pass
  in the container (C{hostpid probe}, the image's command), the broker
  answers this test process its own host PID through the socket it made in
  the host directory, and SIGTERM ends it with twistd's status 143 and the
  socket removed; the same probe then fails (it can fail);
- the other commands the image carries answer: the webhook's and the NRI
  plugin's twistd plugins (as the chart's other DaemonSet and Deployment
  run them), the NRI plugin's exec probe C{hostpid nri-probe}, and
  C{hostpid --version}; the image's C{/tmp}, which the NRI plugin's
  preparation walks above the lock parent it is given, is root's and sticky;
- the image holds no compiler and no pip (the runtime stage installs from
  wheels only);
- L{imagelib.project_image}, the Kubernetes tier's archive, names the image
  as the chart's values do, once per tag, the tags sharing their layers.

Build time and size are printed (C{-s}), for the report; a warm run reuses
the cached bases and podman's layer cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import imagelib
import pytest
import yaml
from kernelfeatures import kernel_feature
from support import REPO, ask_pid, require_root, wait_for

from hostpid import __version__

#: The NRI plugin gives a GPU container the broker only on a broker mountpoint it could make
#: immutable: where /tmp's filesystem has no such attribute, these tests say so by name.
pytestmark = [pytest.mark.privileged, pytest.mark.cap(1800), kernel_feature("immutable_tmp")]

DAEMONSET = REPO / "deploy" / "kubernetes" / "20-daemonset.yaml"
GATE = "LIBVGPU_HOSTPID_BROKER"

#: What a container needs on this machine (runc sets the image's default
#: rlimits, which the machine's hard limits refuse).
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")


@pytest.fixture(scope="module")
def podman() -> imagelib.Podman:
    require_root()
    return imagelib.Podman.cached()


@pytest.fixture(scope="module")
def image(podman: imagelib.Podman) -> str:
    """The image, built now from this tree (podman reuses unchanged layers)."""
    built = imagelib.build_image(imagelib.DEFAULT_TAG, podman)
    size = imagelib.image_size(built.reference, podman)
    cached = built.output.count("Using cache")
    print(f"\n[image] {built.reference}: built in {built.seconds:.1f}s "
          f"({cached} steps from the layer cache), {size / 1e6:.0f} MB")
    return built.reference


def broker_container() -> Mapping[str, Any]:
    """The shipped DaemonSet's broker container, and its pod spec."""
    for doc in yaml.safe_load_all(DAEMONSET.read_text()):
        if doc and doc.get("kind") == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            (container,) = [c for c in spec["containers"] if c["name"] == "broker"]
            return {"spec": spec, "container": container}
    raise AssertionError(f"no DaemonSet in {DAEMONSET}")


def security_options(context: Mapping[str, Any]) -> list[str]:
    """podman's spelling of the container's securityContext (the fields the DaemonSet sets)."""
    assert context["runAsUser"] == 0 and not context["privileged"]
    options = ["--user", f"{context['runAsUser']}:{context['runAsGroup']}"]
    options += [f"--cap-drop={cap.lower()}" for cap in context["capabilities"]["drop"]]
    assert "add" not in context["capabilities"]
    if context["allowPrivilegeEscalation"] is False:
        options += ["--security-opt", "no-new-privileges"]
    if context["readOnlyRootFilesystem"]:
        options += ["--read-only"]
    assert context["seccompProfile"]["type"] == "RuntimeDefault"  # podman's default profile
    return options


class RunningBroker:
    """The image's broker as a detached podman container (removed by L{close})."""

    def __init__(self, podman: imagelib.Podman, image: str, workdir: Path) -> None:
        self.podman = podman
        self.name = f"hostpid-image-test-{uuid.uuid4().hex[:8]}"
        shipped = broker_container()
        spec, container = shipped["spec"], shipped["container"]
        assert spec["hostPID"] is True
        # The volumes as private host directories: hostPaths, and the emptyDir.
        self.host_dirs: dict[str, Path] = {}
        for volume in spec["volumes"]:
            directory = workdir / volume["name"]
            directory.mkdir(mode=0o755)
            if volume.get("hostPath", {}).get("path") == "/tmp":
                directory.chmod(0o1777)
            self.host_dirs[volume["name"]] = directory
        mounts = [f"{self.host_dirs[m['name']]}:{m['mountPath']}"
                  for m in container["volumeMounts"]]
        env = {item["name"]: item["value"] for item in container["env"]}
        env[GATE] = "1"  # kubectl set env: the broker enabled
        self.container = container
        self.argv = [
            "run", "--detach", "--name", self.name, "--pid", "host", "--network", "none",
            *ULIMITS, *security_options(container["securityContext"]),
            *(option for mount in mounts for option in ("--volume", mount)),
            *(option for key, value in env.items() for option in ("--env", f"{key}={value}")),
            "--entrypoint", json.dumps(container["command"]),
            image, *container["args"],
        ]

    def start(self) -> None:
        self.podman.run(*self.argv)

    @property
    def socket(self) -> Path:
        return self.host_dirs["broker-dir"] / "broker.sock"

    def logs(self) -> str:
        result = self.podman.run("logs", self.name, check=False)
        return result.stdout + result.stderr

    def running(self) -> bool:
        state = self.podman.run("inspect", "--format", "{{.State.Running}}", self.name).stdout
        if state.strip() != "true":
            raise AssertionError(f"the broker container stopped:\n{self.logs()}")
        return True

    def exec(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return self.podman.run("exec", self.name, *argv, check=False)

    def stop(self) -> int:
        self.podman.run("stop", "--time", "10", self.name)
        return int(self.podman.run(
            "inspect", "--format", "{{.State.ExitCode}}", self.name).stdout)

    def close(self) -> None:
        self.podman.run("rm", "--force", self.name, check=False)


@pytest.fixture
def broker(podman: imagelib.Podman, image: str, tmp_path: Path) -> Iterator[RunningBroker]:
    running = RunningBroker(podman, image, tmp_path)
    try:
        running.start()
        yield running
    finally:
        running.close()


def run_in_image(podman: imagelib.Podman, image: str, entrypoint: str,
                 *argv: str, volumes: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    return podman.run(
        "run", "--rm", "--network", "none", *ULIMITS,
        *(option for volume in volumes for option in ("--volume", volume)),
        "--entrypoint", entrypoint, image, *argv, check=False,
    )


def passing(
    broker: RunningBroker, command: Sequence[str],
) -> Callable[[], subprocess.CompletedProcess[str] | None]:
    """A condition: C{command} run in the broker's container, when it passes."""
    def condition() -> subprocess.CompletedProcess[str] | None:
        result = broker.exec(command)
        return result if result.returncode == 0 else None
    return condition


def test_the_daemonsets_probes_pass_in_the_image_against_its_broker(
    broker: RunningBroker, podman: imagelib.Podman, image: str,
) -> None:
    """
    The DaemonSet's broker container, run from the image: it serves this
    process its own host PID; its liveness and readiness probes pass as the
    kubelet runs them (exec in the container); SIGTERM ends it with 143 and
    its socket gone; the probe then fails.
    """
    wait_for(lambda: broker.running() and broker.socket.exists(),
             "the image's broker to create its socket in the host directory", 60.0)
    wait_for(lambda: ask_pid(broker.socket) == os.getpid(),
             "the image's broker to answer this process its own host PID")
    for kind in ("livenessProbe", "readinessProbe"):
        result = wait_for(passing(broker, broker.container[kind]["exec"]["command"]),
                          f"the {kind} to pass")
        assert isinstance(result, subprocess.CompletedProcess)
        print(f"\n[image] {kind}: {result.stdout.strip()}")
        assert ": ok: answered PID" in result.stdout, result.stdout + result.stderr
        assert "(this process)" in result.stdout
    logs = broker.logs()
    assert "C helper _hostpid_native" in logs, logs
    assert "Unable to write to plugin cache" not in logs, "the read-only image has its cache"
    assert broker.stop() == 143, broker.logs()
    assert not broker.socket.exists()
    # The probe can fail: the same command, in a fresh container, with no broker.
    socket_dir = f"{broker.host_dirs['broker-dir']}:/var/run/hami/hostpid:ro"
    after = run_in_image(podman, image, "hostpid", "probe", "--socket",
                         "/var/run/hami/hostpid/broker.sock", volumes=[socket_dir])
    assert after.returncode == 1, after.stdout + after.stderr
    assert "/var/run/hami/hostpid/broker.sock" in after.stderr + after.stdout


@pytest.mark.parametrize(("plugin", "option"), [
    ("hostpid-broker", "--max-connections"),
    ("hostpid-webhook", "--endpoint"),
    ("hostpid-nri", "--nri-socket"),
])
def test_the_images_twistd_plugins_answer(
    podman: imagelib.Podman, image: str, plugin: str, option: str,
) -> None:
    result = run_in_image(podman, image, "twistd", plugin, "--help")
    assert result.returncode == 0, result.stdout + result.stderr
    assert option in result.stdout


def test_the_nri_plugins_view_above_the_lock_parent(
    podman: imagelib.Podman, image: str,
) -> None:
    """
    The chart's NRI pod mounts the lock parent alone at its host path
    (C{/tmp/vgpulock}); above it the plugin sees the image's own C{/tmp},
    which its preparation walks and must find root's and sticky (else every
    repair fails); and the image carries its exec probe, C{hostpid nri-probe}.
    """
    seen = run_in_image(podman, image, "stat", "-c", "%u %a", "/tmp")
    assert seen.stdout.split() == ["0", "1777"], seen.stdout + seen.stderr
    probe = run_in_image(podman, image, "hostpid", "nri-probe", "--address", "127.0.0.1:9398")
    assert probe.returncode == 1, probe.stdout + probe.stderr
    assert "127.0.0.1:9398/healthz" in probe.stderr, probe.stderr


def test_the_image_carries_the_command_and_no_build_tools(
    podman: imagelib.Podman, image: str,
) -> None:
    """C{hostpid} on PATH from the virtual environment; no compiler, no pip."""
    version = run_in_image(podman, image, "hostpid", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"hostpid {__version__}")
    where = run_in_image(podman, image, "/bin/sh", "-c",
                         "for c in hostpid twistd python; do command -v $c; done")
    assert where.stdout.split() == [f"/opt/hostpid/venv/bin/{name}"
                                    for name in ("hostpid", "twistd", "python")], where
    tools = run_in_image(podman, image, "/bin/sh", "-c",
                         "for c in gcc cc pip; do command -v $c; done; python -m pip --version")
    assert tools.stdout.strip() == "" and tools.returncode != 0, tools


#: Where the runtime stage installs the package (the image's Python is 3.11).
IMAGE_PACKAGE = "/opt/hostpid/venv/lib/python3.11/site-packages/hostpid"

#: Run in the image: each of the installed package's Python files and its
#: SHA-256, one a line.
DIGEST_SCRIPT = (
    "import hashlib, pathlib, sys\n"
    "root = pathlib.Path(sys.argv[1])\n"
    "for path in sorted(root.rglob('*.py')):\n"
    "    print(path.relative_to(root), hashlib.sha256(path.read_bytes()).hexdigest())\n"
)


def test_the_image_carries_this_trees_code(podman: imagelib.Podman, image: str) -> None:
    """
    Every Python file of the tree's C{hostpid} package is in the image as
    it is in the tree.  The runtime stage installs the wheels through
    C{RUN --mount=type=bind,from=build}, whose layer podman's cache reused
    whatever the build stage made (podman 4.3: the mounted stage's content
    is not in the step's cache key; containers/buildah#4522, podman#17119),
    so an image built after a change carried the code of the first build:
    the Kubernetes tier then ran an NRI plugin without C{nosuid,nodev,noexec}.
    """
    package = REPO / "hostpid"
    tree = {str(path.relative_to(package)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(package.rglob("*.py")) if "__pycache__" not in path.parts}
    result = run_in_image(podman, image, "python", "-c", DIGEST_SCRIPT, IMAGE_PACKAGE)
    assert result.returncode == 0, result.stdout + result.stderr
    installed = dict(line.split() for line in result.stdout.splitlines())
    differing = sorted(name for name, digest in tree.items() if installed.get(name) != digest)
    print(f"\n[image] {len(tree)} package files, {len(differing)} differing from the tree")
    assert differing == [], f"the image's copies differ from the tree's: {differing}"


def archive_names(archive: Path) -> tuple[list[str], str, list[str]]:
    """A docker-archive's tags, config and layers (its manifest.json)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("manifest.json")
        assert member is not None
        (manifest,) = json.load(member)
    return manifest["RepoTags"], manifest["Config"], manifest["Layers"]


def test_project_image_is_the_charts_image_once_per_tag() -> None:
    """
    The Kubernetes tier's archives: each named C{REPOSITORY:tag} as the
    chart's values name the image, a second call returns the same file, and
    the roll-forward tag is an image of its own (its config) on the same
    layers.
    """
    require_root()
    first = imagelib.project_image(imagelib.DEFAULT_TAG)
    assert imagelib.project_image(imagelib.DEFAULT_TAG) == first
    second = imagelib.project_image(imagelib.ROLL_FORWARD_TAG)
    tags, config, layers = archive_names(first)
    next_tags, next_config, next_layers = archive_names(second)
    assert tags == [f"{imagelib.REPOSITORY}:{imagelib.DEFAULT_TAG}"]
    assert next_tags == [f"{imagelib.REPOSITORY}:{imagelib.ROLL_FORWARD_TAG}"]
    assert config != next_config and layers == next_layers
    assert imagelib.REPOSITORY == yaml.safe_load(
        (REPO / "deploy" / "helm" / "hostpid-broker" / "values.yaml").read_text()
    )["image"]["repository"]
    print(f"\n[image] archives: {first} ({first.stat().st_size / 1e6:.0f} MB), {second}")
