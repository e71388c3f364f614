"""
Reading the kernel's word on who is at the other end of a Unix socket.

C{SO_PEERCRED} reports the peer's PID, UID and GID as they were when it called
C{connect()}, translated into the reader's PID namespace.  Twisted exposes no
wrapper, so this module is the one place that knows the C{struct ucred} layout.

Credentials are fixed at connect time.  If the process that connected has
since handed the connection on and exited, its PID may already name another
process.  C{SO_PEERPIDFD} (Linux 6.5+) gives a pidfd for the very process that
connected, and C{pidfd_send_signal(pidfd, 0)} (Linux 5.1+) tells whether
that process still exists, which is what makes its PID still its own:
L{PeerIdentifier} answers only then.  Where that system call is refused (a
seccomp filter), C{PIDFD_GET_INFO} (Linux 6.13+, else C{/proc/self/fdinfo})
gives the pidfd's current PID instead, which must equal the one reported.

Before Linux 6.5 there is no pidfd for the connecting process, only its PID.
L{PeerIdentifier} then looks the PID up again with C{pidfd_open} (Linux
5.3+), refuses it if the process it names started after the connection was
could have been made (L{PeerIdentifier.useConnectFloor}: the last moment
the listener's backlog was seen empty; L{hostpid.starttime}), and asks the
same liveness question of that pidfd after reading the start time, so the
start time read is that process's.  A PID recycled within that moment's
clock tick is the window that remains; C{docs/security.md} states it.
"""

from __future__ import annotations

import _socket
import enum
import errno
import fcntl
import os
import signal
import struct
from collections.abc import Callable

# A client reads SO_PEERCRED alone, from the module that keeps it
# (hostpid.ucred, which an exec probe loads without this one); the
# broker's side is here.
from hostpid.ucred import SO_PEERCRED, SOL_SOCKET
from hostpid.ucred import PeerCredentials as PeerCredentials
from hostpid.ucred import peer_credentials as peer_credentials

try:
    # A descriptor or a socket object alike: the broker's fast path holds
    # its connections as bare descriptors where the C helper is built
    # (hostpid.broker.connections).
    from _hostpid_native import getsockopt as _getsockopt
except ImportError:
    _getsockopt = _socket.socket.getsockopt  # type: ignore[assignment]

from hostpid.starttime import TICK_NS, boottime_ns, proc_shows_own_namespace, started_after

TYPE_CHECKING = False
if TYPE_CHECKING:
    from twisted.logger import Logger

#: C{SO_PEERPIDFD} from C{asm-generic/socket.h}; Python 3.11 has no constant.
SO_PEERPIDFD = 77
#: C{_IOWR(PIDFS_IOCTL_MAGIC, 11, struct pidfd_info)} with the 64-byte version 0.
PIDFD_GET_INFO = 0xC040FF0B
PIDFD_INFO_PID = 1
_PIDFD_INFO = struct.Struct("QQI")
_PIDFD_INFO_SIZE = 64


#: A connected Unix socket: a socket object, or (where the C helper is
#: built) its descriptor.
Socket = _socket.socket | int


def peer_pidfd(sock: Socket) -> int:
    """
    A new pidfd for the process that connected C{sock}; the caller closes it.

    @raise OSError: C{ENOPROTOOPT} on kernels before 6.5, or another error.
    """
    # The option as a C int.
    return _getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD)


_pidfd_send_signal = signal.pidfd_send_signal


def pidfd_alive(pidfd: int) -> bool:
    """
    Whether the process C{pidfd} refers to still exists (a zombie not yet
    reaped does: its PID is not free for reuse).  One system call, the
    cheapest the kernel offers for the question: signal 0 is only checked,
    never sent.  C{EPERM} (not ours to signal) still means it exists.

    @raise OSError: anything but C{ESRCH} and C{EPERM}.
    """
    try:
        _pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pidfd_open_refusal(pidfdOpen: Callable[[int], int] = os.pidfd_open) -> OSError | None:
    """
    Why C{pidfd_open} cannot be used here, or C{None} if it can: opening a
    pidfd for this very process must succeed.  A seccomp filter (container
    runtimes' default profiles before they knew the call) answers C{EPERM}
    or C{ENOSYS}.
    """
    try:
        own = pidfdOpen(os.getpid())
    except OSError as e:
        return e
    os.close(own)
    return None


