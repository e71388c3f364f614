"""
L{builds}: a cached build is reused as it is, and a build that fails leaves
nothing that looks finished (the next run builds again).  No network: the
failing build runs with C{GOPROXY=off}, so C{go mod download} refuses at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import builds
import pytest
from support import require_tool


def test_cached_build_is_reused(tmp_path: Path) -> None:
    build = builds.GoBuild("fake", "example.invalid/never/fetched", "v0.0.1", (("fake", "."),))
    done = tmp_path / build.key
    (done / "bin").mkdir(parents=True)
    (done / "build.json").write_text(json.dumps({"version": build.version, "binaries": []}))
    assert builds.obtain(build, cache=tmp_path) == done
    assert builds.recorded(build, cache=tmp_path) == {"version": "v0.0.1", "binaries": []}


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_tool("go")
    monkeypatch.setenv("GOPROXY", "off")
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "modcache"))
    build = builds.GoBuild("fake", "example.invalid/never/fetched", "v0.0.1", (("fake", "."),))
    with pytest.raises(RuntimeError, match="go mod download"):
        builds.obtain(build, cache=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    assert builds.recorded(build, cache=tmp_path / "cache") is None
