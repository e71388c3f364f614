"""
The version a user reads: C{hostpid --version} and C{twistd hostpid-broker
--version} (and C{hostpid-nri}'s, C{hostpid-webhook}'s) print the same line
from here.
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
    """
    C{hostpid X.Y.Z}, from the package's own C{__version__}: the installed
    distribution's is the same (C{tests/test_shipped_files.py} checks the
    built distribution against it), and reading it through
    C{importlib.metadata} imports C{pathlib}, C{shutil}, C{inspect} and more,
    about an interpreter start's worth of CPU for a line.
    """
    import hostpid

    return f"hostpid {hostpid.__version__}"


class VersionOption:
    """
    C{--version} for a twistd plugin's C{usage.Options} (put it first among
    the bases): hostpid's line, as C{hostpid --version} prints it, then
    Twisted's, instead of Twisted's alone (C{usage.Options.opt_version}), so
    that an operator asking any of the three services learns which hostpid
    runs.
    """

    def opt_version(self) -> None:
        """Print hostpid's version (as hostpid --version does), then Twisted's, and exit."""
        import sys

        from twisted import copyright

        print(version_line())
        print(f"Twisted {copyright.version}")
        sys.exit(0)
