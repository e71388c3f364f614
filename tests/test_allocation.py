"""
Allocation response patching: table-driven cases for each
rule, property tests over random mount lists, the JSON adapter, and the
C{hostpid allocate} command.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import hostpid_argv, require_root, run_with_private_tmp, subprocess_env

from hostpid.gate import GATE_ENV
from hostpid.node.allocation import (
    AllocateResponse,
    AllocationResponseError,
    Mount,
    clean_container_path,
    is_ancestor,
    patch_json,
    patch_response,
    response_from_json,
    response_from_object,
    response_to_json,
    response_to_object,
)

PARENT = Mount("/tmp/vgpulock", "/tmp/vgpulock", False)
BROKER = Mount("/tmp/vgpulock/hostpid", "/var/run/hami/hostpid", True)


def mounts(*pairs: tuple[str, str] | Mount) -> tuple[Mount, ...]:
    return tuple(p if isinstance(p, Mount) else Mount(p[0], p[1]) for p in pairs)


def patched(
    *given_mounts: tuple[str, str] | Mount, enabled: bool, envs: dict[str, str] | None = None
) -> AllocateResponse:
    response = AllocateResponse(envs=envs or {}, mounts=mounts(*given_mounts))
    result = patch_response(response, broker_enabled=enabled)
    assert patch_response(result, broker_enabled=enabled) == result, "not idempotent"
    return result


# Cleaning paths -------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_path", "cleaned"),
    [
        ("/tmp/vgpulock", "/tmp/vgpulock"),
        ("/tmp/vgpulock/", "/tmp/vgpulock"),
        ("/tmp//vgpulock", "/tmp/vgpulock"),
        ("/tmp/./vgpulock", "/tmp/vgpulock"),
        ("//tmp/vgpulock", "/tmp/vgpulock"),
        ("///tmp/vgpulock", "/tmp/vgpulock"),
        ("tmp/vgpulock", "/tmp/vgpulock"),
        ("/tmp/x/../vgpulock", "/tmp/vgpulock"),
        ("/../../tmp/vgpulock", "/tmp/vgpulock"),
        ("", "/"),
        (".", "/"),
        ("//", "/"),
        ("/tmp/vgpulock/hostpid/.", "/tmp/vgpulock/hostpid"),
    ],
)
def test_clean_container_path_matches_go(given_path: str, cleaned: str) -> None:
    assert clean_container_path(given_path) == cleaned


@pytest.mark.parametrize(
    ("ancestor", "path", "expected"),
    [
        ("/", "/tmp/vgpulock", True),
        ("/tmp", "/tmp/vgpulock", True),
        ("/tmp/vgpulock", "/tmp/vgpulock", False),
        ("/tmp/vgpu", "/tmp/vgpulock", False),
        ("/tmp/vgpulock", "/tmp/vgpulock/hostpid", True),
        ("/", "/", False),
    ],
)
def test_is_ancestor(ancestor: str, path: str, expected: bool) -> None:
    assert is_ancestor(ancestor, path) is expected


# The rules, case by case ----------------------------------------------------


def test_empty_response_gate_off() -> None:
    result = patched(enabled=False)
    assert result.mounts == (PARENT,)
    assert result.envs == {}


def test_empty_response_gate_on() -> None:
    result = patched(enabled=True)
    assert result.mounts == (PARENT, BROKER)
    assert result.envs == {GATE_ENV: "1"}


@pytest.mark.parametrize("stale", ["1", "0", "", "true", " 1"])
def test_reserved_env_cleared_when_gate_off(stale: str) -> None:
    result = patched(enabled=False, envs={"A": "a", GATE_ENV: stale, "B": "b"})
    assert result.envs == {"A": "a", "B": "b"}
    assert list(result.envs) == ["A", "B"]


@pytest.mark.parametrize("stale", ["1", "0", "", "true", "1 "])
def test_reserved_env_set_to_exactly_1_when_gate_on(stale: str) -> None:
    result = patched(enabled=True, envs={"A": "a", GATE_ENV: stale})
    assert result.envs == {"A": "a", GATE_ENV: "1"}


PARENT_FORMS = [
    "/tmp/vgpulock",
    "/tmp/vgpulock/",
    "/tmp//vgpulock",
    "/tmp/./vgpulock",
    "//tmp/vgpulock",
    "tmp/vgpulock",
]
BROKER_FORMS = [
    "/tmp/vgpulock/hostpid",
    "/tmp/vgpulock/hostpid/",
    "//tmp/vgpulock/hostpid",
    "tmp/vgpulock/./hostpid",
    "/tmp/vgpulock/x/../hostpid",
]


@pytest.mark.parametrize("form", PARENT_FORMS)
@pytest.mark.parametrize("enabled", [False, True])
def test_path_equivalent_parent_replaced(form: str, enabled: bool) -> None:
    result = patched(("/a", "/ha"), Mount(form, "/evil", True), ("/b", "/hb"), enabled=enabled)
    expected = (PARENT, BROKER) if enabled else (PARENT,)
    assert result.mounts == (*expected, *mounts(("/a", "/ha"), ("/b", "/hb")))


@pytest.mark.parametrize("form", BROKER_FORMS)
@pytest.mark.parametrize("read_only", [False, True])
def test_broker_mount_replaced_when_gate_on(form: str, read_only: bool) -> None:
    result = patched(Mount(form, "/elsewhere", read_only), ("/b", "/hb"), enabled=True)
    assert result.mounts == (PARENT, BROKER, *mounts(("/b", "/hb")))


@pytest.mark.parametrize("form", BROKER_FORMS)
def test_every_broker_mount_removed_when_gate_off(form: str) -> None:
    result = patched(
        Mount(form, "/var/run/hami/hostpid", True), BROKER, ("/b", "/hb"), enabled=False
    )
    assert result.mounts == (PARENT, *mounts(("/b", "/hb")))


def test_duplicates_collapse_to_one_each() -> None:
    result = patched(PARENT, BROKER, PARENT, BROKER, Mount("/tmp/vgpulock/", "/x"),
                     enabled=True)
    assert result.mounts == (PARENT, BROKER)


@pytest.mark.parametrize("enabled", [False, True])
def test_mounts_inside_the_broker_directory_removed(enabled: bool) -> None:
    """Nothing may cover broker.sock: the broker directory is a reserved name."""
    result = patched(
        ("/tmp/vgpulock/hostpid/broker.sock", "/attacker.sock"),
        ("/tmp/vgpulock/hostpid/sub/dir", "/x"),
        ("/keep", "/keep"),
        enabled=enabled,
    )
    expected = (PARENT, BROKER) if enabled else (PARENT,)
    assert result.mounts == (*expected, *mounts(("/keep", "/keep")))


def test_unrelated_lookalikes_kept_in_place() -> None:
    lookalikes = mounts(
        ("/tmp/vgpulockx", "/1"),
        ("/tmp/vgpulock-hostpid", "/2"),
        ("/tmp/vgpu", "/3"),
        ("/tmp/vgpulock/hostpidx", "/4"),
        ("/var/run/hami/hostpid", "/5"),
    )
    result = patched(*lookalikes, enabled=True)
    # The one inside the lock parent comes right after the canonical mounts.
    assert result.mounts == (PARENT, BROKER, lookalikes[3], *lookalikes[:3], lookalikes[4])


def test_unrelated_mounts_keep_their_order() -> None:
    unrelated = mounts(("/z", "/1"), ("/a", "/2"), ("/m", "/3"), ("/z", "/4"))
    result = patched(unrelated[0], PARENT, unrelated[1], BROKER, unrelated[2], unrelated[3],
                     enabled=True)
    assert [m for m in result.mounts if m not in (PARENT, BROKER)] == list(unrelated)


def test_mount_inside_the_parent_comes_after_it() -> None:
    """A lock file mounted into the parent must not be hidden by the parent."""
    result = patched(("/tmp/vgpulock/extra.lock", "/h"), PARENT, enabled=True)
    assert result.mounts == (PARENT, BROKER, *mounts(("/tmp/vgpulock/extra.lock", "/h")))


@pytest.mark.parametrize("ancestor", ["/tmp", "/tmp/", "//tmp", "/", "", "tmp"])
def test_ancestor_listed_after_moves_them_after_it(ancestor: str) -> None:
    result = patched(PARENT, BROKER, ("/a", "/1"), (ancestor, "/big"), ("/b", "/2"),
                     enabled=True)
    assert result.mounts == (*mounts(("/a", "/1"), (ancestor, "/big")), PARENT, BROKER,
                             *mounts(("/b", "/2")))


def test_several_ancestors_all_come_first() -> None:
    result = patched(("/tmp", "/1"), ("/x", "/2"), ("/", "/3"), ("/y", "/4"), enabled=False)
    assert result.mounts == (*mounts(("/tmp", "/1"), ("/x", "/2"), ("/", "/3")), PARENT,
                             *mounts(("/y", "/4")))


def test_host_paths_are_parameters() -> None:
    response = AllocateResponse(mounts=(PARENT, BROKER))
    result = patch_response(
        response, broker_enabled=True, lock_parent="/srv/lp", broker_directory="/srv/broker"
    )
    assert result.mounts == (
        Mount("/tmp/vgpulock", "/srv/lp", False),
        Mount("/tmp/vgpulock/hostpid", "/srv/broker", True),
    )


def test_unrelated_mount_fields_survive() -> None:
    odd = Mount("/data", "/srv/data", True, extra={"propagation": "rshared"})
    result = patched(odd, Mount("/tmp/vgpulock", "/x", extra={"propagation": "x"}),
                     enabled=False)
    assert result.mounts == (PARENT, odd)


def test_devices_and_annotations_untouched() -> None:
    response = AllocateResponse(
        devices=({"containerPath": "/dev/nvidia0", "hostPath": "/dev/nvidia0",
                  "permissions": "rw"},),
        annotations={"a": "b"},
        extra={"cdiDevices": [{"name": "nvidia.com/gpu=0"}]},
    )
    result = patch_response(response, broker_enabled=True)
    assert attrs.evolve(result, mounts=(), envs={}) == response


# Properties over random mount lists ----------------------------------------

_components = st.sampled_from(["tmp", "vgpulock", "hostpid", "broker.sock", ".", "..", "", "x"])
container_paths = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from(["", "/", "//"]),
    st.lists(_components, max_size=5),
)
random_mounts = st.builds(
    Mount,
    container_path=container_paths,
    host_path=st.sampled_from(["/h1", "/h2", "/tmp/vgpulock", "/var/run/hami/hostpid",
                               "//var/run/hami/hostpid/", "/var/run/hami/hostpid/broker.sock",
                               "/var/run/hami/hostpidx"]),
    read_only=st.booleans(),
)
random_envs = st.dictionaries(
    st.sampled_from([GATE_ENV, "A", "B", "CUDA_VISIBLE_DEVICES"]),
    st.sampled_from(["", "0", "1", "true"]),
)


def _is_ours(mount: Mount) -> bool:
    target = mount.target
    host = clean_container_path(mount.host_path)
    return target == "/tmp/vgpulock" or target == "/tmp/vgpulock/hostpid" or \
        target.startswith("/tmp/vgpulock/hostpid/") or host == "/var/run/hami/hostpid" or \
        host.startswith("/var/run/hami/hostpid/")


def _inside_parent(mount: Mount) -> bool:
    return mount.target.startswith("/tmp/vgpulock/")


@given(st.lists(random_mounts, max_size=12), random_envs, st.booleans())
def test_properties(given_mounts: list[Mount], envs: dict[str, str], enabled: bool) -> None:
    response = AllocateResponse(envs=envs, mounts=tuple(given_mounts))
    result = patch_response(response, broker_enabled=enabled)
    out = list(result.mounts)

    parents = [i for i, m in enumerate(out) if m.target == "/tmp/vgpulock"]
    brokers = [i for i, m in enumerate(out) if m.target.startswith("/tmp/vgpulock/hostpid")
               and (m.target == "/tmp/vgpulock/hostpid" or
                    m.target.startswith("/tmp/vgpulock/hostpid/"))]
    assert len(parents) == 1
    assert out[parents[0]] == PARENT
    if enabled:
        assert brokers == [parents[0] + 1]
        assert out[brokers[0]] == BROKER
        assert result.envs[GATE_ENV] == "1"
    else:
        assert brokers == []
        assert GATE_ENV not in result.envs
    assert {k: v for k, v in result.envs.items() if k != GATE_ENV} == {
        k: v for k, v in envs.items() if k != GATE_ENV
    }

    # Unrelated mounts: all kept; those inside the lock parent in their
    # original relative order right after ours, the others in theirs.
    others = [m for m in given_mounts if not _is_ours(m)]
    assert sorted(map(repr, (m for m in out if m not in (PARENT, BROKER)))) == \
        sorted(map(repr, others))
    assert [m for m in out if not _is_ours(m) and _inside_parent(m)] == \
        [m for m in others if _inside_parent(m)]
    assert [m for m in out if not _is_ours(m) and not _inside_parent(m)] == \
        [m for m in others if not _inside_parent(m)]
    last_ours = parents[0] + (1 if enabled else 0)
    for index, mount in enumerate(out):
        if is_ancestor(mount.target, "/tmp/vgpulock"):
            assert index < parents[0], "an ancestor after the lock parent hides it"
        if _inside_parent(mount) and mount not in (PARENT, BROKER):
            assert index > last_ours, "a mount inside the lock parent before it is hidden"
    # Nothing after the canonical mounts can cover them.
    ours_at = parents[0]
    for later in out[ours_at + 1:]:
        if later in (PARENT, BROKER):
            continue
        assert not is_ancestor(later.target, "/tmp/vgpulock")
        assert later.target != "/tmp/vgpulock"
        assert not (later.target == "/tmp/vgpulock/hostpid"
                    or later.target.startswith("/tmp/vgpulock/hostpid/"))

    # Idempotent, and stable through JSON.
    assert patch_response(result, broker_enabled=enabled) == result
    assert response_from_json(response_to_json(result)) == result


# The JSON adapter -----------------------------------------------------------


def test_json_accepts_proto_names_and_emits_lower_camel_case() -> None:
    text = json.dumps({
        "envs": {"A": "1"},
        "mounts": [{"container_path": "/data", "host_path": "/srv", "read_only": True}],
        "devices": [{"container_path": "/dev/nvidia0", "host_path": "/dev/nvidia0",
                     "permissions": "rw"}],
        "annotations": {"k": "v"},
        "cdi_devices": [{"name": "nvidia.com/gpu=0"}],
    })
    out = json.loads(patch_json(text, broker_enabled=True))
    assert out == {
        "envs": {"A": "1", GATE_ENV: "1"},
        "mounts": [
            {"containerPath": "/tmp/vgpulock", "hostPath": "/tmp/vgpulock", "readOnly": False},
            {"containerPath": "/tmp/vgpulock/hostpid", "hostPath": "/var/run/hami/hostpid",
             "readOnly": True},
            {"containerPath": "/data", "hostPath": "/srv", "readOnly": True},
        ],
        "devices": [{"containerPath": "/dev/nvidia0", "hostPath": "/dev/nvidia0",
                     "permissions": "rw"}],
        "annotations": {"k": "v"},
        "cdiDevices": [{"name": "nvidia.com/gpu=0"}],
    }


def test_json_accepts_lower_camel_case_and_mixed() -> None:
    proto = response_from_object(
        {"mounts": [{"container_path": "/a", "host_path": "/b", "read_only": True}]}
    )
    camel = response_from_object(
        {"mounts": [{"containerPath": "/a", "hostPath": "/b", "readOnly": True}]}
    )
    mixed = response_from_object(
        {"mounts": [{"containerPath": "/a", "host_path": "/b", "readOnly": True}]}
    )
    assert proto == camel == mixed == AllocateResponse(mounts=(Mount("/a", "/b", True),))


def test_json_unknown_fields_pass_through() -> None:
    text = json.dumps({
        "mounts": [{"containerPath": "/a", "hostPath": "/b", "selinuxRelabel": True}],
        "futureField": {"nested": [1, 2]},
    })
    out = json.loads(patch_json(text, broker_enabled=False))
    assert out["futureField"] == {"nested": [1, 2]}
    assert out["mounts"][1] == {"containerPath": "/a", "hostPath": "/b", "readOnly": False,
                                "selinuxRelabel": True}


def test_json_null_means_unset() -> None:
    response = response_from_object(
        {"envs": None, "mounts": [{"containerPath": "/a", "hostPath": None, "readOnly": None}]}
    )
    assert response == AllocateResponse(mounts=(Mount("/a", "", False),))


def test_json_output_is_stable() -> None:
    once = patch_json('{"mounts": [{"container_path": "tmp/vgpulock"}]}', broker_enabled=True)
    assert patch_json(once, broker_enabled=True) == once


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not valid JSON"),
        ("{", "not valid JSON"),
        ("{'envs': {}}", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        ("[]", "must be a JSON object, not a list"),
        ("null", "must be a JSON object, not null"),
        ('{"mounts": {}}', "mounts must be a list"),
        ('{"mounts": ["/tmp"]}', "mounts[0] must be an object"),
        ('{"mounts": [{"readOnly": "yes"}]}', "mounts[0].readOnly must be true or false"),
        ('{"mounts": [{"containerPath": 7}]}', "mounts[0].containerPath must be a string"),
        ('{"mounts": [{"containerPath": "/a", "container_path": "/b"}]}', "given twice"),
        ('{"envs": []}', "envs must be an object"),
        ('{"envs": {"A": 1}}', "envs['A'] must be a string"),
        ('{"annotations": {"A": null}}', "annotations['A'] must be a string"),
        ('{"devices": [{"permissions": 1}]}', "devices[0].permissions must be a string"),
        ('{"envs": {"A": "1", "A": "2"}}', "appears twice"),
        ('{"envs": {}, "envs": {}}', "appears twice"),
    ],
)
def test_invalid_json_is_a_clear_error(text: str | bytes, message: str) -> None:
    with pytest.raises(AllocationResponseError) as caught:
        response_from_json(text)
    assert message in str(caught.value)


def test_response_to_object_round_trip() -> None:
    response = AllocateResponse(
        envs={"A": "b"}, mounts=(Mount("/x", "/y", True, extra={"z": 1}),),
        devices=({"containerPath": "/dev/a"},), annotations={"k": "v"}, extra={"q": [1]},
    )
    assert response_from_object(response_to_object(response)) == response


# The command ---------------------------------------------------------------


@pytest.fixture
def lock_tree(public_tmp: Path) -> Path:
    """A root-owned 0755 directory in C{/tmp} standing in for C{/tmp}."""
    require_root()
    return public_tmp


def allocate(
    stdin: bytes, *args: str, gate: str | None
) -> subprocess.CompletedProcess[bytes]:
    env = subprocess_env()
    env.pop(GATE_ENV, None)
    if gate is not None:
        env[GATE_ENV] = gate
    return subprocess.run(
        hostpid_argv("allocate", *args), input=stdin, env=env, capture_output=True,
        timeout=60, check=False,
    )


def _lock_parent_ok(path: Path) -> bool:
    st_ = os.lstat(path)
    return stat.S_ISDIR(st_.st_mode) and st_.st_uid == 0 and stat.S_IMODE(st_.st_mode) == 0o1777


REQUEST = json.dumps({
    "envs": {"NVIDIA_VISIBLE_DEVICES": "GPU-1", GATE_ENV: "1"},
    "mounts": [{"container_path": "/tmp/vgpulock/", "host_path": "/old", "read_only": True},
               {"container_path": "/usr/local/vgpu", "host_path": "/usr/local/vgpu"}],
}).encode()


@pytest.mark.parametrize("gate", ["1", "0", "", "true", None])
def test_cli_allocate(lock_tree: Path, gate: str | None) -> None:
    lock_parent = lock_tree / "vgpulock"
    result = allocate(REQUEST, "--lock-parent", str(lock_parent), "--broker-dir", "/srv/broker",
                      gate=gate)
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    enabled = gate == "1"
    expected_mounts = [
        {"containerPath": "/tmp/vgpulock", "hostPath": str(lock_parent), "readOnly": False}
    ]
    if enabled:
        expected_mounts.append(
            {"containerPath": "/tmp/vgpulock/hostpid", "hostPath": "/srv/broker",
             "readOnly": True}
        )
    expected_mounts.append(
        {"containerPath": "/usr/local/vgpu", "hostPath": "/usr/local/vgpu", "readOnly": False}
    )
    assert out["mounts"] == expected_mounts
    assert out["envs"] == (
        {"NVIDIA_VISIBLE_DEVICES": "GPU-1", GATE_ENV: "1"} if enabled
        else {"NVIDIA_VISIBLE_DEVICES": "GPU-1"}
    )
    assert _lock_parent_ok(lock_parent)
    assert (lock_parent / "hostpid").exists() is enabled


@pytest.mark.parametrize("stdin", [b"", b"{", b"[]", b'{"mounts": 1}', b"\xff"])
def test_cli_invalid_json_writes_nothing(lock_tree: Path, stdin: bytes) -> None:
    result = allocate(stdin, "--lock-parent", str(lock_tree / "vgpulock"), gate="1")
    assert result.returncode == 1
    assert result.stdout == b""
    assert result.stderr.count(b"\n") == 1
    assert result.stderr.startswith(b"hostpid: ")


@pytest.mark.parametrize("unsafe", ["symlink", "file", "foreign owner", "open parent"])
def test_cli_unsafe_lock_parent_writes_nothing(lock_tree: Path, unsafe: str) -> None:
    lock_parent = lock_tree / "vgpulock"
    if unsafe == "symlink":
        lock_parent.symlink_to("/etc")
    elif unsafe == "file":
        lock_parent.write_text("x")
    elif unsafe == "foreign owner":
        lock_parent.mkdir()
        os.chown(lock_parent, 1000, 1000)
    else:
        os.chmod(lock_tree, 0o777)
    result = allocate(REQUEST, "--lock-parent", str(lock_parent), gate="1")
    assert result.returncode == 1
    assert result.stdout == b""
    assert result.stderr.count(b"\n") == 1
    assert b"unsafe lock parent" in result.stderr


def test_cli_default_lock_parent() -> None:
    """
    The default C{/tmp/vgpulock}, as the product prepares it, in a private
    mount namespace whose C{/tmp} is a fresh tmpfs: the
    host's lock parent is never touched.  Gate off: no mountpoint is made.
    """
    env = subprocess_env()
    env[GATE_ENV] = "0"
    result, state = run_with_private_tmp(hostpid_argv("allocate"), b'{"envs": {}}', env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["mounts"] == [
        {"containerPath": "/tmp/vgpulock", "hostPath": "/tmp/vgpulock", "readOnly": False}
    ]
    parent = state["/tmp/vgpulock"]
    assert parent is not None and (parent["mode"], parent["uid"]) == (0o041777, 0)
    assert state["/tmp/vgpulock/hostpid"] is None


def test_cli_default_lock_parent_gate_on() -> None:
    env = subprocess_env()
    env[GATE_ENV] = "1"
    result, state = run_with_private_tmp(hostpid_argv("allocate"), b'{"envs": {}}', env)
    assert result.returncode == 0, result.stderr
    assert [m["containerPath"] for m in json.loads(result.stdout)["mounts"]] == [
        "/tmp/vgpulock", "/tmp/vgpulock/hostpid"]
    mountpoint = state["/tmp/vgpulock/hostpid"]
    assert mountpoint is not None and (mountpoint["mode"], mountpoint["uid"]) == (0o040755, 0)


def test_cli_prepare_default_lock_parent() -> None:
    env = subprocess_env()
    env.pop(GATE_ENV, None)
    result, state = run_with_private_tmp(hostpid_argv("prepare-lock-parent"), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"/tmp/vgpulock: lock parent prepared\n"
    parent = state["/tmp/vgpulock"]
    assert parent is not None and (parent["mode"], parent["uid"]) == (0o041777, 0)


# Readers that fold keys ------------------------------------------------------


def go_fold(key: str) -> str:
    """
    A key folded as Go's C{encoding/json} folds it to match a struct field:
    ASCII letters by case, other runes to the smallest rune of their simple
    case-folding orbit (so the Kelvin sign is a C{K} and the long s an C{S}).
    """
    out = []
    for char in key:
        if char.isascii():
            out.append(char.upper())
            continue
        orbit = [char, *(c for c in (char.lower(), char.upper()) if len(c) == 1)]
        smallest = min(orbit)
        out.append(smallest.upper() if smallest.isascii() else smallest)
    return "".join(out)


def go_struct(pairs: list[tuple[str, Any]], tags: tuple[str, ...]) -> dict[str, Any]:
    """
    Decode one JSON object into a Go struct whose fields have the JSON
    C{tags}: each key goes to the field whose tag it equals, else to the
    field it equals under folding; unknown keys are dropped; the last key
    for a field wins.
    """
    by_fold = {go_fold(tag): tag for tag in tags}
    fields: dict[str, Any] = {}
    for key, value in pairs:
        tag = key if key in tags else by_fold.get(go_fold(key))
        if tag is not None:
            fields[tag] = value
    return fields


def go_view(text: str) -> tuple[dict[str, str], list[tuple[str, str, bool]]]:
    """
    What the documented Go consumer (docs/allocation.md: C{hostpidResponse}
    with C{Envs} and C{Mounts}) reads from C{hostpid allocate}'s output.
    """
    top = go_struct(json.loads(text, object_pairs_hook=list), ("envs", "mounts"))
    envs = dict(top.get("envs") or [])  # a Go map: exact keys, the last wins
    mounts = []
    for item in top.get("mounts") or []:
        mount = go_struct(item, ("containerPath", "hostPath", "readOnly"))
        mounts.append((mount.get("containerPath", ""), mount.get("hostPath", ""),
                       bool(mount.get("readOnly", False))))
    return envs, mounts


def python_view(text: str) -> tuple[dict[str, str], list[tuple[str, str, bool]]]:
    """What this project meant: the same two fields, read by this project."""
    response = response_from_json(text)
    return dict(response.envs), [(m.container_path, m.host_path, m.read_only)
                                 for m in response.mounts]


SMUGGLED = {
    "mount fields in another case": (
        {"mounts": [{"containerPath": "/safe", "hostPath": "/h",
                     "ContainerPath": "/tmp/vgpulock/hostpid", "HostPath": "/evil"}]},
        True, "'ContainerPath'",
    ),
    "capitalised Envs and Mounts": (
        {"envs": {"A": "a"}, "Envs": {GATE_ENV: "1"},
         "Mounts": [{"containerPath": "/tmp/vgpulock/hostpid", "hostPath": "/evil"}]},
        False, "'Envs'",
    ),
    "READONLY overrides readOnly": (
        {"mounts": [{"containerPath": "/data", "hostPath": "/srv", "readOnly": True,
                     "READONLY": False}]},
        True, "'READONLY'",
    ),
    "long s folds onto mounts": (
        {"mount\u017f": [{"containerPath": "/tmp/vgpulock", "hostPath": "/evil"}]},
        True, "'mount\u017f'",
    ),
    "snake case in another case": (
        {"mounts": [{"container_path": "/a", "host_path": "/b", "Host_Path": "/evil"}]},
        True, "'Host_Path'",
    ),
}


@pytest.mark.parametrize("case", sorted(SMUGGLED))
def test_case_folding_reader_sees_what_the_patch_meant(case: str) -> None:
    """
    A Go reader folds keys: either the patch refuses the input naming the key, or a
    reader that folds keys as Go does reads exactly what this project wrote.
    On the old code the patch passed these keys through and the Go reader
    saw a writable mount at the broker path, a forged gate or a writable
    mount instead of a read-only one.
    """
    given, enabled, key = SMUGGLED[case]
    try:
        out = patch_json(json.dumps(given), broker_enabled=enabled)
    except AllocationResponseError as e:
        assert key in str(e)
        assert "\n" not in str(e)
        return
    assert go_view(out) == python_view(out), "a Go reader misreads the patched response"


@pytest.mark.parametrize(
    "obj",
    [
        {"foo": 1, "FOO": 2},
        {"mounts": [{"containerPath": "/a", "x": 1, "X": 2}]},
        {"devices": [{"Permissions": "rw"}]},
        {"devices": [{"permi\u017f\u017fions": "rw"}]},
        {"cdiDevices": [{"name": "a", "Name": "b"}]},
        {"CDI_DEVICES": []},
        {"mounts": [{"hostPat\u0127": "/not-a-fold", "containerPath": "/a"}], "ENVS": {}},
    ],
)
def test_keys_equal_under_folding_refused(obj: dict[str, Any]) -> None:
    with pytest.raises(AllocationResponseError, match="case"):
        response_from_object(obj)


def test_accepted_spellings_and_map_keys_are_not_folded() -> None:
    """Envs and annotations are maps (exact keys in Go too): case differences are fine."""
    response = response_from_object({
        "envs": {"A": "1", "a": "2"}, "annotations": {"K": "1", "k": "2"},
        "mounts": [{"container_path": "/x", "hostPath": "/y", "read_only": True}],
        "cdi_devices": [{"name": "vendor.com/dev=1"}],
    })
    assert response.envs == {"A": "1", "a": "2"}
    assert response.mounts == (Mount("/x", "/y", True),)


def test_go_fold_matches_go() -> None:
    """The test's own decoder folds as Go does on the cases that matter."""
    assert go_fold("containerPath") == go_fold("CONTAINERPATH") == "CONTAINERPATH"
    assert go_fold("mount\u017f") == "MOUNTS"
    assert go_fold("\u212aey") == "KEY"
    assert go_fold("ma\u00df") != go_fold("mass")  # no full folding in Go


