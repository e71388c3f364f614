"""
Boot one Debian kernel under QEMU and run one pytest job inside it.

The guest's root is this machine's C{/}, shared read-only over 9p
(C{-virtfs ... readonly=on}) and covered by a tmpfs overlay in the guest,
so the guest runs this worktree's own C{.venv} and tools and writes only
to its own memory; results come back over a second, writable 9p share
(the job directory).  KVM on this machine cannot boot a stock kernel, so
the CPU is emulated (TCG): 8-13x slower, which the tests inside absorb
through C{HOSTPID_TIME_SCALE} (see L{support.time_scale}).

A loaded machine slows the emulation further (a guest beside a cold
Kubernetes build booted in 67 s instead of 5, and a 3-minute subset took 17),
so no bound here is on the clock alone.  A VM is capped by its progress: the
CPU seconds its QEMU has used (L{run}'s C{budget}), which load delays but
does not use up, and it is killed early only when it has stalled (no CPU
used and nothing written for L{STALL_SECONDS}).  The caps the guest keeps by
its own clock (its per-test cap, its pytest's timeout) are multiplied by the
load factor measured as the VM starts (tests/load.py).  Its tests' timing
bounds keep the emulation's L{TIME_SCALE}: the tests also wait for multiples
of it (an attacker's linger, a deadline to pass), so a scale multiplied by the
load would make every guest that many times longer; a cold run's guests
passed their tests at 12 beside a Kubernetes build, and failed only their
boot bound and their wall-clock cap.  Boot time is measured and reported,
never a pass/fail bound.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import attrs
import load

from kernels import initramfs
from kernels.debian import CACHE, UnpackedKernel

#: The emulated machine (what boots a stock Debian kernel here).
QEMU_MACHINE = ("-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2", "-m", "2G")

#: How much slower than this machine the emulated one runs the tests'
#: timing bounds (measured 8-13x); the guest gets it as HOSTPID_TIME_SCALE.
TIME_SCALE = 12

#: One guest test may take this many real seconds, on a quiet machine, before
#: the guest's pytest stops with a line naming it (tests/budget.py's cap, given
#: to the guest times the load factor and divided by the time scale, which it
#: multiplies back): the slowest guest tests take under a minute, and a hung
#: one must not cost the VM's whole budget.
GUEST_TEST_CAP = 300.0

#: A VM's default budget: the CPU seconds its QEMU may use (L{run}).
DEFAULT_BUDGET = 900.0

#: A VM whose QEMU has used less than L{STALL_CPU} CPU seconds, and whose job
#: directory has not changed, over this many seconds of wall time has
#: stalled (a guest kernel hung idle) and is killed.  A loaded machine slows
#: a guest but does not stop it: QEMU still gets a share of a core.
STALL_SECONDS = 600.0
STALL_CPU = 1.0

#: How often L{run} looks at QEMU's progress.
POLL_SECONDS = 2.0

#: QEMU's niceness (below the host's own tests), at which the load is measured.
NICENESS = 10

#: The guest's PID 1 after switch_root, seen through the overlay.
STAGE2 = Path(__file__).resolve().with_name("guest-init.sh")

#: Run by a guest whose job asks for it, after its tests.
CANARY_SCRIPT = Path(__file__).resolve().with_name("guest_canary.py")

#: What must not change about the host's lock parent (same as tests/conftest.py).
HOST_LOCK_PARENT = "/tmp/vgpulock"


def host_lock_parent_state() -> tuple[int, ...] | None:
    try:
        st = os.lstat(HOST_LOCK_PARENT)
    except FileNotFoundError:
        return None
    return (st.st_mode, st.st_uid, st.st_gid, st.st_dev, st.st_ino, st.st_mtime_ns)


@attrs.frozen
class TestOutcome:
    """One guest test's result, from its junit record."""

    nodeid: str
    outcome: str  # "passed", "failed", "not applicable", "skipped"
    message: str = ""


