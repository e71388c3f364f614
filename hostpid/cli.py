"""
The C{hostpid} command: thin glue from arguments to the library.

Each subcommand parses its options, calls one library entry point, and turns
the outcome into the exit status the contract fixes (0 success, 1 refused or
unavailable, 2 usage).  No rule lives here.
"""

from __future__ import annotations

import math
import sys

from hostpid import defaults, version

# Nothing heavier than that at import: C{hostpid probe} and C{hostpid
# nri-probe} (exec probes, a fresh interpreter every few seconds on every
# node) parse their options by hand (L{_quick_options}) and load neither
# argparse nor typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence
    from typing import NoReturn, TextIO

    from hostpid.client.trust import CheckResult, HostPidUnavailable

#: The distribution whose version C{--version} prints.
DISTRIBUTION = version.DISTRIBUTION


def _failure_line(command: str, problem: HostPidUnavailable, socket_path: str) -> str:
    """
    C{hostpid COMMAND: CHECK check failed: PATH: OBSERVED}: the check, the
    path it looked at, and what it saw, on one line.
    """
    from hostpid.client.trust import checked_path

    path = checked_path(problem.check, socket_path)
    where = f"{path}: " if path is not None else ""
    return f"hostpid {command}: {problem.check} check failed: {where}{problem.observed}\n"


