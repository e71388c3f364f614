"""
What a broker with its gate off does with a socket a killed broker left.

Rollback turns the gate off.  A broker stopped by SIGTERM removes its socket;
one that was SIGKILLed (an OOM kill, a node drain gone wrong) leaves it, and a
workload whose broker mount is still there would then fail at C{connect}
(C{ECONNREFUSED}) instead of finding no socket.  So the disabled broker
removes that socket, under the same rules as at startup and nothing more:
only a stale socket (a connect probe is refused) owned by the expected UID,
only while holding the broker lock (so never under a broker that is
starting or serving), and it creates nothing: no directory, no lock file.
"""

from __future__ import annotations

import errno
import fcntl
import os

from hostpid import defaults
from hostpid.broker import fsrules

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def remove_stale_socket(directory: str, expected_uid: int) -> str | None:
    """
    Remove the socket in C{directory} if it is stale and owned by
    C{expected_uid}; change nothing otherwise.

    @return: C{None} when a stale socket was removed, else why nothing was
        done (for one log line).
    """
    try:
        directory_fd = os.open(directory, _DIRECTORY_FLAGS)
    except OSError as e:
        return f"no broker directory to look in ({errno.errorcode.get(e.errno or 0, e)})"
    try:
        if os.fstat(directory_fd).st_uid != expected_uid:
            return f"the directory is not owned by UID {expected_uid}"
        try:
            lock_fd = os.open(defaults.LOCK_NAME, _LOCK_FLAGS, dir_fd=directory_fd)
        except OSError:
            return "no broker lock file: no broker of ours left a socket here"
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "another broker holds the lock"
            try:
                state = fsrules.clear_socket_path(directory_fd, directory, expected_uid)
            except fsrules.BrokerStartupError as e:
                return e.rule
            if state is fsrules.SocketPathState.STALE_REMOVED:
                return None
            return "no socket"
        finally:
            os.close(lock_fd)
    finally:
        os.close(directory_fd)