def pidfd_signal_usable() -> bool:
    """
    Whether L{pidfd_alive} can be trusted here: signalling our own pidfd
    with 0 must succeed.  A seccomp filter that refuses the system call
    answers C{EPERM} (or C{ENOSYS}), which L{pidfd_alive} would read as
    "exists" for every peer.
    """
    try:
        own = os.pidfd_open(os.getpid())
    except OSError:
        return False
    try:
        _pidfd_send_signal(own, 0)
    except OSError:
        return False
    finally:
        os.close(own)
    return True


def _fdinfo_pid(pidfd: int) -> int | None:
    with open(f"/proc/self/fdinfo/{pidfd}", "rb") as info:
        for line in info:
            if line.startswith(b"Pid:"):
                pid = int(line.split()[1])
                return pid if pid > 0 else None
    return None


def pidfd_current_pid(pidfd: int) -> int | None:
    """
    The PID, in this PID namespace, of the process C{pidfd} refers to, or
    C{None} if that process is gone.  One C{ioctl} where the kernel has
    C{PIDFD_GET_INFO}; C{/proc/self/fdinfo} otherwise.
    """
    buffer = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("Q", buffer, 0, PIDFD_INFO_PID)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buffer)
    except OSError as e:
        if e.errno == errno.ESRCH:
            return None
        if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            return _fdinfo_pid(pidfd)
        raise
    mask, _cgroup, pid = _PIDFD_INFO.unpack_from(buffer)
    if not mask & PIDFD_INFO_PID:
        return _fdinfo_pid(pidfd)
    return int(pid)


class PeerUnverified(Exception):
    """The peer's host PID cannot be vouched for; close with no reply."""


class PeerCredentialsFailed(PeerUnverified):
    """C{SO_PEERCRED} failed, or reported a PID that is not positive."""


class PeerGone(PeerUnverified):
    """The process that connected has exited (or its PID now names another process)."""


class LivenessCheck(enum.Enum):
    """
    How L{PeerIdentifier} vouches that the connecting process is still the
    one its PID names; the value names it in metrics and logs.
    """

    #: C{SO_PEERPIDFD} (Linux 6.5+): a pidfd for the very process that
    #: connected, asked whether it still exists.
    PEERPIDFD = "peerpidfd"
    #: C{pidfd_open(pid)} (Linux 5.3+) after C{SO_PEERCRED}: the PID looked
    #: up again, refused if its process started after the accept.
    PIDFD_OPEN = "pidfd_open"
    #: C{SO_PEERCRED} alone: no check (C{pidfd_open} refused, or for tests).
    NONE = "none"


#: C{SO_PEERPIDFD}'s answer for a peer that exited and was reaped on Linux
#: 6.5-6.15: C{pidfd_prepare()} finds no thread-group task on the peer's
#: C{struct pid} (C{EINVAL}; the 6.16 development branch's C{ESRCH} was
#: turned back into C{EINVAL} in C{net/core/sock.c} before release).  From
#: 6.16 the option passes C{PIDFD_STALE} and returns a pidfd for a reaped
#: peer, which the liveness question then finds gone.
PEERPIDFD_GONE = frozenset({errno.EINVAL})
#: C{pidfd_open(pid)}'s answers for a PID that names no process (C{ESRCH}),
#: or only a thread that is not a thread-group leader (C{EINVAL} before
#: Linux 6.16, C{ENOENT} from 6.16): neither is the process that connected,
#: whose PID was its thread-group ID.
PIDFD_OPEN_GONE = frozenset({errno.ESRCH, errno.EINVAL, errno.ENOENT})


class _LazyLogger:
    """
    A class's C{twisted.logger.Logger}, made on first use: importing this
    module (the broker's fast path, a test) loads no Twisted.
    """

    def __get__(self, instance: object, owner: type) -> Logger:
        from twisted.logger import Logger

        return Logger().__get__(instance, owner)