def _query(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid query}: print the caller's host PID.  C{--socket} points the
    client elsewhere; every trust check stays on.
    """
    from hostpid.client import blocking as client

    policy = client.TrustPolicy(socket_path=args.socket, deadline=args.timeout)
    try:
        pid = client.query_host_pid(policy)
    except client.HostPidUnavailable as problem:
        stderr.write(_failure_line("query", problem, policy.socket_path))
        return 1
    stdout.write(f"{pid}\n")
    return 0


def _probe(args: argparse.Namespace | _ProbeArguments, stdout: TextIO, stderr: TextIO) -> int:
    """
    C{hostpid probe}: the operator's check of a running broker (and a
    container exec probe): one transaction, healthy only when the broker
    names this very process.  One line either way.  The gate in this shell
    decides nothing here; the healthy line reports it, so that an operator
    sees at once whether a workload with this environment would ask.
    """
    from hostpid.client import transaction
    from hostpid.client.trust import HostPidUnavailable

    try:
        report = transaction.probe(args.socket, args.timeout, trusted_uid=args.trusted_uid)
    except HostPidUnavailable as problem:
        stderr.write(_failure_line("probe", problem, args.socket))
        return 1
    gate = f"gate here: {report.gate.observed}"
    if not report.gate.ok:
        gate += " (information only: a workload asks only with '1')"
    stdout.write(
        f"{report.socket_path}: ok: answered PID {report.pid} (this process); "
        f"{report.socket.observed}; {gate}\n"
    )
    return 0


def _nri_probe(args: argparse.Namespace | _NRIProbeArguments, stdout: TextIO,
               stderr: TextIO) -> int:
    """
    C{hostpid nri-probe}: the kubelet's exec probe of the NRI plugin, one
    C{GET /healthz} (or C{/readyz} with C{--ready}) on the plugin's
    C{--health} listener.  One line either way.
    """
    from hostpid.nri.probe import ProbeError, get

    try:
        body = get(args.address, "/readyz" if args.ready else "/healthz", args.timeout)
    except (ProbeError, ValueError) as problem:
        stderr.write(f"hostpid nri-probe: {problem}\n")
        return 1
    stdout.write(f"{args.address}: {body}\n")
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
    # A user namespace changes what the owner and peer checks accept: say
    # which rule the lines below were judged by (docs/userns.md).
    namespace_line = _user_namespace_line(0)
    if namespace_line is not None:
        stdout.write(namespace_line)
    results = client.doctor(client.TrustPolicy(socket_path=args.socket))
    for result in results:
        stdout.write(_doctor_line(result, args.socket))
    return 0 if problem is None and all(result.ok for result in results) else 1


def _user_namespace_line(trusted_uid: int) -> str | None:
    """
    C{user-namespace ok|FAIL ...} when this process is not (or may not be)
    in the initial user namespace: which rule the doctor's checks apply.
    """
    from hostpid.client.userns import read_user_namespace

    namespace = read_user_namespace()
    if namespace.initial is True:
        return None
    if namespace.unmaps(trusted_uid):
        return (
            f"user-namespace ok {namespace.describe()}: host uid {trusted_uid} is not mapped; "
            f"the broker's directory and socket must show as uid {trusted_uid} (an idmapped "
            f"mount) or the overflow uid {namespace.overflow_uid} (a plain one), its listener "
            f"as the overflow uid with pid 0 (docs/userns.md)\n"
        )
    if namespace.initial is None:
        return f"user-namespace FAIL {namespace.describe()}: the host's rule applies\n"
    return (
        f"user-namespace ok {namespace.describe()}: host uid {trusted_uid} is mapped here, "
        f"so the host's rule applies: the broker must show as uid {trusted_uid} "
        "(docs/userns.md)\n"
    )


def _doctor_line(result: CheckResult, socket_path: str) -> str:
    """
    C{NAME ok OBSERVED}, or C{NAME FAIL PATH: OBSERVED} naming the path the
    failed check looked at, as C{query} does; a check not run names none.
    """
    from hostpid.client.trust import checked_path

    if result.ok:
        return f"{result.name} ok {result.observed}\n"
    path = checked_path(result.name, socket_path)
    where = f"{path}: " if path is not None and not result.observed.startswith("not ") else ""
    return f"{result.name} FAIL {where}{result.observed}\n"


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
    atomically into C{--cdi-dir} (or print it, with C{--cdi-dir -}).  One line on
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


def _add_cdi_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from hostpid.node import cdi

    parser = _subcommand(
        commands, "cdi",
        "prepare the lock parent and write the CDI spec (kind hami.io/hostpid)",
        "Prepare the lock parent (and, with LIBVGPU_HOSTPID_BROKER=1, its broker\n"
        "mountpoint) exactly as allocate does, then write the CDI spec atomically to\n"
        "DIR/hami.io-hostpid.json, root-owned 0644.  Exit 0 written; 1 unsafe path or\n"
        "refused, with nothing written.",
    )
    parser.add_argument(
        "--cdi-dir", "--dir", dest="dir", default=cdi.DEFAULT_SPEC_DIRECTORY, metavar="DIR",
        help="CDI spec directory, as the broker's --cdi-dir (--dir: the older spelling); '-' "
        "prints the spec instead (default: %(default)s)",
    )
    _host_path_options(parser)
    parser.add_argument(
        "--cdi-version", default=cdi.DEFAULT_VERSION, metavar="V",
        help=f"cdiVersion to write, {cdi.MINIMUM_VERSION} or newer (default: %(default)s)",
    )
    parser.set_defaults(run=_cdi)


#: The longest client deadline the command accepts, in seconds.  The broker
#: answers within its own 0.5 s deadline; anything near this is a typo, and
#: far larger values overflow the kernel's timeout types.
MAX_TIMEOUT = 3600.0


def _seconds_value(text: str) -> float | None:
    """A finite number of seconds in (0, L{MAX_TIMEOUT}], or C{None}."""
    try:
        value = float(text)
    except ValueError:
        return None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        return None
    return value


def _seconds(option: str) -> Callable[[str], float]:
    """
    An argparse type for a finite number of seconds in (0, L{MAX_TIMEOUT}]
    whose error names the option (argparse adds its own C{argument OPTION:}
    prefix, which L{_Parser} folds): C{nan}, C{inf}, 0, negative numbers and
    C{1e12} are usage errors (exit 2), never a traceback.
    """
    import argparse

    def parse(text: str) -> float:
        value = _seconds_value(text)
        if value is None:
            raise argparse.ArgumentTypeError(
                f"{option} must be a positive number of seconds, at most {MAX_TIMEOUT:g}, "
                f"got {text!r}"
            )
        return value

    return parse


def _parser_class() -> type[argparse.ArgumentParser]:
    """The argument parser, made only when a command needs one."""
    import argparse
    import re

    class _Parser(argparse.ArgumentParser):
        """
        One line for a usage error, naming the option: C{hostpid query:
        --timeout must be ...}, after the usage line, exit status 2.
        """

        def error(self, message: str) -> NoReturn:
            named = re.fullmatch(r"argument (--[\w-]+): (\1 .*)", message, re.DOTALL)
            if named is not None:
                message = named.group(2)
            self.print_usage(sys.stderr)
            self.exit(2, f"{self.prog}: {message}\n")

    return _Parser


def _subcommand(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
) -> argparse.ArgumentParser:
    import argparse

    return commands.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _socket_option(parser: argparse.ArgumentParser, default: str, what: str) -> None:
    parser.add_argument(
        "--socket", default=default, metavar="PATH",
        help=f"{what} (default: %(default)s)",
    )


def _host_path_options(parser: argparse.ArgumentParser) -> None:
    """C{--lock-parent} and C{--broker-dir}, as C{allocate} and C{cdi} share them."""
    parser.add_argument(
        "--lock-parent", default=defaults.LOCK_PARENT, metavar="PATH",
        help="host directory prepared and mounted writable at /tmp/vgpulock "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--broker-dir", default=defaults.BROKER_DIRECTORY, metavar="PATH",
        help="host broker directory mounted read-only at /tmp/vgpulock/hostpid "
        "(default: %(default)s)",
    )


def _uid_value(value: str) -> int | None:
    """A UID: a whole number from 0 to 2**32 - 2 (the kernel's (uid_t)-1 means none)."""
    try:
        uid = int(value)
    except ValueError:
        return None
    return uid if 0 <= uid < 2**32 - 1 else None


def _uid(value: str) -> int:
    """L{_uid_value} as an argparse type, whose error names the option."""
    import argparse

    uid = _uid_value(value)
    if uid is None:
        raise argparse.ArgumentTypeError(f"--trusted-uid must be a UID, got {value!r}")
    return uid


def _timeout_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=_seconds("--timeout"), default=defaults.DEADLINE, metavar="S",
        help="one deadline in seconds over connect, write and read (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _parser_class()(
        prog="hostpid",
        description="Host PID broker client and allocation helpers "
        "(the broker itself is `twistd hostpid-broker`).",
    )
    parser.add_argument(
        "--version", action="version",
        version=version.version_line(),
        help="print `hostpid X.Y.Z` and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    query = _subcommand(
        commands, "query",
        "ask the broker for this process's host PID, with every trust check",
        "Ask the broker for this process's host PID and print it, applying every client\n"
        "trust check (gate, sandbox, directory, socket, read-only mount, peer UID,\n"
        "peer PID, reply): a workload's question.  Exit 0 with the PID; 1 with one line\n"
        "on stderr naming the check that failed and the path it looked at; 2 for a\n"
        "usage error.",
    )
    _socket_option(query, defaults.CLIENT_SOCKET, "the broker socket as a workload sees it")
    _timeout_option(query)
    query.set_defaults(run=_query)

    probe = _subcommand(
        commands, "probe",
        "check a running broker from the host or its own container (an exec probe)",
        "The operator's check of a running broker, from the host or the broker's own\n"
        "container (also a container exec probe): one transaction, healthy when the reply\n"
        "has status 0 and names this process's own PID.  Every trust check applies except\n"
        "the read-only mount, which only a workload has.  The gate LIBVGPU_HOSTPID_BROKER\n"
        "is not needed here (the probe is not a workload's decision to ask): it is\n"
        "reported as information.  Exit 0 healthy (prints the PID, the socket's owner and\n"
        "mode, and the gate seen here); 1 otherwise, with one line on stderr naming the\n"
        "path and what failed.",
    )
    _socket_option(probe, defaults.BROKER_SOCKET, "the broker socket as the host sees it")
    _timeout_option(probe)
    probe.add_argument(
        "--trusted-uid", type=_uid, default=0, metavar="UID",
        help="the UID that must own the broker's directory and socket and run it: another "
        "for a broker run unprivileged with --directory (default: %(default)s)",
    )
    probe.set_defaults(run=_probe)

    nri_probe = _subcommand(
        commands, "nri-probe",
        "check a running NRI plugin from its own container (an exec probe)",
        "The kubelet's exec probe of `twistd hostpid-nri`: GET /healthz (or /readyz with\n"
        "--ready) on the plugin's --health listener, which no other pod reaches.  Exit 0\n"
        "on 200 (prints the answer); 1 otherwise, with one line on stderr naming the\n"
        "address and what failed.",
    )
    nri_probe.add_argument(
        "--address", default=defaults.NRI_PROBE_ADDRESS, metavar="HOST:PORT|PATH",
        help="the plugin's --health listener, HOST:PORT ([::1]:PORT) or a Unix socket path; "
        "the chart's plugin listens at the default (default: %(default)s)",
    )
    nri_probe.add_argument(
        "--ready", action="store_true",
        help="ask /readyz (configured by the runtime, host sound at the last look) instead "
        "of /healthz (the plugin answers) (default: %(default)s)",
    )
    nri_probe.add_argument(
        "--timeout", type=_seconds("--timeout"), default=defaults.NRI_PROBE_TIMEOUT, metavar="S",
        help="one deadline in seconds over connect, write and read (default: %(default)s)",
    )
    nri_probe.set_defaults(run=_nri_probe)

    doctor = _subcommand(
        commands, "doctor",
        "run each client trust check and print one line per check",
        "Run every client trust check, as a workload would, and print one line per\n"
        "check: NAME ok|FAIL OBSERVED.  Exit 0 when every line is ok, 1 otherwise.",
    )
    _socket_option(doctor, defaults.CLIENT_SOCKET, "the broker socket as a workload sees it")
    doctor.set_defaults(run=_doctor)

    prepare = _subcommand(
        commands, "prepare-lock-parent",
        "prepare the shared lock parent (root-owned, 01777) by descriptors only",
        "Prepare the shared lock parent: root-owned, mode 01777, by descriptor-based\n"
        "steps that never follow a symlink; with LIBVGPU_HOSTPID_BROKER=1 also its broker\n"
        "mountpoint.  Exit 0 prepared; 1 unsafe (one line on stderr: path and rule).",
    )
    prepare.add_argument(
        "--path", default=defaults.LOCK_PARENT, metavar="PATH",
        help="the lock parent on the host (default: %(default)s)",
    )
    prepare.set_defaults(run=_prepare_lock_parent)

    allocate = _subcommand(
        commands, "allocate",
        "patch a ContainerAllocateResponse (JSON on stdin) with the lock parent "
        "and broker mounts",
        "Read a kubelet ContainerAllocateResponse as JSON on stdin, prepare the lock\n"
        "parent, and write the patched response on stdout; the broker mount and gate\n"
        "follow LIBVGPU_HOSTPID_BROKER in this environment.  Exit 0 written; 1 unsafe\n"
        "lock parent or invalid JSON, with nothing on stdout.",
    )
    _host_path_options(allocate)
    allocate.add_argument(
        "--cdi", action="store_true",
        help="name the CDI device hami.io/hostpid in cdiDevices instead of adding mounts "
        "(default: %(default)s)",
    )
    allocate.add_argument(
        "--cdi-annotations", action="store_true",
        help="with --cdi, also name it in a cdi.k8s.io/ annotation, for kubelets before 1.29 "
        "(default: %(default)s)",
    )
    allocate.set_defaults(run=_allocate)
    _add_cdi_parser(commands)
    return parser


