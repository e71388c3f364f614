"""
The shipped units (deploy/systemd) under a real systemd: run only inside the
guest that boots the host's systemd as PID 1 (tests/kernels/test_systemd.py
starts it; its name does not match C{test_*.py}, so no other run collects it).

What the service manager's double (tests/servicemanager.py) plays elsewhere
is done here by systemd itself: C{hostpid-broker.socket} binds the socket and
passes it on every start, the broker stores its own listener (C{FDSTORE=1})
when it bound it, C{systemctl restart} and a crash with C{Restart=on-failure}
give it back, C{systemctl reload} hands it over to a new broker and follows
C{MAINPID=}, and C{Type=notify} makes C{systemctl start} return once the
broker listens.  The units are used as shipped, with one drop-in (below).

Timing is not judged here: the CPU is emulated (8-13x slower), so a start
takes seconds against a client's 0.5 s deadline.  What is judged is what
does not depend on speed: no client ever finds the socket gone or refused,
none gets a wrong PID, the socket's inode never changes, and each restart
is a new broker process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from continuity import assert_never_gone, continuous_load
from support import REPO, ask_pid, scaled, wait_for

UNITS = REPO / "deploy" / "systemd"
UNIT_DIR = Path("/etc/systemd/system")
SERVICE = "hostpid-broker.service"
SOCKET_UNIT = "hostpid-broker.socket"
SOCKET = Path("/run/hami/hostpid/broker.sock")
#: The prefix the unit's ExecStart names: this worktree's environment is put there.
PREFIX = Path("/opt/hostpid/venv")
LOG = Path("/run/hostpid-broker.log")
RESTARTS = 3
RELOADS = 3
#: A client every 50 ms: the emulated machine forks ten times slower.
INTERVAL_US = 50_000

#: Where the unit's own lock parent preparation is pointed here: the suite's
#: guard of C{/tmp/vgpulock} (tests/conftest.py) holds in the guest too, so
#: the shipped C{ExecStartPre=} runs as shipped but for its C{--path}.
LOCK_PARENT = Path("/run/hostpid-guest-vgpulock")


def shipped_exec_start_pre() -> str:
    """The service's one C{ExecStartPre=} line, as shipped."""
    (line,) = [line for line in (UNITS / SERVICE).read_text().splitlines()
               if line.startswith("ExecStartPre=")]
    return line


#: The one drop-in.  The interpreter of this machine's environments lives
#: under /root, which the unit's ProtectHome=yes makes inaccessible; the
#: guest runs no journald, so the broker's output goes to a file the tests
#: read; the lock parent it prepares is L{LOCK_PARENT}.
DROP_IN = f"""\
[Service]
ProtectHome=read-only
StandardOutput=append:/run/hostpid-broker.log
StandardError=inherit
ExecStartPre=
{shipped_exec_start_pre()} --path {LOCK_PARENT}
"""


def run_systemctl(*args: str) -> subprocess.CompletedProcess[str]:
    """C{systemctl ARGS}, whatever its status."""
    return subprocess.run(
        ["systemctl", *args], capture_output=True, text=True, timeout=scaled(30), check=False
    )


def systemctl(*args: str) -> str:
    """C{systemctl ARGS}, which must succeed; its output."""
    done = run_systemctl(*args)
    assert done.returncode == 0, f"systemctl {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout.strip()


def reset_start_limit() -> None:
    """
    Count the service's starts afresh against StartLimitBurst=5 in 60 s
    (C{reset-failed} also resets that count; it fails on a unit not loaded
    yet, which has no count to reset).
    """
    run_systemctl("reset-failed", SERVICE)


def active() -> bool:
    """Whether the service is active (not activating, deactivating or failed)."""
    return run_systemctl("is-active", SERVICE).stdout.strip() == "active"


def main_pid() -> int:
    return int(systemctl("show", "--property=MainPID", "--value", SERVICE))


def broker_log() -> str:
    try:
        return LOG.read_text(errors="replace")
    except FileNotFoundError:
        return ""


