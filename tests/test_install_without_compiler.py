"""
What an install without a C compiler shows, as C{docs/operations.md} says.

The C helper C{_hostpid_native} is optional (C{setup.py}: C{optional=True}):
where no compiler runs, setuptools skips it and the install succeeds.  The
doc said pip warned; it does not: pip shows a build backend's output only
with C{-v} or when the build fails, so the install's messages are the same
with and without the helper.  The doc now says so, and points at what does
tell (the broker's startup warning, C{import _hostpid_native}); this test
holds it with a compiler that cannot run (C{CC} naming a missing file).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support import REPO

MISSING_COMPILER = "/nonexistent/hostpid-test-cc"
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE", "hostpid",
           "twisted", "native", "bin")


def test_pip_installs_without_the_helper_and_says_nothing_of_it(tmp_path: Path) -> None:
    assert not os.path.exists(MISSING_COMPILER)
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "dropin.cache"))
        elif (REPO / name).exists():
            shutil.copy(REPO / name, source / name)
    target = tmp_path / "target"
    env = {**os.environ, "CC": MISSING_COMPILER}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(source)],
        env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert (target / "hostpid").is_dir()
    assert list(target.glob("_hostpid_native*")) == [], "the helper was built: CC was used?"
    assert "_hostpid_native" not in output and "warning" not in output.lower(), output
    doc = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert "pip says nothing of it" in doc
