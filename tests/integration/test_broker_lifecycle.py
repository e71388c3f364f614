"""
The broker's filesystem rules, each proven on a real broker process: what it
creates, what it refuses, what it removes, and what it never touches.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import (
    BrokerProcess,
    ask_pid,
    connect,
    listen_backlog,
    read_until_eof,
    require_root,
    running_broker,
    stale_socket,
    wait_for,
)

from hostpid import wire
from hostpid.broker.service import RECEIVE_DESCRIPTORS_ENV


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def refused(directory: Path, *args: str) -> str:
    """Start a broker that must refuse: return its output after a non-zero exit."""
    with BrokerProcess(directory, args) as broker:
        status = broker.wait_exit()
        output = broker.output()
    assert status != 0, output
    return output


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "broker"


def test_modes_and_owners_after_start(directory: Path) -> None:
    with running_broker(directory):
        assert stat.S_ISDIR(os.lstat(directory).st_mode)
        assert mode(directory) == 0o711
        assert stat.S_ISSOCK(os.lstat(directory / "broker.sock").st_mode)
        assert mode(directory / "broker.sock") == 0o666
        assert stat.S_ISREG(os.lstat(directory / "broker.lock").st_mode)
        assert mode(directory / "broker.lock") == 0o600
        for name in ("", "broker.sock", "broker.lock"):
            assert os.lstat(directory / name).st_uid == os.geteuid()


def test_accept_queue_holds_a_burst_of_1024(directory: Path) -> None:
    """See L{hostpid.defaults.LISTEN_BACKLOG} for why 1024 and not the kernel's maximum."""
    with running_broker(directory) as broker:
        assert listen_backlog(broker.socket_path) == 1024


def test_existing_directory_mode_is_set_to_0711(directory: Path) -> None:
    directory.mkdir(mode=0o755)
    directory.chmod(0o777)
    with running_broker(directory):
        assert mode(directory) == 0o711


def test_missing_parents_are_created(tmp_path: Path) -> None:
    directory = tmp_path / "var" / "run" / "hami" / "hostpid"
    with running_broker(directory) as broker:
        assert ask_pid(broker.socket_path) == os.getpid()


def test_socket_removed_and_lock_released_on_sigterm(directory: Path) -> None:
    with BrokerProcess(directory) as broker:
        broker.wait_listening()
        status = broker.terminate()
    assert status == -signal.SIGTERM, "twistd ends by re-raising SIGTERM (a shell sees 143)"
    assert not (directory / "broker.sock").exists()
    with running_broker(directory) as again:  # the lock is free again
        assert ask_pid(again.socket_path) == os.getpid()


def test_symlinked_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "broker"
    link.symlink_to(target)
    output = refused(link)
    # Word for word the row of docs/operations.md ("Startup errors").
    assert f"{link}: is a symlink; the broker directory must be a real directory" in output
    assert os.listdir(target) == [], "nothing was created through the symlink"


def test_directory_that_is_a_file_is_refused(directory: Path) -> None:
    directory.write_text("not a directory")
    output = refused(directory)
    assert f"{directory}: is a regular file" in output
    assert directory.read_text() == "not a directory"


def test_directory_owned_by_another_uid_is_refused(directory: Path) -> None:
    require_root()
    directory.mkdir()
    os.chown(directory, 1000, 1000)
    output = refused(directory)
    assert f"{directory}: is owned by UID 1000" in output
    assert os.listdir(directory) == []


def test_symlinked_lock_file_is_refused_and_its_target_untouched(
    directory: Path, tmp_path: Path
) -> None:
    directory.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me")
    target.chmod(0o644)
    (directory / "broker.lock").symlink_to(target)
    output = refused(directory)
    assert "broker.lock: is a symlink" in output
    assert target.read_text() == "keep me"
    assert mode(target) == 0o644
    assert not (directory / "broker.sock").exists()


@pytest.mark.parametrize("lock_mode", [0o640, 0o604, 0o660])
def test_lock_file_with_group_or_other_bits_is_refused(directory: Path, lock_mode: int) -> None:
    directory.mkdir()
    lock = directory / "broker.lock"
    lock.touch()
    lock.chmod(lock_mode)
    output = refused(directory)
    assert f"has mode {lock_mode:04o}" in output


def test_lock_file_owned_by_another_uid_is_refused(directory: Path) -> None:
    require_root()
    directory.mkdir()
    lock = directory / "broker.lock"
    lock.touch(mode=0o600)
    os.chown(lock, 1000, 1000)
    assert "broker.lock: is owned by UID 1000" in refused(directory)


def test_lock_that_is_a_fifo_is_refused_without_hanging(directory: Path) -> None:
    directory.mkdir()
    os.mkfifo(directory / "broker.lock", 0o600)
    assert "broker.lock: is a FIFO" in refused(directory)


def test_second_broker_fails_and_first_keeps_serving(directory: Path) -> None:
    """
    A second broker takes the first one's listener over when it can
    (test_handover.py); when it cannot (here: the first has no control
    socket, as a broker from before the handover), it refuses and says why.
    """
    with running_broker(directory) as first:
        wait_for(lambda: (directory / "handover.sock").exists(), "the control socket")
        (directory / "handover.sock").unlink()
        output = refused(directory)
        assert "broker.lock: is locked by another broker" in output
        assert "no handover: " in output and "no control socket" in output
        assert ask_pid(first.socket_path) == os.getpid()
        assert first.process.poll() is None


def test_stale_socket_is_removed(directory: Path) -> None:
    directory.mkdir()
    stale_socket(directory / "broker.sock")
    with running_broker(directory) as broker:
        assert ask_pid(broker.socket_path) == os.getpid()
        assert "stale socket removed" in broker.output()