@pytest.fixture(scope="module")
def installed() -> Iterator[None]:
    """The units installed as the operations guide says, and daemon-reloaded."""
    assert Path("/proc/1/comm").read_text().strip() == "systemd", "PID 1 must be systemd"
    PREFIX.parent.mkdir(parents=True, exist_ok=True)
    if not PREFIX.exists():
        PREFIX.symlink_to(Path(sys.prefix))
    # Twisted's plugin cache, written once as root before the read-only service runs.
    subprocess.run([str(PREFIX / "bin" / "twistd"), "--help"], capture_output=True, check=True)
    for unit in (SERVICE, SOCKET_UNIT):
        shutil.copy(UNITS / unit, UNIT_DIR / unit)
    drop_ins = UNIT_DIR / f"{SERVICE}.d"
    drop_ins.mkdir(exist_ok=True)
    (drop_ins / "guest.conf").write_text(DROP_IN)
    systemctl("daemon-reload")
    yield
    run_systemctl("stop", SERVICE, SOCKET_UNIT)


def restarts_under_load(hamiload: Path) -> tuple[dict[str, object], list[int]]:
    """L{RESTARTS} times C{systemctl restart} under load; the report and the brokers' PIDs."""
    original = os.stat(SOCKET).st_ino
    pids = [main_pid()]
    report: dict[str, object] = {}
    with continuous_load(hamiload, SOCKET, report, interval_us=INTERVAL_US):
        for _ in range(RESTARTS):
            systemctl("restart", SERVICE)
            assert active()
            pids.append(main_pid())
            assert os.stat(SOCKET).st_ino == original, "the same socket throughout"
    assert ask_pid(SOCKET) == os.getpid()
    return report, pids


def crash_under_load(hamiload: Path) -> dict[str, object]:
    """SIGKILL the broker under load; systemd restarts it (Restart=on-failure, RestartSec=1s)."""
    original, crashed = os.stat(SOCKET).st_ino, main_pid()
    reset_start_limit()
    report: dict[str, object] = {}
    with continuous_load(hamiload, SOCKET, report, interval_us=INTERVAL_US):
        systemctl("kill", "--signal=KILL", SERVICE)
        wait_for(
            lambda: main_pid() not in (0, crashed) and active(),
            "systemd to restart the broker after SIGKILL", timeout=scaled(60),
        )
        assert ask_pid(SOCKET) == os.getpid()
    assert os.stat(SOCKET).st_ino == original, "the same socket after the crash"
    return report


def stored() -> str:
    """How many descriptors systemd holds in the service's store."""
    return systemctl("show", "--property=NFileDescriptorStore", "--value", SERVICE)


def restarts_and_a_crash(hamiload: Path, how: str) -> None:
    """
    L{RESTARTS} restarts, then a crash, under load: each a new broker, and
    no client finds the socket gone or refused or gets a wrong PID.
    """
    report, pids = restarts_under_load(hamiload)
    print(f"{how}, {RESTARTS} restarts under real systemd: {report}")
    assert len(set(pids)) == RESTARTS + 1, f"a new broker each time: {pids}"
    assert_never_gone(report)
    crash = crash_under_load(hamiload)
    print(f"{how}, SIGKILL and Restart=on-failure under real systemd: {crash}")
    assert_never_gone(crash)


def systemd_version() -> int:
    """The running systemd's version (C{systemctl --version}: C{systemd 252 (...)})."""
    return int(systemctl("--version").split()[1])


def test_socket_activation_keeps_the_socket_across_restarts_and_a_crash(
    installed: None, hamiload: Path
) -> None:
    reset_start_limit()
    systemctl("start", SOCKET_UNIT, SERVICE)
    assert active(), "Type=notify: started means listening"
    assert ask_pid(SOCKET) == os.getpid()
    restarts_and_a_crash(hamiload, "socket activation")
    log = broker_log()
    assert log.count("listener passed by systemd") == RESTARTS + 2, log[-4000:]
    assert "told systemd READY=1" in log, log[-4000:]
    systemctl("stop", SERVICE)
    assert systemctl("show", "--property=Result", "--value", SERVICE) == "success", (
        "SIGTERM's status 143 is a clean stop (SuccessExitStatus=143)"
    )
    systemctl("stop", SOCKET_UNIT)
    assert not SOCKET.exists(), "RemoveOnStop=yes: the socket unit removes what it bound"


def reload_once(old: int) -> int:
    """C{systemctl reload}; the new main PID, once the old broker has exited."""
    systemctl("reload", SERVICE)
    try:
        wait_for(lambda: main_pid() not in (0, old), "systemd to follow MAINPID=",
                 timeout=scaled(20))
        wait_for(lambda: not Path(f"/proc/{old}").exists(), f"PID {old} to exit",
                 timeout=scaled(20))
    except AssertionError as e:
        raise AssertionError(f"{e}\n{broker_log()[-4000:]}") from None
    assert active(), broker_log()[-4000:]
    return main_pid()