class PeerIdentifier:
    """
    Finds the host PID of a connected peer, and vouches that the process that
    connected is still the one that PID names.

    L{LivenessCheck.PEERPIDFD} where the kernel has C{SO_PEERPIDFD}; before
    Linux 6.5, L{LivenessCheck.PIDFD_OPEN}; where C{pidfd_open} is refused,
    C{SO_PEERCRED} alone (L{LivenessCheck.NONE}).  The fallback is found on
    the first peer and said once in the log; L{check} tells the metrics.

    Callers that know when a connection was accepted pass it to
    L{host_pid} (a L{boottime_ns} reading taken after C{accept} returned):
    L{acceptClock} is that clock while the check in force may need it, and
    C{None} once it is known not to.

    @ivar check: the check in force, or C{None} until the first peer.
    """

    log = _LazyLogger()

    def __init__(
        self,
        check: LivenessCheck | None = None,
        peerPidfd: Callable[[Socket], int] = peer_pidfd,
        pidfdOpen: Callable[[int], int] = os.pidfd_open,
    ) -> None:
        """
        @param check: C{None} to use the best the kernel offers; a
            L{LivenessCheck} to force that one (tests of older kernels'
            paths).  L{LivenessCheck.PIDFD_OPEN} still falls back to
            L{LivenessCheck.NONE} where C{pidfd_open} is refused.
        """
        self._peerPidfd = peerPidfd
        self._pidfdOpen = pidfdOpen
        self.check: LivenessCheck | None = None
        #: The earliest moment a connection being answered can have been
        #: made (L{boottime_ns}): by default the moment of asking, which is
        #: after its accept; a listening port that knows better (when it
        #: last saw its backlog empty) sets its own (L{useConnectFloor}).
        self.connectFloor: Callable[[], int] = boottime_ns
        self.acceptClock: Callable[[], int] | None = self.connectFloor
        #: Why C{pidfd_open} cannot be used, if it cannot.
        self.pidfdOpenRefused = pidfd_open_refusal(pidfdOpen) if check is not _NONE else None
        #: Whether the liveness test is one C{pidfd_send_signal}, or (where
        #: that is refused) the pidfd's current PID compared with the reported one.
        self.signalCheck = check is not _NONE and pidfd_signal_usable()
        #: Whether C{/proc} shows this PID namespace, so start times can be read.
        self.startTimes = proc_shows_own_namespace()
        #: The least time (nanoseconds) in which the PID space can be cycled
        #: (L{pid_cycle_ns}).
        self.pidCycleNs = pid_cycle_ns()
        if check is not None:
            self._settle(check)

    @property
    def pidfdSupported(self) -> bool | None:
        """C{None} until the first peer, then whether C{SO_PEERPIDFD} is in force."""
        return None if self.check is None else self.check is _PEERPIDFD

    def _settle(self, check: LivenessCheck) -> None:
        if check is _PIDFD_OPEN and self.pidfdOpenRefused is not None:
            check = _NONE
        self.check = check
        self.acceptClock = self.connectFloor if check is _PIDFD_OPEN else None

    def useConnectFloor(self, floor: Callable[[], int]) -> None:
        """
        Compare callers' start times with C{floor()} rather than with the
        moment of accepting: a lower bound on when the connection being
        answered was made.

        Why: a process that started after the connection was made cannot
        be the one that made it, but a connection may wait in the listener's
        backlog for as long as the broker does not accept (a stall, a
        pause).  Meanwhile its maker may exit and its PID be given to a
        process that starts I{before} the accept: compared with the accept,
        that process would pass and be answered.  Compared with the last
        moment the backlog was seen empty (every connection accepted since
        was made after it), it is refused: the caller falls back, safely.
        """
        self.connectFloor = floor
        if self.acceptClock is not None:
            self.acceptClock = floor

    def _noPeerPidfd(self) -> None:
        """The first peer showed that this kernel has no C{SO_PEERPIDFD}: say what is used."""
        self._settle(_PIDFD_OPEN)
        if self.check is _PIDFD_OPEN:
            self.log.warn(
                "hostpid-broker: this kernel has no SO_PEERPIDFD; callers are checked with "
                "pidfd_open and their start time (liveness check: pidfd_open; a PID reused "
                "before the connection was accepted is not detected){procNote}",
                procNote="" if self.startTimes else (
                    "; /proc is not this PID namespace's, so start times are not compared"
                ),
            )
        else:
            refused = self.pidfdOpenRefused
            self.log.warn(
                "hostpid-broker: this kernel has no SO_PEERPIDFD and pidfd_open is refused "
                "({error}); replies rest on SO_PEERCRED alone (liveness check: none; a caller "
                "that exits after connecting is not detected)",
                error=errno.errorcode.get(refused.errno or 0, str(refused)) if refused else "",
            )

    def host_pid(self, sock: Socket, accepted: int = 0) -> int:
        """
        @param sock: the connection, a socket object; or its bare
            descriptor, where the C helper C{_hostpid_native} is built.
        @param accepted: when C{sock} was accepted (L{boottime_ns}), if
            known; C{0} (unknown) leaves only the C{pidfd_open} lookup and
            the liveness question, with no start-time rule.
        @raise PeerCredentialsFailed: no credentials, or PID not positive.
        @raise PeerGone: the connecting process is no longer there.
        """
        try:
            # The PID alone, as a C int: the kernel copies as much of
            # C{struct ucred} as the buffer holds, and the PID comes first.
            # No bytes object and no unpacking on the hot path.
            pid = _getsockopt(sock, SOL_SOCKET, SO_PEERCRED)
        except OSError as e:
            raise PeerCredentialsFailed(e.strerror) from None
        if pid <= 0:
            raise PeerCredentialsFailed(f"PID {pid} (peer outside this PID namespace)")
        check = self.check
        if check is _PEERPIDFD or check is None:
            peerPidfd = self._peerPidfd
            try:
                # peer_pidfd inline when it is the one in use: one call less
                # per transaction.
                pidfd = (
                    _getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD)
                    if peerPidfd is peer_pidfd
                    else peerPidfd(sock)
                )
            except OSError as e:
                if e.errno in PEERPIDFD_GONE:
                    # Only a kernel that knows the option says this (6.5-6.15).
                    if check is None:
                        self._settle(_PEERPIDFD)
                    raise PeerGone(f"connected as PID {pid}, since exited and reaped") from None
                if e.errno != errno.ENOPROTOOPT:
                    raise PeerCredentialsFailed(f"SO_PEERPIDFD: {e.strerror}") from None
                self._noPeerPidfd()
                return self.host_pid(sock, accepted)
            if check is None:
                self._settle(_PEERPIDFD)
        elif check is _PIDFD_OPEN:
            pidfd = self._openStartedBefore(pid, accepted)
        else:
            return pid
        try:
            if self.signalCheck:
                # pidfd_alive inline (the hot path's liveness question).
                try:
                    _pidfd_send_signal(pidfd, 0)
                except ProcessLookupError:
                    raise PeerGone(f"connected as PID {pid}, since exited") from None
                except PermissionError:
                    pass
                return pid
            current = pidfd_current_pid(pidfd)
        except OSError as e:
            raise PeerCredentialsFailed(f"pidfd: {e.strerror}") from None
        finally:
            os.close(pidfd)
        if current != pid:
            raise PeerGone(f"connected as PID {pid}, now {current}")
        return pid

    def connector_gone(self, sock: Socket, accepted: int = 0) -> bool:
        """
        Whether the process that connected C{sock} is known to have exited,
        so that no request on it can ever be answered (L{host_pid} would
        raise L{PeerGone}).  Asked of connections still waiting for their
        request, to give up first the slots that can never serve anyone
        (L{hostpid.broker.waiting}).  C{False} where it cannot be told:
        with no liveness check, or when the kernel refuses the question.

        @param accepted: with the start-time check, a moment I{after} the
            connection was made (its accept, or later): a process at the
            PID that started after it cannot be the connector.  Not the
            lower bound L{host_pid} is given to answer (L{connectFloor}):
            a process that started after that bound may still be the
            connector, and is refused an answer, not taken for gone.

        First the cheapest proof: C{kill(pid, 0)} failing with C{ESRCH}
        means no process has the PID the kernel reported, so the one that
        connected has exited (a PID is not given again while its process
        lives).  Under a PID spray nearly every connection asked about is
        such a one, and the check in force costs more: C{SO_PEERPIDFD}
        makes a pidfd (a file) for the reaped connector only for
        C{pidfd_send_signal} to say so, 4.2 us against 0.65 us measured,
        on the path where the broker must shed connections faster than
        one attacker's core makes them (else the listen backlog stays
        full and real clients' connects fail with C{EAGAIN}).  Any other
        result (the PID is taken, C{EPERM}, a refusal) leaves the answer
        to the check in force.
        """
        if self.check is _NONE:
            return False
        try:
            pid = _getsockopt(sock, SOL_SOCKET, SO_PEERCRED)
        except OSError:
            return False
        if pid > 0:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                pass
        try:
            self.host_pid(sock, accepted)
        except PeerGone:
            return True
        except PeerUnverified:
            return False
        return False

    def _openStartedBefore(self, pid: int, accepted: int) -> int:
        """
        L{LivenessCheck.PIDFD_OPEN}'s first two steps: a pidfd for whatever
        process C{pid} names now, refused if that process started after
        C{accepted}.  L{host_pid} then asks the liveness question of the
        pidfd: if its process is still alive after the start time was read,
        C{pid} named it the whole time since C{pidfd_open}, so the start
        time read was its own.

        @return: the pidfd, which the caller closes.
        """
        try:
            pidfd = self._pidfdOpen(pid)
        except OSError as e:
            if e.errno in PIDFD_OPEN_GONE:
                raise PeerGone(f"connected as PID {pid}, since exited") from None
            raise PeerCredentialsFailed(f"pidfd_open: {e.strerror}") from None
        # A process pidfd_open found had started by now (its start is
        # stamped before its PID is attached).  While now is still in the
        # accept's clock tick, its start tick cannot be later than the
        # accept's, so the rule cannot refuse it and /proc is not read: the
        # usual case on the fast path, which checks within microseconds of
        # the accept.
        if not self.startTimes or not accepted:
            return pidfd
        now = boottime_ns()
        # No process can take a PID that another left before the PID space
        # has cycled: a process that started within PID_CYCLE of the bound
        # on when the connection was made, and by now, cannot be a reuser.
        bound = min(now, accepted + self.pidCycleNs)
        if now // TICK_NS == bound // TICK_NS:
            return pidfd
        try:
            late = started_after(pid, bound)
        except ProcessLookupError:
            os.close(pidfd)
            raise PeerGone(f"connected as PID {pid}, since exited") from None
        except OSError as e:
            os.close(pidfd)
            raise PeerCredentialsFailed(f"/proc/{pid}/stat: {e.strerror}") from None
        except (ValueError, IndexError):
            os.close(pidfd)
            raise PeerCredentialsFailed(f"/proc/{pid}/stat: not understood") from None
        if late:
            os.close(pidfd)
            raise PeerGone(
                f"PID {pid} names a process started after the connection could have been made"
            )
        return pidfd