@attrs.frozen
class GuestRun:
    """What one VM run produced."""

    package: str
    release: str
    returncode: int | None
    pytest_rc: int | None
    features: dict[str, dict[str, object]]
    outcomes: tuple[TestOutcome, ...]
    boot_seconds: float | None
    test_seconds: float | None
    wall_seconds: float
    job: Path
    #: Set when the host's /tmp/vgpulock differed after the run (before -> after).
    host_lock_parent_changed: str | None = None
    #: The canary's exit status and output, where the job ran it (L{run}'s C{canary}).
    canary_rc: int | None = None
    canary_log: str = ""
    #: The CPU seconds QEMU used in all, and by the time the guest had booted.
    cpu_seconds: float | None = None
    boot_cpu_seconds: float | None = None
    #: The load factor the guest's clock-based caps were multiplied by.
    load_factor: float = 1.0
    #: Why the host killed the VM (its budget used up, or stalled), else C{None}.
    stopped: str | None = None

    def count(self, outcome: str) -> int:
        return sum(1 for result in self.outcomes if result.outcome == outcome)

    def failed(self) -> list[TestOutcome]:
        return [result for result in self.outcomes if result.outcome == "failed"]

    def summary(self) -> str:
        boot = "?" if self.boot_seconds is None else f"{self.boot_seconds:.1f}"
        boot_cpu = "?" if self.boot_cpu_seconds is None else f"{self.boot_cpu_seconds:.0f}"
        tests = "?" if self.test_seconds is None else f"{self.test_seconds:.0f}"
        cpu = "?" if self.cpu_seconds is None else f"{self.cpu_seconds:.0f}"
        return (
            f"{self.release}: {self.count('passed')} passed, "
            f"{self.count('not applicable')} not applicable, {self.count('failed')} failed, "
            f"{self.count('skipped')} skipped; boot {boot} s ({boot_cpu} CPU s), "
            f"tests {tests} s, wall {self.wall_seconds:.0f} s, QEMU {cpu} CPU s, "
            f"load factor {self.load_factor:g}"
        )

    def console(self) -> str:
        return _read(self.job / "console.log")

    def pytest_log(self) -> str:
        return _read(self.job / "pytest.log")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


N = TypeVar("N", int, float)


def _number(path: Path, kind: Callable[[str], N]) -> N | None:
    """The number a guest wrote to C{path} (an exit status, an uptime), or C{None}."""
    try:
        return kind(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def parse_junit(path: Path) -> tuple[TestOutcome, ...]:
    """
    Outcomes from pytest's junit XML.  A skip whose message begins
    C{not applicable:} is the kernel-feature plugin's outcome
    (tests/kernelfeatures.py), counted apart from a plain skip.
    """
    try:
        tree = ElementTree.parse(path)
    except (FileNotFoundError, ElementTree.ParseError):
        return ()
    outcomes = []
    for case in tree.iter("testcase"):
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "")
                break
            if child.tag == "skipped":
                message = child.get("message", "")
                applicable = "not applicable:" not in message
                outcome = "skipped" if applicable else "not applicable"
        outcomes.append(TestOutcome(nodeid, outcome, message))
    return tuple(outcomes)


def qemu_argv(unpacked: UnpackedKernel, initrd: Path, job: Path) -> list[str]:
    return [
        # Killed with the process that started it (a run stopped by the per-test
        # cap, tests/budget.py, or by hand), and below the host's own tests.
        "setpriv", "--pdeathsig", "KILL", "nice", "-n", str(NICENESS),
        "qemu-system-x86_64", *QEMU_MACHINE,
        "-nodefaults", "-no-reboot", "-display", "none",
        "-serial", f"file:{job / 'console.log'}",
        "-device", "virtio-rng-pci",
        "-kernel", str(unpacked.image), "-initrd", str(initrd),
        "-append", f"console=ttyS0 panic=-1 loglevel=4 hostpid_stage2={STAGE2}",
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={job},mount_tag=job,security_model=passthrough",
    ]


