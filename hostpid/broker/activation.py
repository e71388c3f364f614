"""
systemd's side of the listener, without libsystemd: socket activation
(C{LISTEN_FDS}) and the service's file descriptor store (C{FDSTORE=1}).

With C{hostpid-broker.socket}, systemd binds the broker socket itself and
passes it on every start; with the service's descriptor store, the broker
hands the listener it bound to systemd, which keeps it while the service
restarts (C{systemctl restart}, C{Restart=on-failure} after a crash) and
passes it back on the next start.  Either way the socket, its inode and its
accept queue live across the restart: connections made meanwhile wait in the
queue instead of finding no socket (each still within the client's own
deadline, so a restart slower than that deadline is still felt).

The protocol, as C{sd_listen_fds(3)} and C{sd_notify(3)} describe it:
descriptors from 3 (C{SD_LISTEN_FDS_START}) on, C{LISTEN_FDS} of them, meant
for this process only when C{LISTEN_PID} is its PID, named by
C{LISTEN_FDNAMES} (colon-separated); a store request is a datagram
C{FDSTORE=1\\nFDNAME=NAME} to C{$NOTIFY_SOCKET} carrying the descriptor with
C{SCM_RIGHTS}.  systemd 254 and later set C{$FDSTORE} to the store's size,
so the broker stores only where a store exists.

A passed descriptor is trusted only after L{check_listener}: an C{AF_UNIX}
stream socket, listening, bound at this broker's own socket path, and that
path a socket of the expected owner with mode 0666.  Anything else is a
startup refusal in one line, naming the rule.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from collections.abc import Mapping

import attrs

from hostpid import defaults
from hostpid.broker import fsrules
from hostpid.broker.fsrules import BrokerStartupError, SocketIdentity

#: C{SD_LISTEN_FDS_START}.
LISTEN_FDS_START = 3
#: The name the socket unit (C{FileDescriptorName=}) and the store use.
LISTENER_NAME = "broker"
#: At most this many passed descriptors are looked at (the rest are closed).
MAX_PASSED = 16


@attrs.frozen
class Passed:
    """A descriptor systemd passed, with its name (C{"unknown"} if unnamed)."""

    fd: int
    name: str


def passed_descriptors(environ: Mapping[str, str], pid: int | None = None) -> list[Passed]:
    """
    The descriptors systemd passed to this process, or none: C{LISTEN_PID}
    must be this process (a child that inherited the variables is not
    meant).  Each is made close-on-exec.  Reading them twice is harmless;
    the caller unsets the variables (L{forget}).
    """
    names = environ.get("LISTEN_FDNAMES", "").split(":") if environ.get("LISTEN_FDNAMES") else []
    try:
        listen_pid = int(environ.get("LISTEN_PID", ""))
        count = int(environ.get("LISTEN_FDS", ""))
    except ValueError:
        fds = _consumed_by_twisted()
    else:
        mine = listen_pid == (os.getpid() if pid is None else pid)
        fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + count)) if mine else []
    passed = []
    for index, fd in enumerate(fds[:MAX_PASSED]):
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue
        passed.append(Passed(fd, names[index] if index < len(names) else "unknown"))
    return passed


def _consumed_by_twisted() -> list[int]:
    """
    What Twisted took from the environment: importing
    C{twisted.internet.endpoints} (twistd and the metrics option do) parses
    and unsets C{LISTEN_PID} and C{LISTEN_FDS} at once, checking
    C{LISTEN_PID} itself, and keeps the result on its C{systemd:} endpoint
    parser (twisted/internet/endpoints.py, C{_SystemdParser._sddaemon}, read
    from Twisted 26.10's source).  Its public C{ListenFDs.fromEnvironment}
    finds nothing after that, so the record is read here; no Twisted that
    lacks it is assumed to have consumed anything.
    """
    import sys

    endpoints = sys.modules.get("twisted.internet.endpoints")
    parser = getattr(endpoints, "_SystemdParser", None)
    record = getattr(parser, "_sddaemon", None)
    inherited = getattr(record, "inheritedDescriptors", None)
    return list(inherited()) if callable(inherited) else []


def forget(environ: dict[str, str] | os._Environ[str]) -> None:
    """Unset the variables, as C{sd_listen_fds(1)} does: children must not see them."""
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(name, None)


def check_listener(
    fd: int, directory_fd: int, directory: str, expected_uid: int
) -> tuple[socket.socket, SocketIdentity]:
    """
    The passed descriptor as the broker's listener, and the identity of the
    path it is bound at.

    @raise BrokerStartupError: it is not an C{AF_UNIX} stream socket that
        listens, bound at this directory's socket path, which must be a
        socket of C{expected_uid} with mode 0666.  The descriptor is left
        open (the caller closes what it does not use).
    """
    path = os.path.join(directory, defaults.SOCKET_NAME)
    info = os.fstat(fd)
    if not stat.S_ISSOCK(info.st_mode):
        raise BrokerStartupError(path, f"passed descriptor {fd} is not a socket; not used")
    sock = socket.socket(fileno=os.dup(fd))
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise BrokerStartupError(
                path, f"passed descriptor {fd} is not an AF_UNIX stream socket; not used"
            )
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise BrokerStartupError(path, f"passed descriptor {fd} is not listening; not used")
        name = sock.getsockname()
        if not isinstance(name, str) or not name or not _same_path(name, path):
            raise BrokerStartupError(
                path, f"passed descriptor {fd} is bound at {name!r}, not at this broker's "
                "socket path; not used"
            )
        now = fsrules.identify_socket(directory_fd)
        if now is None or not stat.S_ISSOCK(now.st_mode):
            raise BrokerStartupError(
                path, f"passed descriptor {fd}: the socket path holds no socket; not used"
            )
        if now.st_uid != expected_uid or stat.S_IMODE(now.st_mode) != defaults.SOCKET_MODE:
            raise BrokerStartupError(
                path, f"passed socket is UID {now.st_uid} mode {stat.S_IMODE(now.st_mode):04o}; "
                f"the rules require UID {expected_uid} mode {defaults.SOCKET_MODE:04o} "
                "(SocketUser=, SocketMode=); not used"
            )
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock, SocketIdentity.of(now)


def _same_path(bound: str, path: str) -> bool:
    """
    Whether C{bound} (the listener's own name) is C{path}: the same
    directory as the kernel resolves it (C{/var/run} is C{/run}), or, for a
    listener this broker bound and stored, C{/proc/self/fd/N/broker.sock}:
    a broker binds through its directory's descriptor, and that name is all
    the kernel kept (the path's owner and mode are checked next).
    """
    if os.path.basename(bound) != os.path.basename(path):
        return False
    directory = os.path.dirname(bound)
    if re.fullmatch(r"/proc/self/fd/[0-9]+", directory):
        return True
    return os.path.realpath(directory) == os.path.realpath(os.path.dirname(path))


def store_enabled(environ: Mapping[str, str]) -> bool:
    """Whether systemd offers a descriptor store here (C{$FDSTORE}, systemd 254+)."""
    try:
        return bool(environ.get("NOTIFY_SOCKET")) and int(environ.get("FDSTORE", "0")) > 0
    except ValueError:
        return False


def store(sock: socket.socket, environ: Mapping[str, str], name: str = LISTENER_NAME) -> None:
    """
    Hand systemd a copy of the listener to keep across restarts.

    @raise OSError: the notification socket cannot be reached.
    """
    address = environ["NOTIFY_SOCKET"]
    if address.startswith("@"):
        address = "\0" + address[1:]
    message = f"FDSTORE=1\nFDNAME={name}".encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
        notify.connect(address)
        socket.send_fds(notify, [message], [sock.fileno()])


def remove_stored(environ: Mapping[str, str], name: str = LISTENER_NAME) -> None:
    """
    Ask systemd to drop the stored listener: after the socket path was
    removed or replaced, passing it back to the next start would only make
    that start refuse it.

    @raise OSError: the notification socket cannot be reached.
    """
    address = environ["NOTIFY_SOCKET"]
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
        notify.sendto(f"FDSTOREREMOVE=1\nFDNAME={name}".encode(), address)