class _ProbeArguments:
    """C{hostpid probe}'s options, as L{_probe} reads them."""

    def __init__(self, socket: str, timeout: float, trusted_uid: int) -> None:
        self.socket = socket
        self.timeout = timeout
        self.trusted_uid = trusted_uid


class _NRIProbeArguments:
    """C{hostpid nri-probe}'s options, as L{_nri_probe} reads them."""

    def __init__(self, address: str, ready: bool, timeout: float) -> None:
        self.address = address
        self.ready = ready
        self.timeout = timeout


def _quick_options(
    words: Sequence[str], options: dict[str, str | None], flags: dict[str, bool]
) -> bool:
    """
    C{--name value} (also C{--name=value}) for each of C{options} and bare
    C{--flag} for each of C{flags}, filled in place; False for anything else,
    which then goes to the full parser: help, a usage error, an abbreviation,
    a value that starts with C{-}.  So an exec probe behaves as the parser
    says, at a fraction of its import cost.
    """
    words = list(words)
    while words:
        name, equals, value = words.pop(0).partition("=")
        if name in flags and not equals:
            flags[name] = True
            continue
        if name not in options:
            return False
        if not equals:
            if not words:
                return False
            value = words.pop(0)
        if not value or value.startswith("-"):
            return False
        options[name] = value
    return True


