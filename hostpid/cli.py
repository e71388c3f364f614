"""
The C{hostpid} command: thin glue from arguments to the library.

Each subcommand parses its options, calls one library entry point, and turns
the outcome into the exit status the contract fixes (0 success, 1 refused or
unavailable, 2 usage).  No rule lives here.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import TextIO

from hostpid import defaults


def _query(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid query}: print the caller's host PID.  C{--socket} points the
    client elsewhere; every trust check stays on.
    """
    from hostpid.client import blocking as client

    try:
        policy = client.TrustPolicy(socket_path=args.socket, deadline=args.timeout)
    except ValueError as error:
        stderr.write(f"hostpid query: {error}\n")
        return 2
    try:
        pid = client.query_host_pid(policy)
    except client.HostPidUnavailable as problem:
        stderr.write(f"hostpid query: {problem.check} check failed: {problem.observed}\n")
        return 1
    stdout.write(f"{pid}\n")
    return 0


def _doctor(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid doctor}: one line per check, C{NAME ok|FAIL OBSERVED}, with the
    production rules, so an operator sees at once why a workload falls back.
    """
    from hostpid.client import blocking as client
    from hostpid.client.mountpoint import broker_mount_problem

    # First, and only when it is the matter: no broker mount at all.
    problem = broker_mount_problem(args.socket)
    if problem is not None:
        stdout.write(f"broker-mount FAIL {problem}\n")
    results = client.doctor(client.TrustPolicy(socket_path=args.socket))
    for result in results:
        stdout.write(f"{result.name} {'ok' if result.ok else 'FAIL'} {result.observed}\n")
    return 0 if problem is None and all(result.ok for result in results) else 1


def _prepare_lock_parent(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid prepare-lock-parent}: make the lock parent root-owned 01777
    (and, with the gate on in this environment, the broker mountpoint in it a
    root-owned 0755 directory).  One line on stdout when prepared; one line on
    stderr naming the path and the rule when not.
    """
    from hostpid.gate import gate_enabled
    from hostpid.node.lockparent import LockParentError, prepare_lock_parent

    try:
        prepared = prepare_lock_parent(args.path, broker_enabled=gate_enabled())
    except LockParentError as e:
        print(f"hostpid: {e}", file=stderr)
        return 1
    for line in prepared.describe_repairs():
        print(f"hostpid: {line}", file=stderr)
    mountpoint = " and broker mountpoint" if prepared.broker_mountpoint else ""
    print(f"{prepared.path}: lock parent{mountpoint} prepared", file=stdout)
    return 0


def _allocate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid allocate}: a C{ContainerAllocateResponse} as JSON on stdin,
    the patched response on stdout.  The lock parent is prepared first; if
    the input is invalid or the lock parent unsafe, nothing at all is written
    to stdout, so a plugin that pipes stdout into its response can never
    return a half-patched one.
    """
    from hostpid.gate import gate_enabled
    from hostpid.node.allocation import (
        MAX_INPUT_BYTES,
        AllocationResponseError,
        patch_response,
        response_from_json,
        response_to_json,
    )
    from hostpid.node.hostpaths import FilesystemHostPaths
    from hostpid.node.lockparent import LockParentError, prepare_lock_parent

    if args.cdi:
        return _allocate_cdi(args, stdout, stderr)
    broker_enabled = gate_enabled()
    try:
        # One byte more than the bound, so that too much input is seen as such.
        response = response_from_json(sys.stdin.buffer.read(MAX_INPUT_BYTES + 1))
    except AllocationResponseError as e:
        print(f"hostpid: {e}", file=stderr)
        return 1
    try:
        prepared = prepare_lock_parent(args.lock_parent, broker_enabled=broker_enabled)
    except LockParentError as e:
        print(f"hostpid: {e}", file=stderr)
        return 1
    for line in prepared.describe_repairs():
        print(f"hostpid: {line}", file=stderr)
    patched = patch_response(
        response,
        broker_enabled=broker_enabled,
        lock_parent=prepared.path,
        broker_directory=args.broker_dir,
        host_paths=FilesystemHostPaths(args.broker_dir),
    )
    stdout.write(response_to_json(patched) + "\n")
    stdout.flush()
    return 0


def _allocate_cdi(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid allocate --cdi}: the same preparation and clean-up as
    C{allocate}, but the response names the CDI device (C{cdiDevices}, and
    with C{--cdi-annotations} the C{cdi.k8s.io/} annotation too) instead of
    carrying the mounts.  Nothing on stdout unless every step succeeded.
    """
    from hostpid.gate import gate_enabled
    from hostpid.node.allocation import (
        MAX_INPUT_BYTES,
        AllocationResponseError,
        response_from_json,
        response_to_json,
    )
    from hostpid.node.cdi import CdiSpecError, patch_response_cdi
    from hostpid.node.hostpaths import FilesystemHostPaths
    from hostpid.node.lockparent import LockParentError, prepare_lock_parent

    broker_enabled = gate_enabled()
    try:
        response = response_from_json(sys.stdin.buffer.read(MAX_INPUT_BYTES + 1))
        patched = patch_response_cdi(
            response, broker_enabled=broker_enabled, annotate=args.cdi_annotations,
            host_paths=FilesystemHostPaths(args.broker_dir),
        )
    except (AllocationResponseError, CdiSpecError) as e:
        print(f"hostpid: {e}", file=stderr)
        return 1
    try:
        prepared = prepare_lock_parent(args.lock_parent, broker_enabled=broker_enabled)
    except LockParentError as e:
        print(f"hostpid: {e}", file=stderr)
        return 1
    for line in prepared.describe_repairs():
        print(f"hostpid: {line}", file=stderr)
    stdout.write(response_to_json(patched) + "\n")
    stdout.flush()
    return 0


