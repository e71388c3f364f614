"""
The CDI spec, its annotation form, and C{hostpid allocate --cdi}.

The spec is checked field by field, against the CDI project's own JSON schema
(read from the Debian package, see L{cdischema}), and against the rules the
CDI library applies when a runtime loads it; each rule has a case that breaks
it, so a passing check means something.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cdischema import schema_errors
from support import hostpid_argv, require_root, subprocess_env

from hostpid.gate import GATE_ENV
from hostpid.node import cdi
from hostpid.node.allocation import AllocateResponse, Mount, canonical_mounts

LOCK_PARENT = "/host/tmp/vgpulock"
BROKER_DIR = "/host/run/hami/hostpid"


def rw(host: str, container: str) -> dict[str, Any]:
    return {"hostPath": host, "containerPath": container,
            "options": ["rbind", "rw", "nosuid", "nodev", "noexec"], "type": "bind"}


def ro(host: str, container: str) -> dict[str, Any]:
    return {"hostPath": host, "containerPath": container,
            "options": ["rbind", "ro", "nosuid", "nodev", "noexec"], "type": "bind"}


def spec(enabled: bool, version: str = cdi.DEFAULT_VERSION) -> dict[str, Any]:
    return cdi.build_spec(broker_enabled=enabled, lock_parent=LOCK_PARENT,
                          broker_directory=BROKER_DIR, version=version)


# The spec, every field -------------------------------------------------------


def test_gate_on_spec_every_field() -> None:
    assert spec(True) == {
        "cdiVersion": "0.5.0",
        "kind": "hami.io/hostpid",
        "devices": [
            {"name": "broker", "containerEdits": {
                "env": ["LIBVGPU_HOSTPID_BROKER=1"],
                "mounts": [rw(LOCK_PARENT, "/tmp/vgpulock"),
                           ro(BROKER_DIR, "/tmp/vgpulock/hostpid")],
            }},
            {"name": "lock-parent", "containerEdits": {
                "mounts": [rw(LOCK_PARENT, "/tmp/vgpulock")],
            }},
        ],
    }


def test_gate_off_broker_device_carries_the_lock_parent_only() -> None:
    """A cached allocation naming C{broker} still resolves, to the fallback's mounts."""
    assert spec(False) == {
        "cdiVersion": "0.5.0",
        "kind": "hami.io/hostpid",
        "devices": [
            {"name": "broker", "containerEdits": {"mounts": [rw(LOCK_PARENT, "/tmp/vgpulock")]}},
            {"name": "lock-parent",
             "containerEdits": {"mounts": [rw(LOCK_PARENT, "/tmp/vgpulock")]}},
        ],
    }


def test_defaults_are_the_contract_paths() -> None:
    built = cdi.build_spec(broker_enabled=True)
    mounts = built["devices"][0]["containerEdits"]["mounts"]
    assert [(m["hostPath"], m["containerPath"]) for m in mounts] == [
        ("/tmp/vgpulock", "/tmp/vgpulock"), ("/var/run/hami/hostpid", "/tmp/vgpulock/hostpid")]
    assert cdi.SPEC_FILE_NAME == "hami.io-hostpid.json"
    assert cdi.DEFAULT_SPEC_DIRECTORY == "/var/run/cdi"
    assert cdi.qualified_name("broker") == "hami.io/hostpid=broker"


@pytest.mark.parametrize("enabled", [True, False])
def test_mounts_are_the_raw_allocation_mounts(enabled: bool) -> None:
    """One source of truth: the CDI edits and the raw-mount patch agree."""
    (broker, _) = spec(enabled)["devices"]
    ours = [(m["containerPath"], m["hostPath"], "ro" in m["options"])
            for m in broker["containerEdits"]["mounts"]]
    raw = [(m.container_path, m.host_path, m.read_only)
           for m in canonical_mounts(enabled, LOCK_PARENT, BROKER_DIR)]
    assert ours == raw


def test_listed_order_is_the_order_after_the_cdi_librarys_depth_sort() -> None:
    """The CDI library sorts mounts by path depth; ours are already in that order."""
    mounts = spec(True)["devices"][0]["containerEdits"]["mounts"]
    targets = [m["containerPath"] for m in mounts]
    assert sorted(targets, key=lambda p: (p.count("/"), p)) == targets


