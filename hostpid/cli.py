"""
The C{hostpid} command: thin glue from arguments to the library.

Each subcommand parses its options, calls one library entry point, and turns
the outcome into the exit status the contract fixes (0 success, 1 refused or
unavailable, 2 usage).  No rule lives here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from hostpid import defaults


def _query(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """C{hostpid query}: print the caller's host PID (owned by the client work)."""
    raise NotImplementedError


def _doctor(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """C{hostpid doctor}: one line per trust check (owned by the client work)."""
    raise NotImplementedError


def _prepare_lock_parent(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """C{hostpid prepare-lock-parent} (owned by the allocation work)."""
    raise NotImplementedError


def _allocate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """C{hostpid allocate} (owned by the allocation work)."""
    raise NotImplementedError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hostpid",
        description="Host PID broker client and allocation helpers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    query = commands.add_parser(
        "query", help="ask the broker for this process's host PID, with every trust check"
    )
    query.add_argument("--socket", default=defaults.CLIENT_SOCKET, metavar="PATH")
    query.add_argument(
        "--timeout", type=float, default=defaults.DEADLINE, metavar="S",
        help="one deadline over connect, write and read (default %(default)s)",
    )
    query.set_defaults(run=_query)

    doctor = commands.add_parser(
        "doctor", help="run each client trust check and print one line per check"
    )
    doctor.add_argument("--socket", default=defaults.CLIENT_SOCKET, metavar="PATH")
    doctor.set_defaults(run=_doctor)

    prepare = commands.add_parser(
        "prepare-lock-parent",
        help="prepare the shared lock parent (root-owned, 01777) by descriptors only",
    )
    prepare.add_argument("--path", default=defaults.LOCK_PARENT, metavar="PATH")
    prepare.set_defaults(run=_prepare_lock_parent)

    allocate = commands.add_parser(
        "allocate",
        help="patch a ContainerAllocateResponse (JSON on stdin) with the lock parent "
        "and broker mounts",
    )
    allocate.add_argument("--lock-parent", default=defaults.LOCK_PARENT, metavar="PATH")
    allocate.add_argument("--broker-dir", default=defaults.BROKER_DIRECTORY, metavar="PATH")
    allocate.set_defaults(run=_allocate)
    return parser


def main(
    argv: Sequence[str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.run(args, stdout or sys.stdout, stderr or sys.stderr)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
