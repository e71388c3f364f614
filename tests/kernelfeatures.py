"""
Kernel features the suite depends on, probed for real once per session, and
the pytest plugin that makes a test without its feature I{not applicable}.

Marks (registered here, loaded by tests/conftest.py):

 - C{@pytest.mark.kernel}: the test depends on kernel behaviour.  These are
   the tests that tests/kernels/ runs on each Debian kernel of the matrix
   (C{pytest -m kernel}).  A module opts in whole with C{pytestmark}; the
   subset is every test whose outcome a kernel can change: the descriptor
   modes (tests/test_descriptors.py, tests/test_port.py), peer
   identification (tests/test_peercred.py), the attack tests
   (tests/integration/test_attack_*.py), the bounded close
   (tests/test_closewatch.py), never-wrong-PID and the liveness check
   (tests/integration/test_never_wrong_pid.py, test_pid_reuse.py,
   tests/test_starttime.py), serving and eviction
   (tests/integration/test_broker_serving.py, test_metrics_limits.py).  Tests of file layout, wire
   format, CLI, CDI and deployment do not change with the kernel and stay
   out: the whole suite under emulation would take over an hour.  Every
   C{test_attack_*.py} module is in the subset whether it says so or not
   (L{pytest_collection_modifyitems}).
 - C{@pytest.mark.kernel_feature("SO_PASSRIGHTS", ...)}: the test needs
   these features.  Where the probe finds one absent the test reports
   C{not applicable: SO_PASSRIGHTS absent on 6.1.0-50-amd64}: not a pass,
   and not a skip (the terminal counts it apart, and
   C{HOSTPID_REQUIRE_PRIVILEGED=1} allows it, which it allows no skip).  A
   probe that fails in a way that does not mean "absent" (an unexpected
   errno) fails the test instead.  Only this plugin can declare a test not
   applicable: a test that skips with a reason that starts the same way but
   whose feature the probe found present fails.

Each probe asks the kernel the question the broker asks (the same socket
option, system call or ioctl on a real socket or process); nothing is
inferred from the release number.  Run as a script, this module prints the
probes' results as JSON; in a pytest session with C{HOSTPID_FEATURES_FILE} set
it writes them there (tests/kernels/guest-init.sh does, for docs/kernels.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostpid.broker.descriptors import SO_PASSRIGHTS  # noqa: E402
from hostpid.peercred import PIDFD_GET_INFO, SO_PEERPIDFD  # noqa: E402

#: The prefix of a not-applicable outcome's reason; tests/kernels/vm.py
#: counts outcomes by it.
NOT_APPLICABLE = "not applicable:"


@attrs.frozen
class Probe:
    """One feature, asked of the running kernel."""

    feature: str
    present: bool
    #: What the kernel answered, for the report and docs/kernels.md.
    detail: str


class ProbeError(Exception):
    """The kernel answered neither "present" nor "absent"."""


def _absent_if(error: OSError, *absent: int) -> bool:
    if error.errno in absent:
        return True
    raise ProbeError(f"{errno.errorcode.get(error.errno or 0, error.errno)}: {error}") from error


def probe_so_passrights() -> tuple[bool, str]:
    """Linux 6.16+: C{setsockopt(SO_PASSRIGHTS, 0)} on a Unix stream socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
        except OSError as error:
            _absent_if(error, errno.ENOPROTOOPT)
            return False, "setsockopt: ENOPROTOOPT"
        return True, f"setsockopt 0, reads back {sock.getsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS)}"