def test_active_socket_is_refused_and_left_alone(directory: Path) -> None:
    directory.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(directory / "broker.sock"))
    listener.listen(8)
    try:
        inode = os.lstat(directory / "broker.sock").st_ino
        output = refused(directory)
        assert "broker.sock: is an active socket" in output
        assert os.lstat(directory / "broker.sock").st_ino == inode
        connect(directory / "broker.sock").close()  # still the other listener's
    finally:
        listener.close()


def test_socket_owned_by_another_uid_is_refused_and_left_alone(directory: Path) -> None:
    require_root()
    directory.mkdir()
    stale_socket(directory / "broker.sock")
    os.chown(directory / "broker.sock", 1000, 1000)
    output = refused(directory)
    assert "broker.sock: is a socket owned by UID 1000" in output
    assert os.lstat(directory / "broker.sock").st_uid == 1000


def test_regular_file_at_socket_path_is_refused_and_left_alone(directory: Path) -> None:
    directory.mkdir()
    (directory / "broker.sock").write_text("someone's data")
    output = refused(directory)
    assert "broker.sock: is a regular file, not a socket" in output
    assert (directory / "broker.sock").read_text() == "someone's data"


def test_symlink_at_socket_path_is_refused_and_left_alone(directory: Path, tmp_path: Path) -> None:
    directory.mkdir()
    target = tmp_path / "elsewhere.sock"
    stale_socket(target)
    (directory / "broker.sock").symlink_to(target)
    output = refused(directory)
    assert "broker.sock: is a symlink, not a socket" in output
    assert os.readlink(directory / "broker.sock") == os.fspath(target)
    assert stat.S_ISSOCK(os.lstat(target).st_mode)


@pytest.fixture
def serving(directory: Path) -> Iterator[BrokerProcess]:
    with BrokerProcess(directory) as broker:
        broker.wait_listening()
        yield broker


def test_file_that_replaced_the_socket_survives_stop(serving: BrokerProcess) -> None:
    """
    Someone replaces the socket path, then the broker stops (by SIGTERM, or
    because it noticed): the newcomer is never deleted.
    """
    path = serving.socket_path
    os.unlink(path)
    path.write_text("the newcomer")
    serving.terminate()
    assert path.read_text() == "the newcomer"
    assert "socket left in place" in serving.output() or "was replaced" in serving.output()


def test_socket_replaced_by_another_socket_survives_stop(serving: BrokerProcess) -> None:
    path = serving.socket_path
    os.unlink(path)
    stale_socket(path)
    inode = os.lstat(path).st_ino
    serving.terminate()
    assert os.lstat(path).st_ino == inode


def test_socket_removed_while_serving_exits_non_zero(serving: BrokerProcess) -> None:
    os.unlink(serving.socket_path)
    status = serving.wait_exit()
    assert status == 1
    assert "the socket was removed while the broker was serving" in serving.output()


def test_socket_replaced_while_serving_exits_non_zero_and_keeps_newcomer(
    serving: BrokerProcess,
) -> None:
    path = serving.socket_path
    os.unlink(path)
    path.write_text("planted")
    status = serving.wait_exit()
    assert status == 1
    assert "the socket was replaced by another file" in serving.output()
    assert path.read_text() == "planted"


def test_restart_after_removal_restores_service(directory: Path) -> None:
    with BrokerProcess(directory) as first:
        first.wait_listening()
        os.unlink(first.socket_path)
        assert first.wait_exit() == 1
    with running_broker(directory) as second:
        assert wait_for(lambda: ask_pid(second.socket_path) == os.getpid(), "service")


def test_descriptor_limit_is_raised_to_fit_max_connections(directory: Path) -> None:
    import resource

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))

    with running_broker(
        directory, "--max-connections", "1000", preexec_fn=low_soft_limit
    ) as broker:
        limits = Path(f"/proc/{broker.pid}/limits").read_text()
        [line] = [line for line in limits.splitlines() if line.startswith("Max open files")]
        assert line.split()[3:5] == ["1064", "4096"]


@pytest.mark.parametrize("mode", ["refused", "received"])
def test_descriptor_limit_below_need_is_reported_and_served_within(
    directory: Path, mode: str
) -> None:
    """
    With RLIMIT_NOFILE 128 a broker in mode received never
    has room for a full SCM_RIGHTS message; it used to read nothing and
    reset every connection.  Now it reads by peeking first, and answers,
    in both modes; a client that passes a descriptor still gets no PID.
    """
    import array
    import resource

    def low_hard_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    env = {RECEIVE_DESCRIPTORS_ENV: "1"} if mode == "received" else {}
    with running_broker(directory, preexec_fn=low_hard_limit, env=env) as broker:
        assert "RLIMIT_NOFILE is 128, below the" in broker.output()
        for _ in range(20):
            assert ask_pid(broker.socket_path) == os.getpid()
        if mode == "received":
            assert "leaves no room for a full SCM_RIGHTS message" in broker.output()
            passed = os.open("/dev/null", os.O_RDONLY)
            try:
                with connect(broker.socket_path) as sock:
                    sock.sendmsg([wire.GET_HOST_PID_REQUEST], [
                        (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [passed]))])
                    try:
                        reply = read_until_eof(sock)
                    except ConnectionResetError:
                        reply = b""  # closed with its descriptors unread
                    assert reply == b"", "no PID for a message with descriptors"
            finally:
                os.close(passed)
            assert ask_pid(broker.socket_path) == os.getpid()