def test_the_unit_prepares_the_lock_parent(installed: None) -> None:
    """
    The shipped C{ExecStartPre=} (pointed at L{LOCK_PARENT}) prepares the
    lock parent, root's 01777, and, with the unit's gate on, its broker
    mountpoint, root's 0755, before the broker starts: on a node without
    the chart nothing else makes them.
    """
    reset_start_limit()
    systemctl("restart", SERVICE)
    wait_for(active, "the service to be active", scaled(60))
    lock_parent = os.lstat(LOCK_PARENT)
    assert (lock_parent.st_uid, oct(lock_parent.st_mode)) == (0, oct(0o41777))
    mountpoint = os.lstat(LOCK_PARENT / "hostpid")
    assert (mountpoint.st_uid, oct(mountpoint.st_mode)) == (0, oct(0o40755))


def test_reload_hands_over_without_a_gap(installed: None, hamiload: Path) -> None:
    """
    C{systemctl reload} (C{ExecReload=}: SIGHUP) under load: each time a new
    broker takes the socket over, systemd follows C{MAINPID=} to it, the old
    one exits, and the unit stays active throughout without a restart; a
    restart afterwards still finds the socket systemd keeps.
    """
    reset_start_limit()
    systemctl("start", SOCKET_UNIT, SERVICE)
    original, pids = os.stat(SOCKET).st_ino, [main_pid()]
    report: dict[str, object] = {}
    with continuous_load(hamiload, SOCKET, report, interval_us=INTERVAL_US):
        for _ in range(RELOADS):
            pids.append(reload_once(pids[-1]))
            assert os.stat(SOCKET).st_ino == original, "the same socket throughout"
        assert ask_pid(SOCKET) == os.getpid()
    print(f"{RELOADS} reloads under real systemd: {report}")
    log = broker_log()
    assert log.count("handed over to PID") == RELOADS, log[-4000:]
    assert "reload failed" not in log, log[-4000:]
    assert log.count("told systemd MAINPID=") == RELOADS, log[-4000:]
    assert systemctl("show", "--property=NRestarts", "--value", SERVICE) == "0"
    assert_never_gone(report)
    # A restart after reloads: the broker that took over knows systemd keeps
    # the socket, leaves it in place at its stop, and the next start has it.
    systemctl("restart", SERVICE)
    assert active() and os.stat(SOCKET).st_ino == original, broker_log()[-4000:]
    assert ask_pid(SOCKET) == os.getpid()
    pids.append(main_pid())
    systemctl("stop", SERVICE, SOCKET_UNIT)
    assert systemctl("show", "--property=Result", "--value", SERVICE) == "success", (
        systemctl("show", "--property=ExecMainCode", "--property=ExecMainStatus", SERVICE)
        + "\n" + broker_log()[-3000:]
    )
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), pids


def test_the_descriptor_store_is_used_where_systemd_offers_one(
    installed: None, hamiload: Path
) -> None:
    """
    Without the socket unit (uninstalled: the service's Wants= would start it).
    systemd 254 and later say the store exists (C{$FDSTORE}): the broker
    stores its listener, and restarts and a crash keep the socket.  Before
    254 nothing says so, and the broker stores nothing (as documented: the
    socket unit is what keeps the socket there); it then removes its socket
    when it stops, as a broker without systemd does.
    """
    systemctl("stop", SERVICE, SOCKET_UNIT)
    # Uninstalled: a runtime mask would not do, since the unit under /etc wins over /run.
    (UNIT_DIR / SOCKET_UNIT).unlink()
    systemctl("daemon-reload")
    try:
        reset_start_limit()
        systemctl("start", SERVICE)
        assert ask_pid(SOCKET) == os.getpid()
        if systemd_version() < 254:
            assert stored() == "0"
            assert "listener stored with systemd" not in broker_log(), broker_log()[-4000:]
            systemctl("stop", SERVICE)
            assert not SOCKET.exists(), (
                f"removed by the broker that bound it: {broker_log()[-3000:]}"
            )
            return
        wait_for(lambda: stored() == "1",
                 "the broker's listener in systemd's descriptor store (FDSTORE=1)")
        restarts_and_a_crash(hamiload, "descriptor store")
    finally:
        run_systemctl("stop", SERVICE)
        shutil.copy(UNITS / SOCKET_UNIT, UNIT_DIR / SOCKET_UNIT)
        systemctl("daemon-reload")