def probe_so_peerpidfd() -> tuple[bool, str]:
    """Linux 6.5+: C{getsockopt(SO_PEERPIDFD)} on a connected socket pair."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        try:
            pidfd = left.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError as error:
            _absent_if(error, errno.ENOPROTOOPT)
            return False, "getsockopt: ENOPROTOOPT"
        os.close(pidfd)
        return True, "getsockopt returns a pidfd"


def probe_so_peerpidfd_reaped() -> tuple[bool, str]:
    """
    Whether C{SO_PEERPIDFD} still returns a pidfd once the peer has exited
    and been reaped (6.16+; 6.5-6.12 answer C{EINVAL}): the broker's
    C{peer_gone} versus C{peer_credentials_failed} for a caller that has gone.
    """
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with server:
        server.bind(f"\0hostpid-kernelfeatures-{os.getpid()}")
        server.listen(1)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child connects and exits
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(f"\0hostpid-kernelfeatures-{os.getppid()}")
            os._exit(0)
        os.waitpid(child, 0)
        conn, _ = server.accept()
        with conn:
            try:
                pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
            except OSError as error:
                _absent_if(error, errno.ENOPROTOOPT, errno.EINVAL, errno.ESRCH)
                return False, f"getsockopt: {errno.errorcode[error.errno or 0]}"
            os.close(pidfd)
            return True, "getsockopt returns a pidfd"


def probe_unix_oob() -> tuple[bool, str]:
    """Linux 5.15+: out-of-band data (C{MSG_OOB}) on a Unix stream socket."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        try:
            left.send(b"!", socket.MSG_OOB)
        except OSError as error:
            _absent_if(error, errno.EOPNOTSUPP)
            return False, "send MSG_OOB: EOPNOTSUPP"
        return True, "send MSG_OOB accepted"


def probe_pidfd_open() -> tuple[bool, str]:
    """Linux 5.3+: C{pidfd_open(getpid())}."""
    try:
        pidfd = os.pidfd_open(os.getpid())
    except OSError as error:
        _absent_if(error, errno.ENOSYS)
        return False, "pidfd_open: ENOSYS"
    os.close(pidfd)
    return True, "pidfd_open returns a pidfd"


def probe_pidfd_send_signal() -> tuple[bool, str]:
    """Linux 5.1+: C{pidfd_send_signal(pidfd, 0)} to this process."""
    pidfd = os.pidfd_open(os.getpid())
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except OSError as error:
        _absent_if(error, errno.ENOSYS)
        return False, "pidfd_send_signal: ENOSYS"
    finally:
        os.close(pidfd)
    return True, "signal 0 delivered"


def probe_pidfd_get_info() -> tuple[bool, str]:
    """Linux 6.13+: the C{PIDFD_GET_INFO} ioctl on a pidfd."""
    pidfd = os.pidfd_open(os.getpid())
    buffer = bytearray(64)
    buffer[0] = 1  # request_mask: PIDFD_INFO_PID
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buffer)
    except OSError as error:
        _absent_if(error, errno.ENOTTY, errno.EINVAL)
        return False, f"ioctl: {errno.errorcode[error.errno or 0]}"
    finally:
        os.close(pidfd)
    return True, "ioctl answers"


def probe_idmapped_mounts() -> tuple[bool, str]:
    """
    Linux 5.12+ (tmpfs 6.3+): an idmapped mount of a directory in C{/tmp},
    where the user-namespace tests put the broker's, made as the tests and a
    runtime make it: C{open_tree(OPEN_TREE_CLONE)} and
    C{mount_setattr(MOUNT_ATTR_IDMAP)} with a user namespace that has a
    mapping.  The mount is never attached; needs root.
    """
    import tempfile

    import usernspod

    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only holds the namespace
        os.close(ready_read)
        os.close(done_write)
        try:
            usernspod.unshare(usernspod.CLONE_NEWUSER)
            os.write(ready_write, b"u")
        except OSError as error:
            os.write(ready_write, errno.errorcode.get(error.errno or 0, "?").encode())
        finally:
            os.close(ready_write)
            os.read(done_read, 1)
            os._exit(0)
    os.close(ready_write)
    os.close(done_read)
    directory = tempfile.mkdtemp(prefix="hostpid-idmap-probe-", dir="/tmp")
    try:
        namespace = f"/proc/{child}/ns/user"
        made = os.read(ready_read, 64)
        if made != b"u":
            raise ProbeError(
                f"the child could not make a user namespace: {made.decode() or 'it exited'}"
            )
        usernspod.write_maps(child)
        try:
            tree = usernspod.open_tree(directory, usernspod.OPEN_TREE_CLONE | os.O_CLOEXEC)
        except OSError as error:
            _absent_if(error, errno.ENOSYS)
            return False, "open_tree: ENOSYS"
        try:
            userns = os.open(namespace, os.O_RDONLY | os.O_CLOEXEC)
            try:
                usernspod.mount_setattr(tree, usernspod.MOUNT_ATTR_IDMAP, userns)
            except OSError as error:
                _absent_if(error, errno.ENOSYS, errno.EINVAL)
                return False, f"mount_setattr: {errno.errorcode[error.errno or 0]}"
            finally:
                os.close(userns)
        finally:
            os.close(tree)
        return True, "MOUNT_ATTR_IDMAP set on a clone of a directory in /tmp"
    finally:
        os.close(ready_read)
        os.close(done_write)
        os.waitpid(child, 0)
        os.rmdir(directory)


