"""
The broker's view of its mountpoint in the lock parent, which a root workload
can remove or replace.

A UID 0 workload without a user namespace owns C{/tmp/vgpulock/hostpid} as
much as the broker does: it can C{rmdir} it (the kernel then detaches the
broker mount in every running container that has it: a mountpoint in
another mount namespace does not stop C{rmdir}), or put something else
there for the containers started next.  The broker cannot prevent that, but
when it knows the lock parent it can see it within a watch interval and say
so: L{MountpointWatch.check} looks (C{lstat}, never following, changing
nothing) and logs each change once, counted in L{MountpointWatch.events}.
"""

from __future__ import annotations

import os
import stat

from twisted.logger import Logger

from hostpid import defaults, fileattr

MOUNTPOINT_NAME = os.path.basename(defaults.CONTAINER_BROKER_DIRECTORY)

log = Logger(namespace="hostpid.broker.mountwatch")


class MountpointWatch:
    """
    Watches C{<lock parent>/hostpid}: a directory owned by C{trusted_uid},
    with the identity (device, inode, change time) it had when first seen.

    @ivar events: how many times it went missing or was replaced.
    @ivar state: C{"unseen"} (not made yet), C{"ok"}, C{"missing"} or
        C{"replaced"}.
    """

    def __init__(self, lock_parent: str, trusted_uid: int = 0) -> None:
        self.path = os.path.join(lock_parent, MOUNTPOINT_NAME)
        self.trusted_uid = trusted_uid
        self.identity: tuple[int, int, int] | None = None
        self.state = "unseen"
        self.events = 0
        #: What the last problem looked like, so that one that stays in place
        #: is logged and counted once, not at every look.
        self._lastProblem: tuple[str, tuple[int, int, int] | None] | None = None
        self._seen: tuple[int, int, int] | None = None
        #: The modification time the directory had when first seen.
        self._mtime = 0

    def _observe(self) -> tuple[str, str]:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            self._seen = None
            return "missing", "it does not exist"
        except OSError as e:
            self._seen = None
            return "missing", f"it cannot be looked at ({e.strerror})"
        self._seen = (st.st_dev, st.st_ino, st.st_ctime_ns)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != self.trusted_uid:
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
            return "replaced", f"it is {kind} owned by UID {st.st_uid}"
        # The inode number of a removed directory is often reused at once for
        # the next one; its change time is not.
        identity = (st.st_dev, st.st_ino, st.st_ctime_ns)
        if self.identity is None:
            self.identity = identity
            self._mtime = st.st_mtime_ns
            return "ok", "a directory"
        if identity != self.identity:
            if self._sealed(st):
                self.identity = identity
                log.info("hostpid-broker: broker mountpoint {path} is now immutable",
                         path=self.path)
                return "ok", "a directory"
            self.identity = identity
            self._mtime = st.st_mtime_ns
            return "replaced", "it is another directory than the one first seen"
        return "ok", "a directory"

    def _sealed(self, st: os.stat_result) -> bool:
        """
        Whether the only change is the immutable attribute a preparation set
        on the same directory (the NRI plugin, which has the capability the
        broker's pod has not, makes the broker's mountpoint immutable): same
        device and inode, same modification time (a directory made anew in
        its place has its own), and immutable now, so nothing can replace
        it from here on.
        """
        assert self.identity is not None
        if (st.st_dev, st.st_ino, st.st_mtime_ns) != (*self.identity[:2], self._mtime):
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                         | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            held = os.fstat(fd)
            return (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino) and \
                fileattr.is_immutable(fd)
        except OSError:
            return False
        finally:
            os.close(fd)

    def check(self) -> str | None:
        """
        Look once; log and count a change from a seen mountpoint to a missing
        or replaced one.  Returns what was logged, if anything.
        """
        state, observed = self._observe()
        previous, self.state = self.state, state
        if state == "ok":
            self._lastProblem = None
            if previous in ("missing", "replaced"):
                log.info("hostpid-broker: broker mountpoint {path} is back: {observed}",
                         path=self.path, observed=observed)
            return None
        if previous == "unseen" and state == "missing":
            self.state = "unseen"  # not made yet: the first allocation makes it
            return None
        problem = (state, self._seen)
        if state == previous and problem == self._lastProblem:
            return None  # the same problem, still there: logged and counted already
        self._lastProblem = problem
        self.events += 1
        message = (
            f"broker mountpoint {self.path} {state}: {observed}; containers that had the "
            "broker mounted there may have lost it (something running as root in the lock "
            "parent, see docs/security.md)"
        )
        log.warn("hostpid-broker: {message}", message=message, path=self.path, state=state,
                 events=self.events)
        return message
