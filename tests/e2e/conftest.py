"""
Session fixtures of the runtime tests: one generated CRI client, one test
image, and at most one private containerd of each release line per session
(L{crilib.RELEASES}), shared by the CRI test and the NRI tests.  Starting a
containerd and importing the image costs seconds; the suite's time budget
pays for it once.

The shared containerds have NRI on, each with its own socket under its own
directory: with no plugin connected NRI passes every request through
unchanged, so the CRI test sees the runtime it always saw, and the NRI
tests connect their plugin for the length of one test.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType

import pytest
from crilib import (
    Containerds,
    build_static_client,
    compile_messages,
    static_busybox,
    write_image,
)
from support import require_root


@pytest.fixture(scope="session")
def cri_messages() -> Iterator[ModuleType]:
    out = Path(tempfile.mkdtemp(prefix="hostpid-cri-pb-"))
    try:
        yield compile_messages(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def cri_image() -> Iterator[Path]:
    """The test image's OCI layout tarball (busybox and the static C client), built once."""
    require_root()
    build = Path(tempfile.mkdtemp(prefix="hostpid-cri-image-"))
    try:
        image = build / "image.tar"
        write_image(image, static_busybox(), build_static_client(build))
        yield image
    finally:
        shutil.rmtree(build, ignore_errors=True)


@pytest.fixture(scope="session")
def containerds(cri_image: Path, cri_messages: ModuleType) -> Iterator[Containerds]:
    with ExitStack() as stack:
        yield Containerds(cri_image, cri_messages, stack)