def probe_immutable_tmp() -> tuple[bool, str]:
    """
    The immutable attribute (C{FS_IOC_SETFLAGS} with C{FS_IMMUTABLE_FL}) on a
    directory in the temporary directory, where the tests prepare lock
    parents and their broker mountpoints: ext4, xfs and btrfs have it, tmpfs
    from Linux 6.0 (the guests' C{/tmp} on 5.10 has not).  Set, read back and
    cleared on a fresh directory; needs root (C{CAP_LINUX_IMMUTABLE}).
    """
    import tempfile

    from hostpid import fileattr

    directory = tempfile.mkdtemp(prefix="hostpid-immutable-probe-")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            flags = fileattr.get_flags(fd)
            fileattr._set_flags(fd, flags | fileattr.FS_IMMUTABLE_FL)
        except OSError as error:
            _absent_if(error, errno.ENOTTY, errno.EOPNOTSUPP)
            return False, f"ioctl FS_IOC_SETFLAGS: {errno.errorcode[error.errno or 0]}"
        set_ = fileattr.is_immutable(fd)
        fileattr.clear_immutable(fd)
        kind = fileattr._filesystem(fd) or "?"
        if not set_:
            return False, f"{kind}: the flag does not stick"
        return True, f"{kind}: set, read back and cleared"
    finally:
        os.close(fd)
        os.rmdir(directory)


#: Every feature a test may name, with its probe.
PROBES: dict[str, Callable[[], tuple[bool, str]]] = {
    "SO_PASSRIGHTS": probe_so_passrights,
    "SO_PEERPIDFD": probe_so_peerpidfd,
    "SO_PEERPIDFD_REAPED": probe_so_peerpidfd_reaped,
    "UNIX_OOB": probe_unix_oob,
    "pidfd_open": probe_pidfd_open,
    "pidfd_send_signal": probe_pidfd_send_signal,
    "PIDFD_GET_INFO": probe_pidfd_get_info,
    "idmapped_mounts": probe_idmapped_mounts,
    "immutable_tmp": probe_immutable_tmp,
}

_probed: dict[str, Probe] = {}


def probe(feature: str) -> Probe:
    """C{feature} on the running kernel, asked once per process."""
    if feature not in PROBES:
        raise KeyError(f"no probe for kernel feature {feature!r}; known: {sorted(PROBES)}")
    if feature not in _probed:
        present, detail = PROBES[feature]()
        _probed[feature] = Probe(feature, present, detail)
    return _probed[feature]


def has(feature: str) -> bool:
    """Whether the running kernel has C{feature} (for tests whose expectation depends on it)."""
    return probe(feature).present


def not_applicable_reason(feature: str) -> str:
    return f"{NOT_APPLICABLE} {feature} absent on {os.uname().release}"


# -- the pytest plugin ---------------------------------------------------------


def kernel_feature(*features: str) -> pytest.MarkDecorator:
    """The mark for a test that needs C{features} (each a key of L{PROBES})."""
    unknown = set(features) - set(PROBES)
    if unknown:
        raise KeyError(f"no probe for kernel features {sorted(unknown)}; known: {sorted(PROBES)}")
    return pytest.mark.kernel_feature(*features)


#: The broker's two descriptor modes as a test parameter: C{received} runs on
#: every kernel, C{refused} only where the kernel has C{SO_PASSRIGHTS}.
MODES = [pytest.param("refused", marks=kernel_feature("SO_PASSRIGHTS")), "received"]

