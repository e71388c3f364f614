"""
The broker's container edits as a Container Device Interface (CDI) spec,
and the C{cdiDevices} form of an allocation response.

Everything here is pure: values in, values out, no files.  The writer
(L{hostpid.node.cdiwrite}) puts the spec on disk; a CDI runtime (containerd
with C{enable_cdi}, CRI-O, podman) applies it.

The spec has kind C{hami.io/hostpid} and two devices:

 - C{broker}: with the broker enabled, the gate C{LIBVGPU_HOSTPID_BROKER=1},
   the writable lock parent mount at C{/tmp/vgpulock} and the read-only
   broker mount at C{/tmp/vgpulock/hostpid}; with it disabled, the lock
   parent mount only.  A kubelet reuses a pod's allocation when a container
   restarts, so a container whose cached allocation names C{broker} must
   still start after the broker is turned off, and then take the fallback
   path: that is why the name stays and its edits shrink.
 - C{lock-parent}: the lock parent mount only, whatever the gate.

The mounts are L{hostpid.node.allocation.canonical_mounts}, so raw-mount and
CDI allocations can never disagree on a path.  Every mount is a recursive
bind (C{rbind}) with C{nosuid}, C{nodev} and C{noexec} (as the NRI plugin's; nothing is
executed from either: L{hostpid.nri.decision}); the lock parent is C{rw}, the
broker directory C{ro}.  The mount C{type} (C{bind}) is given explicitly, so
a runtime never has to guess it from the options; that field exists from CDI
0.4.0, which is why older versions are refused.

Beyond what the CDI JSON schema checks (it checks almost nothing: field
types and three required keys), L{validate_spec} checks the spec against the
rules the CDI library applies when a runtime loads it (kind, device names,
the C{KEY=VALUE} environment form, no unknown fields since the Go library
decodes strictly) and against this project's own (absolute, clean container
paths; each mount exactly one of C{rw}/C{ro}; parents before children).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from hostpid import defaults
from hostpid.gate import ENABLED_VALUE, GATE_ENV
from hostpid.node.allocation import (
    AllocateResponse,
    IHostPaths,
    LexicalHostPaths,
    canonical_mounts,
    clean_container_path,
    is_ancestor,
    is_reserved_mount,
)

VENDOR = "hami.io"
CLASS = "hostpid"
KIND = f"{VENDOR}/{CLASS}"
#: The spec's file name in a CDI spec directory.
SPEC_FILE_NAME = "hami.io-hostpid.json"
#: The spec directory a runtime reads and a node may clear on reboot.
DEFAULT_SPEC_DIRECTORY = "/var/run/cdi"

BROKER_DEVICE = "broker"
LOCK_PARENT_DEVICE = "lock-parent"

#: The default: the newest version containerd 1.7 and podman 4 accept.
DEFAULT_VERSION = "0.5.0"
#: The first version with a mount C{type} field, which the edits use.
MINIMUM_VERSION = "0.4.0"
#: Released CDI specification versions, oldest first.
RELEASED_VERSIONS = (
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
)
#: The versions that can express the edits.
SUPPORTED_VERSIONS = RELEASED_VERSIONS[RELEASED_VERSIONS.index(MINIMUM_VERSION):]

MOUNT_TYPE = "bind"

#: The CDI project's annotation prefix (C{pkg/cdi/annotations.go}).
ANNOTATION_PREFIX = "cdi.k8s.io/"
#: The plugin part of our annotation key, in the library's
#: C{vendor.device-type} convention.
ANNOTATION_PLUGIN = f"{VENDOR}.{CLASS}"
#: The longest C{plugin_deviceID} the CDI library accepts in a key.
ANNOTATION_NAME_MAX = 63

_SPEC_FIELDS = {"cdiVersion", "kind", "devices", "containerEdits"}
_DEVICE_FIELDS = {"name", "containerEdits"}
_EDIT_FIELDS = {"env", "mounts"}
_MOUNT_FIELDS = {"hostPath", "containerPath", "options", "type"}


class CdiSpecError(ValueError):
    """A spec (or a request for one) that a CDI runtime would refuse or misapply."""


def qualified_name(device: str) -> str:
    """C{hami.io/hostpid=DEVICE}: how a runtime and C{cdiDevices} name a device."""
    return f"{KIND}={device}"


def device_for(broker_enabled: bool) -> str:
    """The device an allocation names: C{broker} with the gate on, else C{lock-parent}."""
    return BROKER_DEVICE if broker_enabled else LOCK_PARENT_DEVICE


def check_version(version: str) -> str:
    """
    C{version} if it can express the edits.

    @raise CdiSpecError: an unreleased version, or one older than 0.4.0
        (no mount C{type}).
    """
    if version not in RELEASED_VERSIONS:
        raise CdiSpecError(
            f"cdiVersion {version!r} is not a released CDI specification version "
            f"(supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    if version not in SUPPORTED_VERSIONS:
        raise CdiSpecError(
            f"cdiVersion {version} cannot express the edits: the mount type ({MOUNT_TYPE}) "
            f"needs CDI {MINIMUM_VERSION} or newer"
        )
    return version


def _mount_object(host_path: str, container_path: str, read_only: bool) -> dict[str, Any]:
    return {
        "hostPath": host_path,
        "containerPath": container_path,
        "options": ["rbind", "ro" if read_only else "rw", "nosuid", "nodev", "noexec"],
        "type": MOUNT_TYPE,
    }


def _edits(broker: bool, lock_parent: str, broker_directory: str) -> dict[str, Any]:
    edits: dict[str, Any] = {}
    if broker:
        edits["env"] = [f"{GATE_ENV}={ENABLED_VALUE}"]
    edits["mounts"] = [
        _mount_object(mount.host_path, mount.container_path, mount.read_only)
        for mount in canonical_mounts(broker, lock_parent, broker_directory)
    ]
    return edits


def build_spec(
    *,
    broker_enabled: bool,
    lock_parent: str = defaults.LOCK_PARENT,
    broker_directory: str = defaults.BROKER_DIRECTORY,
    version: str = DEFAULT_VERSION,
) -> dict[str, Any]:
    """
    The spec as JSON-ready data, validated (L{validate_spec}).

    @param broker_enabled: the gate as the node sees it (the CLI's or the
        broker's own environment).
    @param lock_parent: the host lock parent, already prepared
        (L{hostpid.node.lockparent.prepare_lock_parent}): a CDI runtime does
        not create host paths.
    @param broker_directory: the host broker directory.
    @raise CdiSpecError: a version that cannot express the edits, or paths
        that break the rules.
    """
    check_version(version)
    for what, path in (("lock parent", lock_parent), ("broker directory", broker_directory)):
        _require(path.startswith("/") and clean_container_path(path) == path,
                 f"{path}: the {what} must be an absolute, clean path")
    spec = {
        "cdiVersion": version,
        "kind": KIND,
        "devices": [
            {"name": BROKER_DEVICE,
             "containerEdits": _edits(broker_enabled, lock_parent, broker_directory)},
            {"name": LOCK_PARENT_DEVICE,
             "containerEdits": _edits(False, lock_parent, broker_directory)},
        ],
    }
    validate_spec(spec)
    return spec


def spec_to_json(spec: Mapping[str, Any]) -> str:
    """The spec as the file's text (stable key order, a final newline)."""
    return json.dumps(spec, indent=2) + "\n"


# Validation -----------------------------------------------------------------


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CdiSpecError(message)


def _unknown(obj: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    _require(not extra, f"{where}: unknown field(s) {', '.join(extra)} (CDI decodes strictly)")


def _name_chars_ok(text: str, allowed_punctuation: str) -> bool:
    return all(c.isascii() and (c.isalnum() or c in allowed_punctuation) for c in text)


def _is_letter(c: str) -> bool:
    return c.isascii() and c.isalpha()


def _is_alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def vendor_name_problem(vendor: str) -> str | None:
    """The CDI library's vendor rule: a letter, then C{[A-Za-z0-9_.-]}, ending alphanumeric."""
    if not vendor:
        return "the vendor is empty"
    if not _is_letter(vendor[0]) or not _is_alnum(vendor[-1]):
        return f"vendor {vendor!r} must start with a letter and end with a letter or digit"
    if not _name_chars_ok(vendor[1:-1], "_-."):
        return f"vendor {vendor!r} has a character other than letters, digits, '_', '-', '.'"
    return None


def class_name_problem(class_: str) -> str | None:
    """The CDI library's class rule: a letter, then C{[A-Za-z0-9_-]}, ending alphanumeric."""
    if not class_:
        return "the class is empty"
    if not _is_letter(class_[0]) or not _is_alnum(class_[-1]):
        return f"class {class_!r} must start with a letter and end with a letter or digit"
    if not _name_chars_ok(class_[1:-1], "_-"):
        return f"class {class_!r} has a character other than letters, digits, '_', '-'"
    return None


def device_name_problem(name: str) -> str | None:
    """The CDI library's device name rule: alphanumeric ends, C{[A-Za-z0-9_.:-]} inside."""
    if not name:
        return "the device name is empty"
    if not _is_alnum(name[0]) or not _is_alnum(name[-1]):
        return f"device name {name!r} must start and end with a letter or digit"
    if not _name_chars_ok(name[1:-1], "_-.:"):
        return f"device name {name!r} has a character other than letters, digits, '_-.:'"
    return None


def parse_qualified_name(device: str) -> tuple[str, str, str]:
    """
    C{VENDOR/CLASS=NAME} split and checked as the CDI library's
    C{ParseQualifiedName} does.

    @raise CdiSpecError: not a valid fully qualified device name.
    """
    kind, equals, name = device.partition("=")
    vendor, slash, class_ = kind.partition("/")
    if not equals or not slash or "/" in class_:
        raise CdiSpecError(f"{device!r} is not a qualified CDI device name (VENDOR/CLASS=NAME)")
    for problem in (vendor_name_problem(vendor), class_name_problem(class_),
                    device_name_problem(name)):
        if problem is not None:
            raise CdiSpecError(f"invalid CDI device {device!r}: {problem}")
    return vendor, class_, name


def _validate_env(env: Any, where: str) -> None:
    _require(isinstance(env, list), f"{where}.env must be a list")
    for entry in env:
        _require(isinstance(entry, str), f"{where}.env: {entry!r} is not a string")
        key, equals, _ = entry.partition("=")
        _require(bool(equals) and bool(key), f"{where}.env: {entry!r} is not KEY=VALUE")
        _require(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) is not None,
                 f"{where}.env: {key!r} is not a valid variable name")


def _validate_mount(mount: Any, where: str) -> tuple[str, bool]:
    _require(isinstance(mount, dict), f"{where} must be an object")
    _unknown(mount, _MOUNT_FIELDS, where)
    for field in ("hostPath", "containerPath"):
        value = mount.get(field)
        _require(isinstance(value, str) and value.startswith("/"),
                 f"{where}.{field} must be an absolute path, not {value!r}")
        _require(clean_container_path(value) == value,
                 f"{where}.{field} {value!r} must be clean (no '.', '..', '//' or trailing '/')")
    _require(mount.get("type") == MOUNT_TYPE, f"{where}.type must be {MOUNT_TYPE!r}")
    options = mount.get("options")
    _require(isinstance(options, list) and all(isinstance(o, str) for o in options),
             f"{where}.options must be a list of strings")
    access = [o for o in options if o in ("rw", "ro")]
    _require(len(access) == 1, f"{where}.options must hold exactly one of 'rw' and 'ro'")
    _require("rbind" in options or "bind" in options, f"{where}.options must hold 'rbind'")
    return mount["containerPath"], access[0] == "ro"


def _validate_edits(edits: Any, where: str) -> list[tuple[str, bool]]:
    _require(isinstance(edits, dict), f"{where} must be an object")
    _unknown(edits, _EDIT_FIELDS, where)
    if "env" in edits:
        _validate_env(edits["env"], where)
    mounts = edits.get("mounts", [])
    _require(isinstance(mounts, list), f"{where}.mounts must be a list")
    seen = [_validate_mount(m, f"{where}.mounts[{i}]") for i, m in enumerate(mounts)]
    targets = [target for target, _ in seen]
    _require(len(set(targets)) == len(targets), f"{where}.mounts: a container path repeats")
    for index, target in enumerate(targets):
        for later in targets[index + 1:]:
            _require(not is_ancestor(later, target),
                     f"{where}.mounts: {later} would cover {target}; parents come first")
    return seen


def validate_spec(spec: Any) -> None:
    """
    Check C{spec} (decoded JSON) by the CDI library's rules and this
    project's, beyond the JSON schema.

    @raise CdiSpecError: the first rule broken, named by its place.
    """
    _require(isinstance(spec, dict), "the CDI spec must be a JSON object")
    _unknown(spec, _SPEC_FIELDS, "spec")
    version = spec.get("cdiVersion")
    _require(isinstance(version, str), "spec.cdiVersion must be a string")
    check_version(version)
    kind = spec.get("kind")
    _require(kind == KIND, f"spec.kind must be {KIND!r}, not {kind!r}")
    devices = spec.get("devices")
    _require(isinstance(devices, list) and bool(devices), "spec.devices must be a non-empty list")
    names = []
    for index, device in enumerate(devices):
        where = f"devices[{index}]"
        _require(isinstance(device, dict), f"{where} must be an object")
        _unknown(device, _DEVICE_FIELDS, where)
        name = device.get("name")
        _require(isinstance(name, str), f"{where}.name must be a string")
        problem = device_name_problem(name)
        _require(problem is None, f"{where}: {problem}")
        edits = device.get("containerEdits")
        mounts = _validate_edits(edits, f"{where}.containerEdits")
        _require(bool(edits.get("env")) or bool(mounts),
                 f"{where}.containerEdits: a device's edits must not be empty")
        names.append(name)
    _require(len(set(names)) == len(names), "spec.devices: a device name repeats")
    if "containerEdits" in spec:
        _validate_edits(spec["containerEdits"], "spec.containerEdits")


# The cdiDevices form of an allocation response ------------------------------


def annotation_key(plugin: str, device_id: str) -> str:
    """
    The CDI annotation key for one allocation, as the CDI library's
    C{AnnotationKey(pluginName, deviceID)} builds and checks it:
    C{cdi.k8s.io/} + C{plugin_deviceID} (C{/} in the ID become C{_}), at most
    63 characters, alphanumeric at both ends, C{[A-Za-z0-9_.-]} inside.

    @raise CdiSpecError: a name the library would refuse.
    """
    _require(bool(plugin), "invalid plugin name, empty")
    _require(bool(device_id), "invalid deviceID, empty")
    name = plugin + "_" + device_id.replace("/", "_")
    _require(len(name) <= ANNOTATION_NAME_MAX, f"invalid plugin+deviceID {name!r}, too long")
    _require(_is_alnum(name[0]), f"invalid name {name!r}: the first character must be "
             "alphanumeric")
    _require(len(name) <= 2 or _name_chars_ok(name[1:-1], "_-."),
             f"invalid name {name!r}: a character other than letters, digits, '_-.'")
    _require(_is_alnum(name[-1]), f"invalid name {name!r}: the last character must be "
             "alphanumeric")
    return ANNOTATION_PREFIX + name


def annotation_value(devices: Sequence[str]) -> str:
    """
    The annotation value: the qualified device names joined by commas, each
    checked (the library's C{AnnotationValue}).
    """
    for device in devices:
        parse_qualified_name(device)
    return ",".join(devices)


def _is_our_annotation(key: str) -> bool:
    return key.startswith(ANNOTATION_PREFIX + ANNOTATION_PLUGIN + "_")


def _cdi_device_list(value: Any) -> list[dict[str, Any]]:
    _require(isinstance(value, list), "cdiDevices must be a list")
    for index, item in enumerate(value):
        _require(isinstance(item, dict) and isinstance(item.get("name"), str),
                 f"cdiDevices[{index}] must be an object with a string name")
    return value


def _is_our_device(item: Mapping[str, Any]) -> bool:
    return str(item["name"]).startswith(KIND + "=")


def patch_response_cdi(
    response: AllocateResponse,
    *,
    broker_enabled: bool,
    annotate: bool = False,
    host_paths: IHostPaths | None = None,
) -> AllocateResponse:
    """
    The response with the lock parent and broker named as a CDI device
    instead of carried as mounts.

    Mounts whose host path is the broker directory (judged by C{host_paths},
    by default by spelling against the default directory) are removed too,
    as L{hostpid.node.allocation.patch_response} removes them (a writable
    second view of the broker directory would let a workload replace its socket).

    As L{hostpid.node.allocation.patch_response}: the reserved key is
    cleared from C{envs} and every mount at a reserved path is removed.  Then
    any C{cdiDevices} entry of kind C{hami.io/hostpid} (a stale one) is
    replaced by the one this gate names, and, with C{annotate}, the same
    device is also named in a C{cdi.k8s.io/hami.io.hostpid_DEVICE}
    annotation, the form runtimes read for kubelets older than 1.29.  Our
    annotation keys are cleared in either case.  The gate variable itself is
    not set: the device's edits carry it.

    @raise CdiSpecError: C{cdiDevices} of the wrong shape.
    """
    device = device_for(broker_enabled)
    name = qualified_name(device)
    envs = {key: value for key, value in response.envs.items() if key != GATE_ENV}
    judge = host_paths if host_paths is not None else LexicalHostPaths()
    mounts = tuple(
        mount for mount in response.mounts
        if not is_reserved_mount(mount) and not judge.names_broker_directory(mount.host_path)
    )
    extra = dict(response.extra)
    kept = [item for item in _cdi_device_list(extra.get("cdiDevices", []))
            if not _is_our_device(item)]
    extra["cdiDevices"] = [*kept, {"name": name}]
    annotations = {key: value for key, value in response.annotations.items()
                   if not _is_our_annotation(key)}
    if annotate:
        annotations[annotation_key(ANNOTATION_PLUGIN, device)] = annotation_value([name])
    return attrs.evolve(response, envs=envs, mounts=mounts, annotations=annotations,
                        extra=extra)


def named_devices(response: AllocateResponse) -> Iterable[str]:
    """The qualified names in the response's C{cdiDevices}."""
    return [str(item["name"]) for item in _cdi_device_list(response.extra.get("cdiDevices", []))]
