"""
The broker keeps the CDI spec present: C{twistd
hostpid-broker --cdi-dir DIR --lock-parent PATH} prepares the lock parent
and writes the spec at startup, following its own gate; a failure is a
startup refusal (one line naming the path and the rule, no socket).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from cdischema import schema_errors
from support import BrokerProcess, ask_pid, require_root, running_broker, wait_for

from hostpid.node import cdi

pytestmark = pytest.mark.privileged


def spec_file(tree: Path) -> Path:
    return tree / "cdi" / cdi.SPEC_FILE_NAME


def options(tree: Path) -> tuple[str, ...]:
    return ("--cdi-dir", str(tree / "cdi"), "--lock-parent", str(tree / "vgpulock"))


@pytest.fixture
def tree(public_tmp: Path) -> Path:
    require_root()
    return public_tmp


def test_gate_on_writes_the_broker_spec_and_serves(tree: Path) -> None:
    broker_dir = tree / "broker"
    with running_broker(broker_dir, *options(tree)) as broker:
        assert ask_pid(broker.socket_path) == os.getpid()
        written = json.loads(spec_file(tree).read_text())
        assert written == cdi.build_spec(broker_enabled=True,
                                         lock_parent=str(tree / "vgpulock"),
                                         broker_directory=str(broker_dir))
        assert schema_errors(written) == []
        st = os.lstat(spec_file(tree))
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
        assert stat.S_IMODE(os.lstat(tree / "vgpulock").st_mode) == 0o1777
        assert stat.S_IMODE(os.lstat(tree / "vgpulock" / "hostpid").st_mode) == 0o755
        assert "CDI spec written" in broker.output()


def test_gate_off_writes_the_lock_parent_only_spec_and_no_socket(tree: Path) -> None:
    broker_dir = tree / "broker"
    with BrokerProcess(broker_dir, options(tree), gate="0") as broker:
        wait_for(lambda: "disabled" in broker.output(), "the disabled broker's log line")
        written = json.loads(spec_file(tree).read_text())
        assert written == cdi.build_spec(broker_enabled=False,
                                         lock_parent=str(tree / "vgpulock"),
                                         broker_directory=str(broker_dir))
        assert not broker_dir.exists()
        assert not (tree / "vgpulock" / "hostpid").exists()
        assert broker.terminate() != 0


def test_spec_is_back_after_a_reboot_clears_it(tree: Path) -> None:
    with running_broker(tree / "broker", *options(tree)):
        pass
    os.unlink(spec_file(tree))
    os.rmdir(tree / "cdi")  # a reboot empties the tmpfs /var/run
    with running_broker(tree / "broker", *options(tree)):
        assert json.loads(spec_file(tree).read_text())["kind"] == "hami.io/hostpid"


@pytest.mark.parametrize("gate", ["1", "0"])
def test_symlinked_cdi_dir_refuses_startup(tree: Path, gate: str) -> None:
    (tree / "cdi").symlink_to("/etc")
    broker_dir = tree / "broker"
    with BrokerProcess(broker_dir, options(tree), gate=gate) as broker:
        assert broker.wait_exit() != 0
        output = broker.output()
    line = f"hostpid-broker: cannot start: {tree}/cdi: is a symlink, not a directory"
    assert line in output, output
    assert not (broker_dir / "broker.sock").exists()
    assert not os.path.exists(f"/etc/{cdi.SPEC_FILE_NAME}")


def test_unsafe_lock_parent_refuses_startup_and_writes_no_spec(tree: Path) -> None:
    (tree / "vgpulock").symlink_to(tree)
    broker_dir = tree / "broker"
    with BrokerProcess(broker_dir, options(tree)) as broker:
        assert broker.wait_exit() != 0
        output = broker.output()
    assert f"hostpid-broker: cannot start: {tree}/vgpulock: is a symlink" in output, output
    assert not (broker_dir / "broker.sock").exists()
    assert not spec_file(tree).exists()


def test_foreign_spec_file_refuses_startup_and_is_left_alone(tree: Path) -> None:
    (tree / "cdi").mkdir(mode=0o755)
    spec_file(tree).write_text("{}\n")
    os.chown(spec_file(tree), 1000, 1000)
    with BrokerProcess(tree / "broker", options(tree)) as broker:
        assert broker.wait_exit() != 0
        output = broker.output()
    assert "hami.io-hostpid.json: is owned by UID 1000, not UID 0" in output, output
    assert spec_file(tree).read_text() == "{}\n"


def test_without_cdi_dir_nothing_is_written(tree: Path) -> None:
    with running_broker(tree / "broker"):
        pass
    assert sorted(os.listdir(tree)) == ["broker"]
