"""
The annotation form of C{hostpid allocate --cdi --cdi-annotations} against
the CDI project's own Go library, the code containerd and
CRI-O run for a kubelet older than 1.29: Debian's source of it (the package
that also ships the JSON schema), built here in GOPATH mode into a small
program (C{cdigo/main.go}).

Two questions, each answered by the library and compared with ours:
  - the key and value that C{UpdateAnnotations} makes (or refuses) for a
    plugin name, device ID and device list, which L{cdi.annotation_key} and
    L{cdi.annotation_value} must make (or refuse) alike;
  - what a runtime does with the annotations C{hostpid allocate} emitted:
    C{ParseAnnotations} names the device, and C{InjectDevices} from the spec
    directory C{hostpid cdi} wrote gives an empty OCI spec the gate and the
    canonical mounts, in order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import hostpid_argv, require_root, require_tool, subprocess_env

from hostpid import defaults
from hostpid.gate import GATE_ENV
from hostpid.node import cdi

pytestmark = pytest.mark.privileged

#: Where Debian installs Go sources, the CDI library's among them.
GOPATH = "/usr/share/gocode"
CDI_PACKAGE = "github.com/container-orchestrated-devices/container-device-interface/pkg/cdi"
PROGRAM = Path(__file__).parent / "cdigo" / "main.go"


@pytest.fixture(scope="module")
def cdigo() -> Iterator[Path]:
    """The program, built against Debian's CDI library (offline, GOPATH mode)."""
    go = require_tool("go")
    assert (Path(GOPATH) / "src" / CDI_PACKAGE).is_dir(), (
        "the CDI library's Go source: golang-github-container-orchestrated-devices-"
        "container-device-interface-dev (installed by .ci/run)"
    )
    build = Path(tempfile.mkdtemp(prefix="hostpid-cdigo-"))
    try:
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(build),
               "GOPATH": GOPATH, "GO111MODULE": "off", "GOFLAGS": "",
               "GOCACHE": str(build / "cache"), "CGO_ENABLED": "0"}
        binary = build / "cdigo"
        built = subprocess.run([go, "build", "-o", str(binary), str(PROGRAM)], env=env,
                               capture_output=True, text=True, timeout=600, check=False)
        assert built.returncode == 0, built.stderr
        yield binary
    finally:
        shutil.rmtree(build, ignore_errors=True)