# JSON that is not JSON, and bounds --------------------------------------------

NOT_JSON = {
    "NaN": '{"x": NaN}',
    "Infinity": '{"x": Infinity}',
    "-Infinity": '{"mounts": [], "x": [-Infinity]}',
    "float out of range": '{"x": 1e400}',
    "huge integer": '{"x": ' + "9" * 5000 + "}",
    "integer over 64 bits": '{"x": 18446744073709551616}',
    "deep nesting": '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "deep objects": '{"a":' * 100 + "1" + "}" * 100,
    "too large": '{"x": "' + "a" * (1024 * 1024) + '"}',
}


@pytest.mark.parametrize("case", sorted(NOT_JSON))
def test_not_json_or_unbounded_is_refused(case: str) -> None:
    with pytest.raises(AllocationResponseError) as caught:
        response_from_json(NOT_JSON[case])
    assert "\n" not in str(caught.value)


def test_bounds_leave_ordinary_numbers_alone() -> None:
    text = json.dumps({"x": [1, -2, 2**63 - 1, 2**64 - 1, -(2**63), 0.5, 1e300],
                       "deep": [[[[[[[[[[[]]]]]]]]]]], "s": "[[[[{{{{" * 100})
    out = json.loads(patch_json(text, broker_enabled=False))
    assert out["x"] == [1, -2, 2**63 - 1, 2**64 - 1, -(2**63), 0.5, 1e300]
    assert out["s"] == "[[[[{{{{" * 100


@pytest.mark.parametrize(
    "case", ["NaN", "-Infinity", "huge integer", "deep nesting", "too large",
             "mount fields in another case", "capitalised Envs and Mounts"],
)
def test_cli_refusals_are_one_line(lock_tree: Path, case: str) -> None:
    """Exit 1, nothing on stdout, one line on stderr: never a traceback."""
    if case in SMUGGLED:
        given, _, key = SMUGGLED[case]
        stdin = json.dumps(given).encode()
    else:
        stdin, key = NOT_JSON[case].encode(), ""
    result = allocate(stdin, "--lock-parent", str(lock_tree / "vgpulock"), gate="1")
    assert (result.returncode, result.stdout) == (1, b""), result.stderr[-300:]
    assert result.stderr.count(b"\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith(b"hostpid: ")
    assert key.encode("utf-8") in result.stderr


@pytest.mark.parametrize("value", ["1e12", "nan", "inf", "-inf", "-1", "0", "x"])
def test_cli_query_timeout_usage_error(value: str) -> None:
    result = subprocess.run(
        hostpid_argv("query", "--socket", "/nonexistent/broker.sock", "--timeout", value),
        env=subprocess_env(LIBVGPU_HOSTPID_BROKER="1"), capture_output=True, text=True,
        timeout=60, check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "--timeout" in result.stderr and "Traceback" not in result.stderr


# Order and host paths ---------------------------------------------------------


def test_mount_inside_the_parent_listed_before_an_ancestor() -> None:
    """A legacy lock file mount before C{/tmp}: both C{/tmp} and the parent would hide it."""
    result = patched(("/tmp/vgpulock/x", "/h"), ("/a", "/1"), ("/tmp", "/scratch"),
                     ("/tmp/vgpulock/y", "/h2"), enabled=True)
    assert result.mounts == (*mounts(("/a", "/1"), ("/tmp", "/scratch")), PARENT, BROKER,
                             *mounts(("/tmp/vgpulock/x", "/h"), ("/tmp/vgpulock/y", "/h2")))


@pytest.mark.parametrize(
    "host_path",
    ["/var/run/hami/hostpid", "/var/run/hami/hostpid/", "//var/run/hami//hostpid",
     "/var/run/hami/hostpid/broker.sock", "/var/run/hami/x/../hostpid"],
)
@pytest.mark.parametrize("enabled", [False, True])
def test_broker_directory_at_another_container_path_removed(host_path: str,
                                                             enabled: bool) -> None:
    result = patched(Mount("/safe", host_path, False), Mount("/ro", host_path, True),
                     ("/keep", "/var/run/hami/hostpidx"), enabled=enabled)
    expected = (PARENT, BROKER) if enabled else (PARENT,)
    assert result.mounts == (*expected, *mounts(("/keep", "/var/run/hami/hostpidx")))


def test_host_paths_by_identity(public_tmp: Path) -> None:
    """Another spelling of the broker directory through a symlink is the broker directory."""
    from hostpid.node.hostpaths import FilesystemHostPaths

    broker = public_tmp / "run" / "hostpid"
    broker.mkdir(parents=True)
    (broker / "broker.sock").write_text("")
    (public_tmp / "alias").symlink_to(broker)
    (public_tmp / "up").symlink_to(public_tmp / "run")
    (public_tmp / "other").mkdir()
    judge = FilesystemHostPaths(str(broker))
    for named in (broker, public_tmp / "alias", public_tmp / "alias" / "broker.sock",
                  public_tmp / "up" / "hostpid", public_tmp / "alias" / "missing"):
        assert judge.names_broker_directory(str(named)), named
    for other in (public_tmp / "other", public_tmp / "run", public_tmp, Path("/")):
        assert not judge.names_broker_directory(str(other)), other
    response = AllocateResponse(mounts=(Mount("/safe", str(public_tmp / "alias"), False),
                                        Mount("/o", str(public_tmp / "other"))))
    result = patch_response(response, broker_enabled=True, broker_directory=str(broker),
                            host_paths=judge)
    assert [m.container_path for m in result.mounts] == ["/tmp/vgpulock",
                                                         "/tmp/vgpulock/hostpid", "/o"]


def test_host_paths_by_identity_through_a_bind_mount(public_tmp: Path) -> None:
    """A second bind mount of the broker directory has no spelling in common with it."""
    require_root()
    broker = public_tmp / "hostpid"
    broker.mkdir()
    (public_tmp / "elsewhere").mkdir()
    script = (
        "import subprocess, sys\n"
        "from hostpid.node.hostpaths import FilesystemHostPaths\n"
        "subprocess.run(['mount', '--make-rprivate', '/'], check=True)\n"
        "subprocess.run(['mount', '--bind', sys.argv[1], sys.argv[2]], check=True)\n"
        "print(FilesystemHostPaths(sys.argv[1]).names_broker_directory(sys.argv[2]))\n"
    )
    result = subprocess.run(
        ["unshare", "--mount", *hostpid_argv()[:1], "-c", script, str(broker),
         str(public_tmp / "elsewhere")],
        env=subprocess_env(), capture_output=True, text=True, timeout=60, check=False,
    )
    assert (result.returncode, result.stdout) == (0, "True\n"), result.stderr


# What an operator sees --------------------------------------------------------


@pytest.mark.parametrize("made", [True, False])
def test_doctor_says_when_there_is_no_broker_mount(made: bool) -> None:
    """
    After a gate-on allocation the mountpoint stays in the lock parent; in a
    container without the broker mount, doctor must say so plainly instead of
    only reporting a missing socket.
    """
    env = subprocess_env()
    env[GATE_ENV] = "1" if made else "0"
    prepare, doctor = (" ".join(map(shlex.quote, hostpid_argv(*a)))
                       for a in (("prepare-lock-parent",), ("doctor",)))
    result, _ = run_with_private_tmp(["/bin/sh", "-c", f"{prepare} >/dev/null && {doctor}"],
                                     env=env)
    assert result.returncode == 1, result.stderr
    first = result.stdout.decode().splitlines()[0]
    if made:
        assert first.startswith("broker-mount FAIL /tmp/vgpulock/hostpid is not a mount point: "
                                "this container's allocation has no broker mount"), first
    else:
        assert first == ("broker-mount FAIL /tmp/vgpulock/hostpid does not exist: this "
                         "container's allocation has no broker mount")


@pytest.mark.parametrize("enabled", [False, True])
def test_cdi_patch_removes_broker_directory_mounts_too(enabled: bool) -> None:
    from hostpid.node.cdi import patch_response_cdi

    response = AllocateResponse(mounts=mounts(("/safe", "/var/run/hami/hostpid/"),
                                              ("/keep", "/srv")))
    result = patch_response_cdi(response, broker_enabled=enabled)
    assert result.mounts == mounts(("/keep", "/srv"))