_NOT_APPLICABLE_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kernel: depends on kernel behaviour; run on each kernel of tests/kernels' matrix",
    )
    config.addinivalue_line(
        "markers",
        "kernel_feature(*names): needs these kernel features (tests/kernelfeatures.py); "
        "not applicable where a probe finds one absent",
    )


#: Attack modules left out of the matrix's subset, and why.
NOT_KERNEL_SENSITIVE = {
    "test_attack_many_tenants.py": "a fairness flood: CPU-bound, the same on every kernel, "
    "and 100 s a parameter under emulation (over a third of a kernel's run)",
    "test_attack_pid_spray.py": "a fairness flood measured against 0.5 s client deadlines: "
    "1-2 minutes a parameter under emulation; the start-time check it also exercises is forced "
    "on the host, and test_pid_reuse_backlog.py runs that check on every kernel",
    "test_attack_closer_flood.py": "a paced flood of 60 connections a second for up to a "
    "minute, measured against 0.5 s deadlines and the DaemonSet's probe: a load figure, not a "
    "kernel behaviour; the disposer it relies on is in the matrix (test_closer.py, "
    "test_attack_nested_descriptors.py)",
    "test_attack_fuse_close.py": "needs /dev/fuse and a FUSE server, which the guests' "
    "initramfs does not have; run on the host",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """
    Every attack test is kernel-sensitive: a new C{test_attack_*.py} module
    is in the matrix's subset without having to say so (except those of
    L{NOT_KERNEL_SENSITIVE}).
    """
    for item in items:
        name = item.path.name
        if (
            name.startswith("test_attack_")
            and name not in NOT_KERNEL_SENSITIVE
            and not item.get_closest_marker("kernel")
        ):
            item.add_marker(pytest.mark.kernel)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("kernel_feature"):
        for feature in mark.args:
            try:
                found = probe(feature)
            except ProbeError as error:
                pytest.fail(f"probing kernel feature {feature} failed: {error}")
            if not found.present:
                reason = not_applicable_reason(feature)
                item.stash[_NOT_APPLICABLE_KEY] = reason
                pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:
    report: pytest.TestReport = yield  # type: ignore[misc]
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if NOT_APPLICABLE in reason and item.stash.get(_NOT_APPLICABLE_KEY, None) is None:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} claims {reason!r}, but no kernel_feature probe found "
                "its feature absent: only the probe may declare a test not applicable"
            )
    return report  # type: ignore[return-value]


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, str] | None:
    if (
        report.skipped
        and isinstance(report.longrepr, tuple)
        and NOT_APPLICABLE in str(report.longrepr[2])
    ):
        return "not applicable", "n", "NOT APPLICABLE"
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reports = terminalreporter.stats.get("not applicable", [])
    if reports:
        terminalreporter.section("not applicable on this kernel")
        for report in reports:
            terminalreporter.line(f"{report.nodeid}: {report.longrepr[2]}")


#: Where a guest's pytest writes every probe's result (tests/kernels/guest-init.sh
#: sets it): asked in the session that runs the tests, not in an interpreter of
#: its own, which costs a guest under emulation some 15 s.
FEATURES_FILE = os.environ.get("HOSTPID_FEATURES_FILE")


def pytest_sessionstart(session: pytest.Session) -> None:
    """
    Probe every feature once, before any test runs: what the kernel has,
    not what a test left behind (a probe that needs a fresh user namespace
    was seen failing once late in a full run, and its answer is kept for
    the whole session).  A guest also writes the answers to its job.
    """
    found = results()
    if FEATURES_FILE:
        Path(FEATURES_FILE).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


def results() -> dict[str, dict[str, object]]:
    """Every probe's result: {feature: {present, detail}}, and the release."""
    results: dict[str, dict[str, object]] = {}
    for feature in PROBES:
        try:
            found = probe(feature)
            results[feature] = {"present": found.present, "detail": found.detail}
        except (ProbeError, OSError) as error:
            results[feature] = {"present": None, "detail": f"probe error: {error}"}
    results["release"] = {"present": True, "detail": os.uname().release}
    return results


def main() -> None:
    """Print every probe's result as JSON."""
    json.dump(results(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
