"""
Patching a kubelet C{ContainerAllocateResponse}: the lock parent mount, the
broker mount and the broker's environment gate.

Everything here is a pure function over values: no files, no logging.  The
JSON adapter at the bottom lets any device plugin (Go, Python, anything that
can run a command) use the same rules.

The rules, in the order they apply (see C{docs/allocation.md} for why):

 1. The reserved key C{LIBVGPU_HOSTPID_BROKER} is cleared from the
    environment before the current gate is applied, so a stale or forged value
    never survives.
 2. Every mount whose container path is, once cleaned the way Go's
    C{filepath.Clean("/" + p)} cleans it, the lock parent (C{/tmp/vgpulock})
    or the broker directory (C{/tmp/vgpulock/hostpid}) or anything inside the
    broker directory, is removed.  The broker directory is a reserved name:
    a mount inside it would either fail (the broker mount is read-only) or,
    worse, cover C{broker.sock} with another socket.
 3. Exactly one writable lock parent mount is added, and when the broker is
    enabled exactly one read-only broker mount right after it, with the
    environment key set to C{"1"}.
 4. Every mount whose host path is the broker directory or inside it is
    removed too, whatever its container path: a writable second
    view of the broker directory would let a workload replace C{broker.sock}.
    Host paths are compared by spelling here; L{hostpid.node.hostpaths}
    adds identity (C{stat}) where the path exists, injected through
    L{IHostPaths}, so this module stays pure.
 5. Order: every ancestor of the lock parent (C{/}, C{/tmp}),
    then the lock parent, then the broker mount, then every mount inside
    the lock parent, each group keeping its relative order; a runtime that
    applies mounts in order then never covers one of ours, nor a lock file
    mounted inside the parent, with a later mount.  The canonical mounts go
    right after the last ancestor (or first), the mounts inside the lock
    parent right after them, and every other mount keeps its place.

Patching is idempotent: patching a patched response changes nothing.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from zope.interface import Interface, implementer

from hostpid import defaults
from hostpid.gate import ENABLED_VALUE, GATE_ENV


class AllocationResponseError(ValueError):
    """The allocation response is not valid JSON or does not have the right shape."""


def clean_container_path(path: str) -> str:
    """
    C{path} made absolute and cleaned lexically, as Go's
    C{filepath.Clean("/" + path)} does.

    C{posixpath.normpath} is not enough: it keeps a leading C{//} (POSIX
    allows it to mean something special), so C{//tmp/vgpulock} would escape
    the comparison.  A runtime joins the container path to the root the same
    way, so two paths that clean to the same string name the same mountpoint.
    """
    # posixpath.normpath is C code (CPython 3.11+), ten times faster than a
    # loop over the components, which counts when a container has thousands
    # of mounts; an absolute path differs from Go's Clean only in a leading
    # "//", which it keeps.
    cleaned = posixpath.normpath("/" + path)
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    return cleaned


def is_ancestor(ancestor: str, path: str) -> bool:
    """Whether cleaned C{ancestor} is a proper ancestor of cleaned C{path}."""
    if ancestor == path:
        return False
    if ancestor == "/":
        return True
    return path.startswith(ancestor + "/")


def is_within(path: str, directory: str) -> bool:
    """Whether cleaned C{path} is C{directory} or below it."""
    return path == directory or is_ancestor(directory, path)


@attrs.frozen
class Mount:
    """
    One entry of C{mounts}.

    @ivar extra: fields this code does not know, passed through unchanged.
    """

    container_path: str
    host_path: str
    read_only: bool = False
    extra: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def target(self) -> str:
        """The cleaned container path: what the runtime mounts on."""
        return clean_container_path(self.container_path)


@attrs.frozen
class AllocateResponse:
    """
    A kubelet C{ContainerAllocateResponse}.

    C{devices} and C{annotations} are carried, not interpreted.

    @ivar extra: top-level fields this code does not know (C{cdiDevices} and
        anything newer), passed through unchanged.
    """

    envs: Mapping[str, str] = attrs.field(factory=dict)
    mounts: tuple[Mount, ...] = ()
    devices: tuple[Mapping[str, Any], ...] = ()
    annotations: Mapping[str, str] = attrs.field(factory=dict)
    extra: Mapping[str, Any] = attrs.field(factory=dict)


def is_reserved_mount(mount: Mount) -> bool:
    """
    Whether C{mount} targets the lock parent, the broker directory or
    anything inside the broker directory: the paths this module owns.
    """
    target = mount.target
    return target == defaults.LOCK_PARENT or is_within(
        target, defaults.CONTAINER_BROKER_DIRECTORY
    )


class IHostPaths(Interface):
    """How a mount's host path is judged against the broker directory."""

    def names_broker_directory(host_path: str) -> bool:
        """Whether C{host_path} is the broker directory or inside it."""


@implementer(IHostPaths)
@attrs.frozen
class LexicalHostPaths:
    """
    The pure judgement: by spelling, after the same cleaning as container
    paths.  L{hostpid.node.hostpaths.FilesystemHostPaths} adds identity.
    """

    broker_directory: str = defaults.BROKER_DIRECTORY

    def names_broker_directory(self, host_path: str) -> bool:
        return is_within(clean_container_path(host_path),
                         clean_container_path(self.broker_directory))


def is_inside_lock_parent(mount: Mount) -> bool:
    """Whether C{mount} targets something strictly inside the lock parent."""
    return is_ancestor(defaults.LOCK_PARENT, mount.target)


def canonical_mounts(
    broker_enabled: bool,
    lock_parent: str = defaults.LOCK_PARENT,
    broker_directory: str = defaults.BROKER_DIRECTORY,
) -> tuple[Mount, ...]:
    """The mounts this module owns, in the order they must be applied."""
    parent = Mount(container_path=defaults.LOCK_PARENT, host_path=lock_parent, read_only=False)
    if not broker_enabled:
        return (parent,)
    broker = Mount(
        container_path=defaults.CONTAINER_BROKER_DIRECTORY,
        host_path=broker_directory,
        read_only=True,
    )
    return (parent, broker)


def patch_response(
    response: AllocateResponse,
    *,
    broker_enabled: bool,
    lock_parent: str = defaults.LOCK_PARENT,
    broker_directory: str = defaults.BROKER_DIRECTORY,
    host_paths: IHostPaths | None = None,
) -> AllocateResponse:
    """
    The response with the lock parent mount, the broker mount and the gate
    set as the rules in this module's docstring say.

    @param broker_enabled: the gate as the device plugin sees it in its own
        environment (L{hostpid.gate.gate_enabled}).
    @param lock_parent: the host directory mounted writable at
        C{/tmp/vgpulock}; it must have been prepared
        (L{hostpid.lockparent.prepare_lock_parent}) first.
    @param broker_directory: the host directory mounted read-only at
        C{/tmp/vgpulock/hostpid}.
    @param host_paths: how host paths are compared with C{broker_directory}
        (default: by spelling, L{LexicalHostPaths}).
    """
    judge = host_paths if host_paths is not None else LexicalHostPaths(broker_directory)
    envs = {key: value for key, value in response.envs.items() if key != GATE_ENV}
    if broker_enabled:
        envs[GATE_ENV] = ENABLED_VALUE
    kept = [
        mount for mount in response.mounts
        if not is_reserved_mount(mount) and not judge.names_broker_directory(mount.host_path)
    ]
    inside = [mount for mount in kept if is_inside_lock_parent(mount)]
    rest = [mount for mount in kept if not is_inside_lock_parent(mount)]
    ours = canonical_mounts(broker_enabled, lock_parent, broker_directory)
    insert_at = 0
    for index, mount in enumerate(rest):
        if is_ancestor(mount.target, defaults.LOCK_PARENT):
            insert_at = index + 1
    mounts = (*rest[:insert_at], *ours, *inside, *rest[insert_at:])
    return attrs.evolve(response, envs=envs, mounts=mounts)


# JSON adapter -------------------------------------------------------------

#: Top-level fields: lowerCamelCase JSON name and proto name.
_TOP_LEVEL = {"envs": "envs", "mounts": "mounts", "devices": "devices",
              "annotations": "annotations", "cdiDevices": "cdi_devices"}
_MOUNT_FIELDS = {"containerPath": "container_path", "hostPath": "host_path",
                 "readOnly": "read_only"}
_DEVICE_FIELDS = {"containerPath": "container_path", "hostPath": "host_path",
                  "permissions": "permissions"}
_CDI_DEVICE_FIELDS = {"name": "name"}

#: The largest allocation response accepted, in bytes.  A real one is a few
#: kilobytes (a few mounts, devices and variables); the bound keeps a broken
#: or hostile producer from making the plugin's helper parse without limit.
MAX_INPUT_BYTES = 1024 * 1024
#: The deepest nesting of arrays and objects accepted.  The response itself
#: is four levels deep; unknown fields get the rest.  Python's parser would
#: otherwise end in a RecursionError near 1,000 levels.
MAX_DEPTH = 64
#: Integers must fit in 64 bits (signed or unsigned), as every JSON reader of
#: a protobuf message can represent them; Python alone would accept any
#: length, and refuses more than 4,300 digits only with a traceback.
MIN_INTEGER = -(2**63)
MAX_INTEGER = 2**64 - 1


def _take_fields(
    obj: Mapping[str, Any], names: Mapping[str, str], where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """
    Split C{obj} into known fields (keyed by JSON name) and the rest.

    Either spelling of a field is accepted, as protobuf's JSON parser does;
    both at once is ambiguous and refused.  C{null} means "not set".
    """
    by_proto = {proto: json_name for json_name, proto in names.items()}
    _refuse_folded_keys(obj, names, by_proto, where)
    known: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in obj.items():
        json_name = key if key in names else by_proto.get(key)
        if json_name is None:
            extra[key] = value
            continue
        if json_name in known:
            raise AllocationResponseError(
                f"{where}: field {json_name!r} is given twice ({names[json_name]!r} and "
                f"{json_name!r})"
            )
        if value is not None:
            known[json_name] = value
    return known, extra


def fold_key(key: str) -> str:
    """
    C{key} case-folded, so that two keys a case-insensitive reader would
    take for one field fold to the same string.

    Go's C{encoding/json} matches an object key to a struct field exactly
    first, else case-insensitively (ASCII case, plus Unicode simple folding:
    C{"\u212a"}, the Kelvin sign, is a C{k} and C{"\u017f"}, the long s,
    an C{s}), and the last key that matches wins.  Python's full case
    folding puts together every pair Go does (and a few more, such as
    C{"\u00df"} and C{"ss"}): refusing on it refuses at least what Go
    would misread.
    """
    return key.casefold()


def _refuse_folded_keys(
    obj: Mapping[str, Any], names: Mapping[str, str], by_proto: Mapping[str, str], where: str
) -> None:
    """
    Refuse keys that a case-insensitive reader (Go's C{encoding/json}, which
    the documented Go consumer uses) would read differently from this code:
    two keys equal under case folding (the reader keeps only the last), or a
    key that folds onto a known field without being one of its accepted
    spellings (this code would pass it through as unknown; the reader would
    take it for the field, and it comes after the field in the output).
    """
    accepted = {fold_key(name): name for pair in names.items() for name in pair}
    seen: dict[str, str] = {}
    for key in obj:
        folded = fold_key(key)
        if folded in seen:
            raise AllocationResponseError(
                f"{where}: keys {seen[folded]!r} and {key!r} differ only in case; a "
                "case-insensitive reader (Go's encoding/json) would keep only the last"
            )
        seen[folded] = key
        if folded in accepted and key not in names and key not in by_proto:
            raise AllocationResponseError(
                f"{where}: key {key!r} is not an accepted spelling of field "
                f"{accepted[folded]!r}, but a case-insensitive reader (Go's encoding/json) "
                "would take it for that field"
            )


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise AllocationResponseError(f"{where} must be a string, not {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise AllocationResponseError(f"{where} must be an object, not {_kind(value)}")
    return {key: _string(item, f"{where}[{key!r}]") for key, item in value.items()}


def _object_list(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise AllocationResponseError(f"{where} must be a list, not {_kind(value)}")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise AllocationResponseError(
                f"{where}[{index}] must be an object, not {_kind(item)}"
            )
    return value


def _mount_from_json(obj: dict[str, Any], where: str) -> Mount:
    known, extra = _take_fields(obj, _MOUNT_FIELDS, where)
    read_only = known.get("readOnly", False)
    if not isinstance(read_only, bool):
        raise AllocationResponseError(
            f"{where}.readOnly must be true or false, not {_kind(read_only)}"
        )
    return Mount(
        container_path=_string(known.get("containerPath", ""), f"{where}.containerPath"),
        host_path=_string(known.get("hostPath", ""), f"{where}.hostPath"),
        read_only=read_only,
        extra=extra,
    )


def _device_from_json(obj: dict[str, Any], where: str) -> dict[str, Any]:
    known, extra = _take_fields(obj, _DEVICE_FIELDS, where)
    for name, value in known.items():
        _string(value, f"{where}.{name}")
    return {**known, **extra}


def response_from_object(obj: Any) -> AllocateResponse:
    """
    An L{AllocateResponse} from decoded JSON, either field spelling.

    @raise AllocationResponseError: wrong shapes, named by their place.
    """
    if not isinstance(obj, dict):
        raise AllocationResponseError(
            f"the allocation response must be a JSON object, not {_kind(obj)}"
        )
    known, extra = _take_fields(obj, _TOP_LEVEL, "the allocation response")
    mounts = tuple(
        _mount_from_json(item, f"mounts[{index}]")
        for index, item in enumerate(_object_list(known.get("mounts", []), "mounts"))
    )
    devices = tuple(
        _device_from_json(item, f"devices[{index}]")
        for index, item in enumerate(_object_list(known.get("devices", []), "devices"))
    )
    if "cdiDevices" in known:
        cdi_devices = known["cdiDevices"]
        if isinstance(cdi_devices, list):
            for index, item in enumerate(cdi_devices):
                if isinstance(item, dict):
                    _take_fields(item, _CDI_DEVICE_FIELDS, f"cdiDevices[{index}]")
        extra["cdiDevices"] = cdi_devices
    return AllocateResponse(
        envs=_string_map(known.get("envs", {}), "envs"),
        mounts=mounts,
        devices=devices,
        annotations=_string_map(known.get("annotations", {}), "annotations"),
        extra=extra,
    )


def response_to_object(response: AllocateResponse) -> dict[str, Any]:
    """The response as JSON-ready data with lowerCamelCase field names."""
    out: dict[str, Any] = {
        "envs": dict(response.envs),
        "mounts": [_mount_to_object(mount) for mount in response.mounts],
        "devices": [dict(device) for device in response.devices],
        "annotations": dict(response.annotations),
    }
    out.update(response.extra)
    return out


def _mount_to_object(mount: Mount) -> dict[str, Any]:
    return {
        "containerPath": mount.container_path,
        "hostPath": mount.host_path,
        "readOnly": mount.read_only,
        **mount.extra,
    }


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """
    Build a JSON object, refusing a key given twice: parsers disagree on
    which one wins, and a patch must not depend on which one the next reader
    picks.
    """
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise AllocationResponseError(
                f"the allocation response is not valid: key {key!r} appears twice in one object"
            )
        obj[key] = value
    return obj


def _refuse_constant(name: str) -> Any:
    """C{NaN}, C{Infinity}, C{-Infinity}: Python reads them, JSON has no such thing."""
    raise AllocationResponseError(
        f"the allocation response is not valid JSON: {name} is not a JSON number"
    )


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    value = int(text) if digits <= 20 else None
    if value is None or not MIN_INTEGER <= value <= MAX_INTEGER:
        raise AllocationResponseError(
            f"the allocation response is not valid: an integer of {digits} digits does not "
            "fit in 64 bits"
        )
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise AllocationResponseError(
            f"the allocation response is not valid: the number {text[:40]} is out of range "
            "for a 64-bit float"
        )
    return value


#: A JSON string (skipped whole: brackets inside it do not nest) or a bracket.
_NESTING_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def check_nesting(text: str, limit: int = MAX_DEPTH) -> None:
    """
    Refuse C{text} if its arrays and objects nest deeper than C{limit},
    before any parser recurses into it.  A lexical scan: strings are skipped,
    brackets counted; malformed input is left for the parser to name.
    """
    depth = 0
    for match in _NESTING_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                raise AllocationResponseError(
                    f"the allocation response is not valid: arrays and objects nest deeper "
                    f"than {limit} levels"
                )
        elif token in "]}":
            depth -= 1


def _decode(text: str | bytes) -> str:
    if isinstance(text, str):
        return text
    try:
        return text.decode(json.detect_encoding(text))
    except UnicodeDecodeError as e:
        raise AllocationResponseError(
            f"the allocation response is not valid JSON: {e.reason} at byte {e.start}"
        ) from e


def response_from_json(text: str | bytes) -> AllocateResponse:
    """
    Parse a C{ContainerAllocateResponse} from JSON.

    Only JSON that every reader reads the same way is accepted: no
    C{NaN}/C{Infinity}, no number out of 64-bit range, no key given twice or
    twice under case folding (see L{_refuse_folded_keys}), at most
    L{MAX_INPUT_BYTES} bytes and L{MAX_DEPTH} levels.

    @raise AllocationResponseError: invalid JSON or a wrong shape, in one line.
    """
    if len(text) > MAX_INPUT_BYTES:
        raise AllocationResponseError(
            f"the allocation response is larger than {MAX_INPUT_BYTES} bytes"
        )
    decoded = _decode(text)
    check_nesting(decoded)
    try:
        obj = json.loads(
            decoded,
            object_pairs_hook=_refuse_duplicate_keys,
            parse_constant=_refuse_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as e:
        raise AllocationResponseError(f"the allocation response is not valid JSON: {e}") from e
    except RecursionError as e:  # pragma: no cover - check_nesting stops this first
        raise AllocationResponseError(
            "the allocation response is not valid: nested too deeply"
        ) from e
    return response_from_object(obj)


def response_to_json(response: AllocateResponse) -> str:
    """
    The response as JSON with lowerCamelCase names (what protojson emits).
    C{allow_nan=False}: whatever got in, nothing that is not JSON gets out.
    """
    return json.dumps(response_to_object(response), indent=2, allow_nan=False)


def patch_json(
    text: str | bytes,
    *,
    broker_enabled: bool,
    lock_parent: str = defaults.LOCK_PARENT,
    broker_directory: str = defaults.BROKER_DIRECTORY,
    host_paths: IHostPaths | None = None,
) -> str:
    """L{patch_response} from JSON to JSON."""
    return response_to_json(
        patch_response(
            response_from_json(text),
            broker_enabled=broker_enabled,
            lock_parent=lock_parent,
            broker_directory=broker_directory,
            host_paths=host_paths,
        )
    )


def owned_mounts(mounts: Iterable[Mount]) -> list[Mount]:
    """The mounts in C{mounts} that this module owns (see L{is_reserved_mount})."""
    return [mount for mount in mounts if is_reserved_mount(mount)]