def cpu_seconds(pid: int) -> float | None:
    """The user and system CPU seconds of process C{pid}'s threads, or C{None} once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # utime and stime are the 14th and 15th fields; the 3rd is the first after ")".
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _latest_change(job: Path) -> int:
    """The newest modification time of anything in the job directory (the guest's writes)."""
    return max((entry.stat().st_mtime_ns for entry in job.iterdir()), default=0)


@attrs.frozen
class _Watch:
    """What L{_watch} saw of one QEMU: its CPU time, at boot and in all, and why it stopped it."""

    cpu: float | None
    boot_cpu: float | None
    stopped: str | None


def _watch(process: subprocess.Popen[bytes], job: Path, budget: float,
           stall: float = STALL_SECONDS, poll: float = POLL_SECONDS) -> _Watch:
    """
    Wait for QEMU to exit, killing it when it has used C{budget} CPU
    seconds, or when it has stalled: less than L{STALL_CPU} CPU seconds
    used and nothing written to C{job} for C{stall} seconds of wall time.
    """
    used: float | None = 0.0
    boot_cpu = None
    progress_cpu, progress_change = 0.0, _latest_change(job)
    progress_at = time.monotonic()
    while True:
        try:
            process.wait(timeout=poll)
            return _Watch(used, boot_cpu, None)
        except subprocess.TimeoutExpired:
            pass
        now_used = cpu_seconds(process.pid)
        if now_used is not None:
            used = now_used
        if boot_cpu is None and (job / "booted-at").exists():
            boot_cpu = used
        change = _latest_change(job)
        if (used or 0.0) - progress_cpu >= STALL_CPU or change != progress_change:
            progress_cpu, progress_change = used or 0.0, change
            progress_at = time.monotonic()
        stopped = None
        if (used or 0.0) > budget:
            stopped = f"QEMU used its budget of {budget:.0f} CPU seconds"
        elif time.monotonic() - progress_at > stall:
            stopped = (f"stalled: under {STALL_CPU:g} CPU second used and nothing written "
                       f"for {stall:.0f} s")
        if stopped is not None:
            process.kill()
            process.wait()
            return _Watch(used, boot_cpu, stopped)


def initrd(unpacked: UnpackedKernel, cache: Path = CACHE) -> Path:
    """The guest's initramfs for C{unpacked}, built (once, and again when its maker changes)."""
    path = cache / "initramfs" / f"{unpacked.root.name}.cpio"
    if not path.is_file() or path.stat().st_mtime < Path(initramfs.__file__).stat().st_mtime:
        initramfs.build(unpacked, path)
    return path


def run(
    unpacked: UnpackedKernel,
    pytest_args: Sequence[str],
    worktree: Path,
    budget: float = DEFAULT_BUDGET,
    cache: Path = CACHE,
    init: str = "script",
    canary: bool = False,
) -> GuestRun:
    """
    Boot C{unpacked}, run C{pytest pytest_args} in C{worktree} as root inside,
    and collect the results.  The VM is killed once its QEMU has used
    C{budget} CPU seconds, or when it has stalled (L{_watch}); the guest's own
    pytest has a timeout on the guest's clock, twice the budget times the load
    factor, a backstop that the host's cap comes before.

    @param init: C{"script"}: the job runs under the guest's own small init
        (C{guest-init.sh}); C{"systemd"}: under the host's systemd as PID 1,
        as a service of its own, so that the job can drive real units.
    @param canary: after the tests, the guest runs tests/kernels/guest_canary.py,
        which writes where the host must not see it.
    """
    image = initrd(unpacked, cache)
    runs = cache / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    job = runs / f"{unpacked.release}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    shutil.rmtree(job, ignore_errors=True)
    job.mkdir()
    python = worktree / ".venv" / "bin" / "python"
    factor = load.factor(NICENESS)
    (job / "job.env").write_text(
        f"WORKTREE={shlex.quote(str(worktree))}\n"
        f"PYTHON={shlex.quote(str(python))}\n"
        f"PYTEST_ARGS={shlex.quote(shlex.join(pytest_args))}\n"
        f"TIME_SCALE={TIME_SCALE}\n"
        f"TEST_CAP={GUEST_TEST_CAP * factor / TIME_SCALE:g}\n"
        f"GUEST_TIMEOUT={max(60, int(2 * budget * factor))}\n"
        f"INIT={shlex.quote(init)}\n"
        f"CANARY={shlex.quote(str(CANARY_SCRIPT)) if canary else ''}\n"
        # HOSTPID_REPEAT (tests/budget.py) reaches the guest's pytest, so that a
        # flake is hunted on the kernel that showed it (tests/kernels/run.py).
        f"REPEAT={shlex.quote(os.environ.get('HOSTPID_REPEAT', '') or '1')}\n"
    )
    lock_parent_before = host_lock_parent_state()
    started = time.monotonic()
    with (job / "qemu.log").open("wb") as log:
        process = subprocess.Popen(
            qemu_argv(unpacked, image, job), stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            watched = _watch(process, job, budget)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    returncode = None if watched.stopped else process.returncode
    wall = time.monotonic() - started
    lock_parent_after = host_lock_parent_state()
    booted, began, ended = (
        _number(job / name, float) for name in ("booted-at", "tests-started-at", "tests-ended-at")
    )
    try:
        features = json.loads((job / "features.json").read_text())
    except (FileNotFoundError, ValueError):
        features = {}
    pytest_rc, canary_rc = (_number(job / name, int) for name in ("pytest.rc", "canary.rc"))
    return GuestRun(
        package=unpacked.package,
        release=_read(job / "uname").strip() or unpacked.release,
        returncode=returncode,
        pytest_rc=pytest_rc,
        features=features,
        outcomes=parse_junit(job / "junit.xml"),
        boot_seconds=booted,
        test_seconds=None if began is None or ended is None else ended - began,
        wall_seconds=wall,
        job=job,
        host_lock_parent_changed=None
        if lock_parent_after == lock_parent_before
        else f"{lock_parent_before} -> {lock_parent_after}",
        canary_rc=canary_rc,
        canary_log=_read(job / "canary.log"),
        cpu_seconds=watched.cpu,
        boot_cpu_seconds=watched.boot_cpu,
        load_factor=factor,
        stopped=watched.stopped,
    )