@pytest.mark.parametrize("version", cdi.SUPPORTED_VERSIONS)
@pytest.mark.parametrize("enabled", [True, False])
def test_spec_validates_against_the_cdi_schema(enabled: bool, version: str) -> None:
    built = spec(enabled, version)
    assert built["cdiVersion"] == version
    assert schema_errors(built) == []
    # What is written is what validates.
    assert schema_errors(json.loads(cdi.spec_to_json(built))) == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.pop("kind"),
        lambda s: s["devices"][0].pop("containerEdits"),
        lambda s: s["devices"][0]["containerEdits"]["mounts"][0].pop("hostPath"),
        lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(options="rbind"),
    ],
)
def test_schema_check_can_fail(damage: Callable[[dict[str, Any]], object]) -> None:
    broken = copy.deepcopy(spec(True))
    damage(broken)
    assert schema_errors(broken) != []


# Versions --------------------------------------------------------------------


def test_supported_versions() -> None:
    assert cdi.DEFAULT_VERSION in cdi.SUPPORTED_VERSIONS
    assert cdi.SUPPORTED_VERSIONS[0] == "0.4.0"


@pytest.mark.parametrize("version", ["0.1.0", "0.2.0", "0.3.0"])
def test_version_without_mount_type_is_refused(version: str) -> None:
    with pytest.raises(cdi.CdiSpecError, match=f"cdiVersion {version} cannot express the "
                       r"edits: the mount type \(bind\) needs CDI 0.4.0 or newer"):
        spec(True, version)


@pytest.mark.parametrize("version", ["0.9.0", "v0.5.0", "0.5", "", "2.0.0"])
def test_unreleased_version_is_refused(version: str) -> None:
    with pytest.raises(cdi.CdiSpecError, match="not a released CDI specification version"):
        spec(False, version)


# Our own validation, beyond the schema ---------------------------------------


def _edits(s: dict[str, Any]) -> dict[str, Any]:
    edits: dict[str, Any] = s["devices"][0]["containerEdits"]
    return edits


BROKEN_SPECS: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "wrong kind": (lambda s: s.update(kind="hami.io/other"), "spec.kind must be"),
    "unknown top-level field": (lambda s: s.update(kindShort=["x"]), "unknown field"),
    "unknown mount field": (lambda s: _edits(s)["mounts"][0].update(readOnly=True),
                            "unknown field"),
    "device name with a slash": (lambda s: s["devices"][0].update(name="bro/ker"),
                                 "has a character other than"),
    "device name ending in a dash": (lambda s: s["devices"][0].update(name="broker-"),
                                     "must start and end"),
    "duplicate device": (lambda s: s["devices"].append(copy.deepcopy(s["devices"][0])),
                         "a device name repeats"),
    "env without =": (lambda s: _edits(s).update(env=["LIBVGPU_HOSTPID_BROKER"]),
                      "is not KEY=VALUE"),
    "env with an empty key": (lambda s: _edits(s).update(env=["=1"]), "is not KEY=VALUE"),
    "env with a bad key": (lambda s: _edits(s).update(env=["A B=1"]),
                           "is not a valid variable name"),
    "relative container path": (
        lambda s: _edits(s)["mounts"][1].update(containerPath="tmp/vgpulock/hostpid"),
        "must be an absolute path"),
    "unclean container path": (
        lambda s: _edits(s)["mounts"][1].update(containerPath="/tmp/vgpulock//hostpid/"),
        "must be clean"),
    "relative host path": (lambda s: _edits(s)["mounts"][0].update(hostPath="vgpulock"),
                           "must be an absolute path"),
    "both rw and ro": (lambda s: _edits(s)["mounts"][1]["options"].append("rw"),
                       "exactly one of 'rw' and 'ro'"),
    "neither rw nor ro": (lambda s: _edits(s)["mounts"][1]["options"].remove("ro"),
                          "exactly one of 'rw' and 'ro'"),
    "not a bind": (lambda s: _edits(s)["mounts"][0]["options"].remove("rbind"),
                   "must hold 'rbind'"),
    "no mount type": (lambda s: _edits(s)["mounts"][0].pop("type"), "type must be 'bind'"),
    "child before parent": (lambda s: _edits(s)["mounts"].reverse(), "parents come first"),
    "empty device edits": (lambda s: s["devices"][1].update(containerEdits={}),
                           "must not be empty"),
    "old version": (lambda s: s.update(cdiVersion="0.3.0"), "cannot express the edits"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_SPECS))