def ask(cdigo: Path, **request: Any) -> dict[str, Any]:
    done = subprocess.run([str(cdigo)], input=json.dumps(request), capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def ours(plugin: str, device_id: str, devices: list[str]) -> dict[str, str] | None:
    try:
        return {cdi.annotation_key(plugin, device_id): cdi.annotation_value(devices)}
    except cdi.CdiSpecError:
        return None


KEY_CASES = [
    (cdi.ANNOTATION_PLUGIN, "broker", [f"{cdi.KIND}=broker"]),
    (cdi.ANNOTATION_PLUGIN, "lock-parent", [f"{cdi.KIND}=lock-parent"]),
    (cdi.ANNOTATION_PLUGIN, "gpu/0", [f"{cdi.KIND}=broker", "nvidia.com/gpu=0"]),
    ("nvidia", "GPU-1.a_b", ["nvidia.com/gpu=GPU-1"]),
    ("p", "d", ["vendor.example/class=dev.1:x"]),
    ("", "broker", [f"{cdi.KIND}=broker"]),
    (cdi.ANNOTATION_PLUGIN, "", [f"{cdi.KIND}=broker"]),
    (cdi.ANNOTATION_PLUGIN, "x" * 63, [f"{cdi.KIND}=broker"]),
    ("x" * 31, "y" * 31, [f"{cdi.KIND}=broker"]),
    ("x" * 32, "y" * 31, [f"{cdi.KIND}=broker"]),
    ("-p", "d", [f"{cdi.KIND}=broker"]),
    ("p", "d-", [f"{cdi.KIND}=broker"]),
    ("p", "a b", [f"{cdi.KIND}=broker"]),
    ("p", "d", [cdi.KIND]),
    ("p", "d", ["hostpid=broker"]),
    ("p", "d", [f"{cdi.KIND}=bro ker"]),
    ("p", "d", [f"{cdi.KIND}="]),
    ("p", "d", ["-hami.io/hostpid=broker"]),
    ("p", "d", []),
]


def test_annotation_keys_and_values_are_the_librarys(cdigo: Path) -> None:
    """
    For every case, valid or not, ours and the library's agree: the same
    key and value, or both refuse.  (An empty device list is an empty value
    to both; C{hostpid allocate} never emits one.)
    """
    answer = ask(cdigo, keys=[{"plugin": p, "deviceID": d, "devices": v}
                              for p, d, v in KEY_CASES])
    seen = []
    for (plugin, device_id, devices), theirs in zip(KEY_CASES, answer["keys"], strict=True):
        expected = None if theirs["error"] else theirs["annotations"]
        seen.append(expected is not None)
        assert ours(plugin, device_id, devices) == expected, (plugin, device_id, devices,
                                                               theirs["error"])
    assert any(seen) and not all(seen), "the cases cover both answers"


@pytest.fixture
def node(public_tmp: Path) -> Path:
    require_root()
    return public_tmp


def hostpid(node: Path, gate: str, *args: str, request: Any = None) -> str:
    env = subprocess_env()
    env[GATE_ENV] = gate
    done = subprocess.run(
        hostpid_argv(*args, "--lock-parent", str(node / "vgpulock"),
                     "--broker-dir", str(node / "hostpid")),
        input=None if request is None else json.dumps(request),
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(("gate", "device"), [("1", "broker"), ("0", "lock-parent")])
def test_a_runtime_injects_what_the_annotations_name(
    cdigo: Path, node: Path, gate: str, device: str
) -> None:
    """
    The runtime's path for kubelets before 1.29: the annotations of an
    allocation response name our device, and injecting it from the spec
    directory gives the container the gate (broker on) and the canonical
    mounts, lock parent first, the broker directory read-only.
    """
    (node / "hostpid").mkdir(mode=0o755)
    hostpid(node, gate, "cdi", "--dir", str(node / "cdi"))
    response = json.loads(hostpid(
        node, gate, "allocate", "--cdi", "--cdi-annotations",
        request={"envs": {"A": "b"}, "annotations": {"cdi.k8s.io/nvidia_gpu0": "nvidia.com/gpu=0"}},
    ))
    annotations = response["annotations"]
    assert set(annotations) == {"cdi.k8s.io/nvidia_gpu0", f"cdi.k8s.io/hami.io.hostpid_{device}"}
    ours_only = {k: v for k, v in annotations.items() if "hostpid" in k}

    answer = ask(cdigo, annotations=ours_only, specDir=str(node / "cdi"))["injected"]
    assert answer["error"] == "" and not answer["specErrors"], answer
    assert answer["devices"] == [f"{cdi.KIND}={device}"]
    assert not answer["unknown"]
    if gate == "1":
        assert answer["env"] == [f"{GATE_ENV}=1"]
    else:
        assert not answer["env"], "the gate is not set by a gate-off spec"
    mounts = [(m["source"], m["destination"], "ro" in m["options"]) for m in answer["mounts"]]
    expected = [(str(node / "vgpulock"), defaults.LOCK_PARENT, False)]
    if gate == "1":
        expected.append((str(node / "hostpid"), defaults.CONTAINER_BROKER_DIRECTORY, True))
    assert mounts == expected
    for m in answer["mounts"]:
        assert {"rbind", "nosuid", "nodev"} <= set(m["options"]), m

    # The whole response's annotations, a GPU plugin's among them, parse too.
    everything = ask(cdigo, annotations=annotations)["injected"]
    assert everything["error"] == ""
    assert sorted(everything["devices"]) == sorted(["nvidia.com/gpu=0", f"{cdi.KIND}={device}"])
