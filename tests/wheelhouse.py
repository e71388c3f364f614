"""
The wheels the install tests put into fresh environments, so that those
installs run offline (C{pip install --no-index}): the dependencies,
downloaded once into the cache directory (L{kernels.debian.CACHE}C{/wheelhouse},
keyed by what is downloaded, so a change to C{setup.cfg} fetches again), and
this tree's own wheel, built per session.

What is downloaded: the base install's requirements and the C{nri} extra's
(read from C{setup.cfg}), and, each resolved apart, the pins of the node
agents the tests install beside the package (L{AGENT_PINS}).  pip reaches
the index as this machine's pip is configured to; nothing names one here.
C{tests/prebuild.py} downloads them ahead of the tests.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from support import REPO

#: The agents' pins the install tests put beside the package: opentelemetry-proto
#: 1.42 (protobuf 6), 1.27 (protobuf 4.25), and a plain protobuf 5 pin; and
#: protobuf 7, which the NRI plugin also runs on.
AGENT_PINS = ("opentelemetry-proto==1.42.0", "opentelemetry-proto==1.27.0",
              "protobuf>=5.29,<6", "protobuf>=7,<8")

PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "-q")


def requirements(extras: tuple[str, ...] = ("nri",)) -> list[str]:
    """The base install's requirements and C{extras}', as C{setup.cfg} states them."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += config["options.extras_require"][extra].splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def dependencies() -> Path:
    """The directory of the dependencies' wheels, downloaded now if it is not there yet."""
    from kernels.debian import CACHE, filling

    wanted = {"requirements": requirements(), "pins": list(AGENT_PINS),
              "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    key = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:16]
    final = CACHE / "wheelhouse" / key
    if (final / ".complete").is_file():
        return final
    with filling(final, ".complete") as staging:
        for group in ([*wanted["requirements"]], *([pin] for pin in AGENT_PINS)):
            subprocess.run([*PIP, "download", "--only-binary=:all:", "--dest", str(staging),
                            *group], check=True, capture_output=True, text=True, timeout=900)
        (staging / ".complete").touch()
    return final


def package_wheel(source: Path, out: Path) -> Path:
    """This tree's wheel, built from C{source} into C{out} (no dependencies, no isolation)."""
    subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                    "--wheel-dir", str(out), str(source)],
                   check=True, capture_output=True, text=True, timeout=900)
    (wheel,) = out.glob("hostpid_broker-*.whl")
    return wheel