def test_validation_refuses(case: str) -> None:
    damage, expected = BROKEN_SPECS[case]
    broken = copy.deepcopy(spec(True))
    damage(broken)
    with pytest.raises(cdi.CdiSpecError, match=expected):
        cdi.validate_spec(broken)


def test_build_refuses_a_relative_broker_directory() -> None:
    with pytest.raises(cdi.CdiSpecError, match="run/hami/hostpid: the broker directory must "
                       "be an absolute, clean path"):
        cdi.build_spec(broker_enabled=True, broker_directory="run/hami/hostpid")
    with pytest.raises(cdi.CdiSpecError, match="the lock parent must"):
        cdi.build_spec(broker_enabled=True, lock_parent="/tmp/vgpulock/")


# The annotation form (kubelets before 1.29) ----------------------------------


@pytest.mark.parametrize(
    ("plugin", "device_id", "key"),
    [
        ("hami.io.hostpid", "broker", "cdi.k8s.io/hami.io.hostpid_broker"),
        ("vendor.class", "a/b/c", "cdi.k8s.io/vendor.class_a_b_c"),
        ("p", "x" * 61, "cdi.k8s.io/p_" + "x" * 61),  # 63 characters: the limit
    ],
)
def test_annotation_key(plugin: str, device_id: str, key: str) -> None:
    assert cdi.annotation_key(plugin, device_id) == key


@pytest.mark.parametrize(
    ("plugin", "device_id", "expected"),
    [
        ("", "x", "plugin name, empty"),
        ("p", "", "deviceID, empty"),
        ("p", "x" * 62, "too long"),
        ("-p", "x", "first character"),
        ("p", "x-", "last character"),
        ("p", "a=b", "a character other than"),
        ("p", "a b", "a character other than"),
    ],
)
def test_annotation_key_refuses(plugin: str, device_id: str, expected: str) -> None:
    with pytest.raises(cdi.CdiSpecError, match=expected):
        cdi.annotation_key(plugin, device_id)


def test_annotation_value() -> None:
    assert cdi.annotation_value(["hami.io/hostpid=broker", "nvidia.com/gpu=0"]) == (
        "hami.io/hostpid=broker,nvidia.com/gpu=0")
    for bad in ["broker", "hami.io/hostpid", "/hostpid=broker", "hami.io/host.pid=broker",
                "1ami.io/hostpid=broker", "hami.io/hostpid=broker!"]:
        with pytest.raises(cdi.CdiSpecError):
            cdi.annotation_value([bad])


# patch_response_cdi ----------------------------------------------------------


def cdi_patched(response: AllocateResponse, enabled: bool, annotate: bool = False
                ) -> AllocateResponse:
    result = cdi.patch_response_cdi(response, broker_enabled=enabled, annotate=annotate)
    again = cdi.patch_response_cdi(result, broker_enabled=enabled, annotate=annotate)
    assert again == result, "not idempotent"
    return result


STALE = AllocateResponse(
    envs={GATE_ENV: "1", "NVIDIA_VISIBLE_DEVICES": "0"},
    mounts=(
        Mount("/usr/lib/libvgpu.so", "/host/libvgpu.so", True),
        Mount("/tmp/vgpulock", "/old", False),
        Mount("//tmp/vgpulock/hostpid/", "/elsewhere", False),
        Mount("/tmp/vgpulock/hostpid/broker.sock", "/evil.sock", False),
        Mount("/tmp/vgpulock/other", "/kept", False),
    ),
    annotations={"cdi.k8s.io/hami.io.hostpid_lock-parent": "hami.io/hostpid=lock-parent",
                 "cdi.k8s.io/nvidia_gpu0": "nvidia.com/gpu=0"},
    extra={"cdiDevices": [{"name": "nvidia.com/gpu=0"}, {"name": "hami.io/hostpid=broker"}]},
)


