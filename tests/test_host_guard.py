"""
The suite's guard of the host's C{/tmp/vgpulock} (tests/conftest.py) names
the test that changed it (a change seen only at the end of a run could not
be placed): run on a small suite of its own, by a
real pytest, with the guard pointed at a scratch lock parent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

HEADER = '''
import os
import pytest

LOCK_PARENT = {lock_parent!r}
MOUNTPOINT = os.path.join(LOCK_PARENT, "hostpid")
'''

#: Run in file order: a test that changes the lock parent, a module fixture
#: whose teardown does, and innocent tests around them.
MODULES = {
    "test_1_culprit.py": '''
def test_first_leaves_it_alone():
    pass


def test_second_creates_the_mountpoint():
    os.mkdir(MOUNTPOINT, 0o755)


def test_third_leaves_it_alone():
    pass
''',
    "test_2_fixture.py": '''
@pytest.fixture(scope="module")
def removes_it_at_teardown():
    yield
    os.rmdir(MOUNTPOINT)


def test_with_a_module_fixture(removes_it_at_teardown):
    pass
''',
    "test_3_innocent.py": '''
def test_after_the_fixture_teardown():
    pass
''',
}


def test_the_guard_names_the_test_that_changed_the_lock_parent(tmp_path: Path) -> None:
    lock_parent = tmp_path / "vgpulock"
    lock_parent.mkdir(mode=0o755)
    suite = tmp_path / "suite"
    suite.mkdir()
    conftest = CONFTEST.read_text()
    original = 'HOST_LOCK_PARENT = "/tmp/vgpulock"'
    assert original in conftest
    (suite / "conftest.py").write_text(
        conftest.replace(original, f"HOST_LOCK_PARENT = {str(lock_parent)!r}")
    )
    for name, body in MODULES.items():
        (suite / name).write_text(HEADER.format(lock_parent=str(lock_parent)) + body)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "--rootdir", str(suite), "-c", "/dev/null", str(suite)],
        capture_output=True, text=True, timeout=120, cwd=suite,
        # The conftest loads the suite's own plugins (kernelfeatures):
        # importable from this tests directory, wherever the checkout is.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(CONFTEST.parent), os.environ.get("PYTHONPATH", "")) if p)},
    )
    out = result.stdout
    assert result.returncode == 1, out
    assert (
        f"test_1_culprit.py::test_second_creates_the_mountpoint changed the host's {lock_parent}"
        in out
    ), out
    # The module fixture's teardown runs after its test's own check: it is
    # placed between that test and the next.
    assert (
        "changed between test_2_fixture.py::test_with_a_module_fixture and "
        "test_3_innocent.py::test_after_the_fixture_teardown" in out
    ), out
    for innocent in ("test_first_leaves_it_alone", "test_third_leaves_it_alone"):
        assert f"{innocent} changed" not in out
    # The rmdir left the mtime changed: the session's own check still fails at the end.
    assert f"the host's {lock_parent} changed while the suite ran" in out, out
    assert "4 passed, 3 errors" in out, out
