"""
The matrix's own parts, on this machine: the apt sources it copies, the
package it picks, the kernel-feature plugin's outcomes (a real pytest run
in a subprocess, its junit read back the way the matrix reads a guest's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, subprocess_env

from kernels import debian, initramfs, matrix, vm

DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


def test_the_private_source_copies_the_machines_with_only_the_suite_changed(
    tmp_path: Path,
) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(DEB822)
    source = debian.machine_source(tmp_path, codename="bookworm")
    assert source.line("trixie-backports") == (
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
        "http://mirror.example/debian trixie-backports main contrib\n"
    )


def test_a_one_line_sources_list_is_read_too(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# comment\n"
        "deb http://security.example/debian-security bookworm-security main\n"
        "deb [arch=amd64 signed-by=/etc/k.gpg] http://mirror.example/debian bookworm main\n"
    )
    source = debian.machine_source(tmp_path, codename="bookworm")
    assert source == debian.AptSource(("http://mirror.example/debian",), ("main",), "/etc/k.gpg")


def test_no_source_for_the_machines_release_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb http://m.example/debian bullseye main\n")
    with pytest.raises(RuntimeError, match="bookworm"):
        debian.machine_source(tmp_path, codename="bookworm")


def test_the_standard_flavour_of_the_series_is_chosen() -> None:
    names = [
        "linux-image-6.16.3+deb13-amd64", "linux-image-6.16.12+deb13-amd64",
        "linux-image-6.16.12+deb13-cloud-amd64", "linux-image-6.16.12+deb13-rt-amd64",
        "linux-image-6.17.13+deb13-amd64", "linux-image-6.16.12+deb13-amd64-dbg",
        "linux-image-6.16.12+deb13-amd64-unsigned",
    ]
    assert debian.standard_flavour("6.16", names) == "linux-image-6.16.12+deb13-amd64"
    assert debian.standard_flavour("5.10", ["linux-image-5.10.0-32-amd64-unsigned",
                                            "linux-image-5.10.0-30-amd64-unsigned"]) == (
        "linux-image-5.10.0-32-amd64-unsigned"
    )
    assert debian.standard_flavour("6.1", ["linux-image-6.12.95+deb12-amd64"]) is None


def test_module_dependencies_come_from_modinfo() -> None:
    image = b"\x7fELF...\0license=GPL\0depends=netfs,9pnet\0intree=Y\0"
    assert initramfs._depends(image) == ["netfs", "9pnet"]
    assert initramfs._depends(b"\0depends=\0name=virtio\0") == []


def test_the_initramfs_is_a_newc_archive() -> None:
    archive = initramfs._newc([("init", 0o100755, b"#!/bin/sh\n", 0)])
    assert archive.startswith(b"070701")
    assert b"init\0" in archive and b"TRAILER!!!\0" in archive
    assert len(archive) % 4 == 0


PLUGIN_TESTS = '''
import kernelfeatures, pytest
kernelfeatures.PROBES["ABSENT_HERE"] = lambda: (False, "test probe: absent")
kernelfeatures.PROBES["PRESENT_HERE"] = lambda: (True, "test probe: present")

def broken():
    raise kernelfeatures.ProbeError("EIO: the kernel said something else")
kernelfeatures.PROBES["BROKEN"] = broken

@pytest.mark.kernel_feature("ABSENT_HERE")
def test_needs_absent():
    raise AssertionError("never runs")

@pytest.mark.kernel_feature("PRESENT_HERE")
def test_needs_present():
    pass

@pytest.mark.kernel_feature("PRESENT_HERE")
def test_fakes_not_applicable():
    pytest.skip("not applicable: PRESENT_HERE absent on a kernel it is present on")

@pytest.mark.kernel_feature("BROKEN")
def test_probe_error():
    pass
'''


def test_absent_feature_is_not_applicable_and_only_the_probe_may_say_so(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_plugin_cases.py").write_text(PLUGIN_TESTS)
    junit = tmp_path / "junit.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "kernelfeatures", "-p", "no:cacheprovider",
         f"--rootdir={tmp_path}", f"--junitxml={junit}", str(tmp_path)],
        env=subprocess_env(
            PYTHONPATH=f"{REPO}:{REPO / 'tests'}", HOSTPID_REQUIRE_PRIVILEGED="1"
        ),
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert "1 not applicable" in result.stdout, result.stdout
    assert "not applicable: ABSENT_HERE absent on " in result.stdout
    outcomes = {o.nodeid.rsplit("::", 1)[1]: o.outcome for o in vm.parse_junit(junit)}
    assert outcomes == {
        "test_needs_absent": "not applicable",
        "test_needs_present": "passed",
        "test_fakes_not_applicable": "failed",
        "test_probe_error": "failed",
    }, result.stdout
    assert "only the probe may declare a test not applicable" in result.stdout
    assert "probing kernel feature BROKEN failed: EIO" in result.stdout
    run = vm.GuestRun(
        package="linux-image-test", release="6.0-test", returncode=0, pytest_rc=1, features={},
        outcomes=vm.parse_junit(junit), boot_seconds=1.0, test_seconds=1.0, wall_seconds=2.0,
        job=tmp_path,
    )
    said = matrix.problem(run)
    assert said is not None and said.startswith("2 failed on 6.0-test: "), said
    # What failed and why, since the guest's job directory stays on the machine that ran it.
    assert "test_probe_error: " in said and "EIO" in said, said


def test_the_docs_table_is_made_from_the_recorded_probes(tmp_path: Path) -> None:
    from kernels import doctable

    (tmp_path / "results").mkdir()
    features = {
        "SO_PASSRIGHTS": {"present": False, "detail": "setsockopt: ENOPROTOOPT"},
        "SO_PEERPIDFD": {"present": True, "detail": "getsockopt returns a pidfd"},
        "SO_PEERPIDFD_REAPED": {"present": False, "detail": "getsockopt: EINVAL"},
        "UNIX_OOB": {"present": True, "detail": "send MSG_OOB accepted"},
        "pidfd_open": {"present": True, "detail": ""},
        "pidfd_send_signal": {"present": True, "detail": ""},
        "PIDFD_GET_INFO": {"present": False, "detail": "ioctl: ENOTTY"},
    }
    summary = {
        "release": "6.12.95+deb12-amd64", "package": "linux-image-6.12.95+deb12-amd64",
        "features": features, "passed": 60, "not_applicable": 5, "failed": 1,
        "boot_seconds": 6.04, "test_seconds": 301.2, "problem": None,
    }
    (tmp_path / "results" / "6.12-bookworm-backports.json").write_text(json.dumps(summary))
    document = tmp_path / "kernels.md"
    document.write_text(f"before\n{doctable.BEGIN}\nstale\n{doctable.END}\nafter\n")
    doctable.write(document, tmp_path)
    text = document.read_text()
    assert "stale" not in text and text.startswith("before\n") and text.endswith("after\n")
    (row,) = [line for line in text.splitlines() if line.startswith("| 6.12.95")]
    assert row == (
        "| 6.12.95+deb12-amd64 (bookworm-backports, `linux-image-6.12.95+deb12-amd64`) "
        "| `received` | `SO_PEERPIDFD` | no (getsockopt: EINVAL) | yes | yes/yes "
        "| no (ioctl: ENOTTY) | 60 passed, 5 not applicable, 1 failed; boot 6.0 s, tests 301 s |"
    )
    assert "| 5.10 (bullseye) | not run |" in text
    features["SO_PEERPIDFD"] = {"present": False, "detail": "getsockopt: ENOPROTOOPT"}
    (tmp_path / "results" / "6.12-bookworm-backports.json").write_text(json.dumps(summary))
    assert "| `received` | `pidfd_open` and start time |" in doctable.table(tmp_path)


def test_background_guests_run_two_at_a_time_and_a_lone_one_after_the_rest() -> None:
    """
    tests/kernels/schedule.py's pool, with real threads and jobs that only
    say when they run: one at a time until it is widened (the first job
    waits, and no second starts within half a second), then never more than
    two at once, every job before the one marked C{alone} has ended when it
    starts, nothing runs beside it, and each result goes to its own job (an
    error too).
    """
    import threading

    from kernels import schedule

    kernels = [debian.Kernel(str(n), "test") for n in range(6)]
    jobs = [schedule.GuestJob(k, ("-q",), 1.0) for k in kernels[:5]]
    lone = schedule.GuestJob(kernels[5], ("-q",), 1.0, init="systemd", alone=True)
    lock = threading.Lock()
    running: set[schedule.GuestJob] = set()
    seen: list[tuple[str, frozenset[schedule.GuestJob]]] = []
    ended: list[schedule.GuestJob] = []
    second_started = threading.Event()
    first_may_end = threading.Event()
    # After the first, each pair of jobs meets here: both run at once, or the test fails.
    pair = threading.Barrier(2, timeout=10)

    def runner(job: schedule.GuestJob) -> vm.GuestRun:
        with lock:
            running.add(job)
            seen.append((job.kernel.series, frozenset(running)))
            if len(seen) == 2:
                second_started.set()
        if job is jobs[0]:
            assert first_may_end.wait(10)
        elif not job.alone:
            pair.wait()
        with lock:
            running.discard(job)
            ended.append(job)
        if job is jobs[2]:
            raise RuntimeError("no such kernel")
        return vm.GuestRun(job.kernel.series, "", 0, 0, {}, (), None, None, 0.0, Path("/"))

    background = schedule.Background([lone, *jobs], runner=runner, warmer=lambda: None)
    background.start()
    assert not second_started.wait(0.5), f"a second guest ran before the host's tests ended: {seen}"
    background.widen()
    assert second_started.wait(10), seen
    first_may_end.set()
    assert background.result(jobs[0]).package == "0"
    with pytest.raises(RuntimeError, match="no such kernel"):
        background.result(jobs[2])
    assert background.result(lone).package == "5"
    assert max(len(beside) for _, beside in seen) == 2, seen
    assert [len(beside) for _, beside in seen].count(2) >= 2, seen
    (lone_seen,) = [beside for series, beside in seen if series == "5"]
    assert lone_seen == {lone}, seen
    assert ended[-1] is lone and set(ended[:-1]) == set(jobs)


def test_a_vm_is_capped_by_the_cpu_it_uses_not_the_clock(tmp_path: Path) -> None:
    """
    QEMU's cap is its progress, the CPU seconds its threads use: a busy
    process (QEMU's part) is stopped once it has used its budget, whatever
    the clock says, and the CPU it used is reported.
    """
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        watched = vm._watch(busy, tmp_path, budget=0.5, poll=0.1)
    finally:
        busy.kill()
        busy.wait()
    assert watched.stopped is not None and watched.stopped.startswith("QEMU used its budget"), (
        watched)
    assert watched.cpu is not None and watched.cpu > 0.5


def test_a_slow_vm_runs_on_and_a_stalled_one_is_stopped(tmp_path: Path) -> None:
    """
    A guest that uses almost no CPU but keeps writing results (a starved
    one) is left to finish; one that neither uses CPU nor writes anything
    (a guest kernel hung idle) is stopped as stalled.
    """
    slow = tmp_path / "slow"
    slow.mkdir()
    writer = subprocess.Popen([
        sys.executable, "-c",
        "import sys, time\n"
        "for n in range(40):\n"
        "    open(sys.argv[1], 'w').write(str(n))\n"
        "    time.sleep(0.1)\n",
        str(slow / "pytest.log")])
    watched = vm._watch(writer, slow, budget=100.0, stall=5.0, poll=0.1)
    assert watched.stopped is None and writer.returncode == 0, watched
    stalled = tmp_path / "stalled"
    stalled.mkdir()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        watched = vm._watch(sleeper, stalled, budget=100.0, stall=2.0, poll=0.1)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert watched.stopped is not None and watched.stopped.startswith("stalled"), watched