@pytest.mark.parametrize(("enabled", "device"), [(True, "broker"), (False, "lock-parent")])
def test_cdi_devices_name_the_gate_device(enabled: bool, device: str) -> None:
    result = cdi_patched(STALE, enabled)
    assert result.extra["cdiDevices"] == [{"name": "nvidia.com/gpu=0"},
                                          {"name": f"hami.io/hostpid={device}"}]
    # The reserved key is cleared and not set: the device's edits carry it.
    assert result.envs == {"NVIDIA_VISIBLE_DEVICES": "0"}
    # Reserved mounts removed, the others kept in order; ours are not added.
    assert [m.container_path for m in result.mounts] == ["/usr/lib/libvgpu.so",
                                                         "/tmp/vgpulock/other"]
    # Without the option, our stale annotation is cleared and no new one added.
    assert result.annotations == {"cdi.k8s.io/nvidia_gpu0": "nvidia.com/gpu=0"}


@pytest.mark.parametrize(("enabled", "device"), [(True, "broker"), (False, "lock-parent")])
def test_cdi_annotation_option(enabled: bool, device: str) -> None:
    result = cdi_patched(STALE, enabled, annotate=True)
    assert result.annotations == {
        "cdi.k8s.io/nvidia_gpu0": "nvidia.com/gpu=0",
        f"cdi.k8s.io/hami.io.hostpid_{device}": f"hami.io/hostpid={device}",
    }


def test_cdi_devices_of_the_wrong_shape_are_refused() -> None:
    for bad in ({"name": "x"}, [{"nam": "x"}], ["hami.io/hostpid=broker"], [{"name": 1}]):
        with pytest.raises(cdi.CdiSpecError, match="cdiDevices"):
            cdi.patch_response_cdi(AllocateResponse(extra={"cdiDevices": bad}),
                                   broker_enabled=True)


# hostpid allocate --cdi, the real command -------------------------------------


def run_allocate(lock_parent: Path, gate: str, request: Any, *options: str
                 ) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    env[GATE_ENV] = gate
    return subprocess.run(
        hostpid_argv("allocate", "--cdi", *options, "--lock-parent", str(lock_parent)),
        input=request if isinstance(request, str) else json.dumps(request),
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )


REQUEST = {
    "envs": {GATE_ENV: "0", "A": "b"},
    "mounts": [{"container_path": "/tmp/vgpulock/hostpid", "host_path": "/x",
                "read_only": False},
               {"container_path": "/data", "host_path": "/srv/data", "read_only": True}],
    "cdi_devices": [{"name": "nvidia.com/gpu=GPU-1"}],
}


@pytest.mark.parametrize(("gate", "device"), [("1", "broker"), ("0", "lock-parent"),
                                              ("true", "lock-parent")])
def test_allocate_cdi_command(public_tmp: Path, gate: str, device: str) -> None:
    require_root()
    lock_parent = public_tmp / "vgpulock"
    result = run_allocate(lock_parent, gate, REQUEST)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "envs": {"A": "b"},
        "mounts": [{"containerPath": "/data", "hostPath": "/srv/data", "readOnly": True}],
        "devices": [],
        "annotations": {},
        "cdiDevices": [{"name": "nvidia.com/gpu=GPU-1"}, {"name": f"hami.io/hostpid={device}"}],
    }
    # The lock parent is prepared as for raw mounts (a CDI runtime creates no host path).
    st = os.lstat(lock_parent)
    assert (st.st_uid, stat.S_IMODE(st.st_mode), stat.S_ISDIR(st.st_mode)) == (0, 0o1777, True)
    assert (lock_parent / "hostpid").is_dir() == (gate == "1")


def test_allocate_cdi_annotations_command(public_tmp: Path) -> None:
    require_root()
    result = run_allocate(public_tmp / "vgpulock", "1", REQUEST, "--cdi-annotations")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["annotations"] == {
        "cdi.k8s.io/hami.io.hostpid_broker": "hami.io/hostpid=broker"}


@pytest.mark.parametrize("request_text", ['{"cdiDevices": {"name": "x"}}', "{", "[]"])
def test_allocate_cdi_invalid_input_writes_nothing(public_tmp: Path, request_text: str) -> None:
    require_root()
    result = run_allocate(public_tmp / "vgpulock", "1", request_text)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("hostpid: ") and result.stderr.count("\n") == 1
    assert not (public_tmp / "vgpulock").exists(), "nothing prepared for an invalid request"


def test_allocate_cdi_unsafe_lock_parent_writes_nothing(public_tmp: Path) -> None:
    require_root()
    (public_tmp / "vgpulock").symlink_to("/etc")
    result = run_allocate(public_tmp / "vgpulock", "1", REQUEST)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "is a symlink" in result.stderr
