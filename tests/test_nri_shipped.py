"""
The NRI plugin's systemd unit (C{deploy/systemd/hostpid-nri.service}), checked
as C{tests/test_deploy.py} checks the broker's.

Why each check exists:

- It runs the plugin as documented (the install's twistd, the runtime's
  default socket, the gate exactly C{1}) and restarts it on failure.
- Root with nothing root brings: no capability, the filesystem read-only but
  the host's C{/tmp} (the lock parent's presence is checked and its broker
  mountpoint repaired); the lock parent prepared before it starts.
- C{systemd-analyze verify} has nothing to say and C{security --offline}
  rates it 2.0 or less.
- The standby unit (C{hostpid-nri-standby.service}, the second instance that
  keeps a crash or an upgrade from leaving containers unadjusted) is the
  same unit at index 91 and metrics port 9397, and stays so.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, require_tool

UNIT = REPO / "deploy" / "systemd" / "hostpid-nri.service"
STANDBY = UNIT.with_name("hostpid-nri-standby.service")


def values(key: str, section: str = "Service") -> list[str]:
    found, current = [], ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            continue
        name, _, value = line.partition("=")
        if current == section and name.strip() == key:
            found.append(value.strip())
    return found


def test_unit_runs_the_plugin_as_documented() -> None:
    (exec_start,) = values("ExecStart")
    argv = shlex.split(exec_start)
    assert argv[:4] == ["/opt/hostpid/venv/bin/twistd", "--nodaemon", "--pidfile=",
                        "hostpid-nri"]
    assert argv[argv.index("--nri-socket") + 1] == "/var/run/nri/nri.sock"
    assert argv[argv.index("--metrics") + 1].endswith("interface=127.0.0.1")
    assert values("Environment") == ["LIBVGPU_HOSTPID_BROKER=1"]
    assert values("Restart") == ["on-failure"]
    # One capability: the broker mountpoint is made immutable (docs/security.md).
    assert values("CapabilityBoundingSet") == ["CAP_LINUX_IMMUTABLE"]
    assert values("NoNewPrivileges") == ["yes"]
    assert values("ProtectSystem") == ["strict"]
    assert values("PrivateTmp") == ["no"]
    # The lock parent prepared before the plugin starts, outside the sandbox, not fatally;
    # /tmp writable for the mountpoint's repair.
    assert values("ExecStartPre") == ["-+/opt/hostpid/venv/bin/hostpid prepare-lock-parent"]
    assert values("ReadWritePaths") == ["/tmp"]
    for forbidden in ("User", "DynamicUser", "PrivateNetwork"):
        assert values(forbidden) == []


def verifiable(tmp_path: Path, unit: Path = UNIT) -> Path:
    twistd = Path(sys.executable).parent / "twistd"
    executable = str(twistd) if twistd.exists() else shutil.which("twistd") or sys.executable
    copy = tmp_path / unit.name
    text = unit.read_text().replace("ExecStart=/opt/hostpid/venv/bin/twistd ",
                                    f"ExecStart={executable} ")
    copy.write_text(text.replace("/opt/hostpid/venv/bin/hostpid ",
                                 f"{Path(executable).parent / 'hostpid'} "))
    return copy


def below_unit_line(text: str) -> str:
    return text[text.index("\n[Unit]\n"):]


def test_the_standby_is_the_same_unit_at_the_next_index() -> None:
    expected = below_unit_line(UNIT.read_text()).replace(
        "(hostpid)\n", "(hostpid), standby\n").replace(
        "hostpid-nri --nri-socket", "hostpid-nri --plugin-index 91 --nri-socket").replace(
        "tcp:9396:", "tcp:9397:")
    assert below_unit_line(STANDBY.read_text()) == expected


@pytest.mark.parametrize("path", [UNIT, STANDBY], ids=["main", "standby"])
def test_unit_passes_systemd_analyze(tmp_path: Path, path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    unit = verifiable(tmp_path, path)
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout + result.stderr == "", \
        result.stdout + result.stderr
    result = subprocess.run([analyze, "security", "--offline=yes", "--threshold=20",
                             "--no-pager", str(unit)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
