"""
The version a user reads: C{hostpid --version} and C{twistd hostpid-broker
--version} print the same line from here.
"""

from __future__ import annotations

#: The distribution whose version is printed.
DISTRIBUTION = "hostpid-broker"


def installed_version(distribution: str = DISTRIBUTION) -> str:
    """The installed distribution's version, else the package's own (a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        import hostpid

        return hostpid.__version__


def version_line() -> str:
    """C{hostpid X.Y.Z}."""
    return f"hostpid {installed_version()}"