#: PIDs a node allocates per second at most, by any means a tenant has:
#: measured, one core cycling with C{clone(CLONE_VM|CLONE_VFORK)} allocates
#: about 47,000 a second (32,420 in 0.4-0.8 s).  Generous by forty times,
#: for many cores cloning at once: every allocation takes the kernel's one
#: C{pidmap_lock}.
PID_RATE = 2_000_000

#: PIDs the kernel never hands out again on a cycle (C{RESERVED_PIDS}).
_RESERVED_PIDS = 300


def pid_cycle_ns(path: str = "/proc/sys/kernel/pid_max") -> int:
    """
    The least time in which a PID left by an exited process can name a new
    one: the kernel allocates PIDs cyclically (C{alloc_pid},
    C{idr_alloc_cyclic}), so a PID comes back only after the rest of the
    space, C{pid_max} less the reserved PIDs, has been handed out, at
    L{PID_RATE} at most.  Only root can choose a host PID
    (C{ns_last_pid}, C{clone3}'s C{set_tid} need C{CAP_CHECKPOINT_RESTORE}
    over the initial user namespace).  0, the strictest bound, where
    C{pid_max} cannot be read.
    """
    try:
        with open(path) as f:
            pidMax = int(f.read())
    except (OSError, ValueError):
        return 0
    return max(pidMax - _RESERVED_PIDS, 0) * 10**9 // PID_RATE


_PEERPIDFD = LivenessCheck.PEERPIDFD
_PIDFD_OPEN = LivenessCheck.PIDFD_OPEN
_NONE = LivenessCheck.NONE