def _cdi(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid cdi}: prepare the lock parent (and, with the gate on here, its
    broker mountpoint) as C{allocate} does, then write the CDI spec
    atomically into C{--dir} (or print it, with C{--dir -}).  One line on
    stderr naming the path and the rule when refused; nothing written then.
    """
    from hostpid.errors import PathRuleError
    from hostpid.gate import gate_enabled
    from hostpid.node.cdi import CdiSpecError, qualified_name
    from hostpid.node.cdiwrite import publish_spec

    broker_enabled = gate_enabled()
    try:
        published = publish_spec(
            None if args.dir == "-" else args.dir,
            broker_enabled=broker_enabled,
            lock_parent=args.lock_parent,
            broker_directory=args.broker_dir,
            version=args.cdi_version,
        )
    except CdiSpecError as e:
        print(f"hostpid: cdi: {e}", file=stderr)
        return 1
    except PathRuleError as e:
        print(f"hostpid: {e}", file=stderr)
        return 1
    for line in published.prepared.describe_repairs():
        print(f"hostpid: {line}", file=stderr)
    if published.written is None:
        stdout.write(published.text)
    else:
        state = "broker enabled" if broker_enabled else "broker disabled: lock parent only"
        print(f"{published.written.path}: CDI spec written "
              f"({qualified_name('broker')}: {state})", file=stdout)
    stdout.flush()
    return 0


def _add_cdi_parser(commands: argparse._SubParsersAction) -> None:
    from hostpid.node import cdi

    parser = commands.add_parser(
        "cdi",
        help="prepare the lock parent and write the CDI spec (kind hami.io/hostpid)",
    )
    parser.add_argument(
        "--dir", default=cdi.DEFAULT_SPEC_DIRECTORY, metavar="DIR",
        help="CDI spec directory (default %(default)s); '-' prints the spec instead",
    )
    parser.add_argument("--lock-parent", default=defaults.LOCK_PARENT, metavar="PATH")
    parser.add_argument("--broker-dir", default=defaults.BROKER_DIRECTORY, metavar="PATH")
    parser.add_argument(
        "--cdi-version", default=cdi.DEFAULT_VERSION, metavar="V",
        help=f"cdiVersion to write (default %(default)s; {cdi.MINIMUM_VERSION} or newer)",
    )
    parser.set_defaults(run=_cdi)


#: The longest client deadline the command accepts, in seconds.  The broker
#: answers within its own 0.5 s deadline; anything near this is a typo, and
#: far larger values overflow the kernel's timeout types.
MAX_TIMEOUT = 3600.0


def _timeout_seconds(text: str) -> float:
    """
    An C{argparse} type for C{--timeout}: a finite number of seconds in
    (0, L{MAX_TIMEOUT}].  C{nan}, C{inf}, 0, negative numbers and C{1e12}
    are usage errors (exit 2) naming the option, never a traceback.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a number of seconds greater than 0 and at most {MAX_TIMEOUT:g}"
        )
    return value


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
        "--timeout", type=_timeout_seconds, default=defaults.DEADLINE, metavar="S",
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
    allocate.add_argument(
        "--cdi", action="store_true",
        help="name the CDI device hami.io/hostpid in cdiDevices instead of adding mounts",
    )
    allocate.add_argument(
        "--cdi-annotations", action="store_true",
        help="with --cdi, also name it in a cdi.k8s.io/ annotation (kubelets before 1.29)",
    )
    allocate.set_defaults(run=_allocate)
    _add_cdi_parser(commands)
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