def _quick_seconds(text: str | None, default: float) -> float | None:
    """C{--timeout} as L{_seconds_value} reads it, C{default} when not given, None if invalid."""
    return default if text is None else _seconds_value(text)


def _probe_arguments(argv: Sequence[str]) -> _ProbeArguments | _NRIProbeArguments | None:
    """
    C{probe [--socket PATH] [--timeout S] [--trusted-uid UID]} or
    C{nri-probe [--address ADDRESS] [--ready] [--timeout S]} parsed without
    argparse (L{_quick_options}), or C{None} for anything else.
    """
    if argv and argv[0] == "nri-probe":
        return _nri_probe_arguments(argv[1:])
    if not argv or argv[0] != "probe":
        return None
    options: dict[str, str | None] = {
        "--socket": defaults.BROKER_SOCKET, "--timeout": None, "--trusted-uid": None}
    if not _quick_options(argv[1:], options, {}):
        return None
    timeout = _quick_seconds(options["--timeout"], defaults.DEADLINE)
    if timeout is None:
        return None
    uid = 0
    if options["--trusted-uid"] is not None:
        parsed = _uid_value(options["--trusted-uid"])
        if parsed is None:
            return None
        uid = parsed
    return _ProbeArguments(str(options["--socket"]), timeout, uid)


def _nri_probe_arguments(words: Sequence[str]) -> _NRIProbeArguments | None:
    options: dict[str, str | None] = {"--address": defaults.NRI_PROBE_ADDRESS,
                                      "--timeout": None}
    flags = {"--ready": False}
    if not _quick_options(words, options, flags):
        return None
    timeout = _quick_seconds(options["--timeout"], defaults.NRI_PROBE_TIMEOUT)
    if timeout is None:
        return None
    return _NRIProbeArguments(str(options["--address"]), flags["--ready"], timeout)


def main(
    argv: Sequence[str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments == ["--version"]:
        # Before the parser: building it imports every subcommand's
        # modules (attrs, the CDI spec's), four interpreter starts' worth
        # of CPU for one line.
        (stdout or sys.stdout).write(version.version_line() + "\n")
        return 0
    probing = _probe_arguments(arguments)
    if isinstance(probing, _NRIProbeArguments):
        return _nri_probe(probing, stdout or sys.stdout, stderr or sys.stderr)
    if probing is not None:
        return _probe(probing, stdout or sys.stdout, stderr or sys.stderr)
    args = build_parser().parse_args(argv)
    status: int = args.run(args, stdout or sys.stdout, stderr or sys.stderr)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
