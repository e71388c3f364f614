"""
Writing the CDI spec into a spec directory, by descriptors only, and the
one entry point both C{hostpid cdi} and the broker use.

A CDI runtime reads every C{*.json} in C{/etc/cdi} and C{/var/run/cdi} as
root and applies it to every container that names one of its devices, so
whoever can write or replace that file decides what those containers mount.
The rules:

 - The spec directory's own parent is opened normally (C{/var/run} is a
   symlink to C{/run} on most systems; it is root's), and must be owned by
   root and not writable by group or other unless sticky.
 - The spec directory is created 0755 if missing and opened relative to
   that parent with C{O_NOFOLLOW}: a symlink there is refused, as is a
   directory owned by anyone but root or writable by group or other.
 - An existing spec file must be a regular file owned by root (a symlink or
   a foreign file is refused and left untouched).
 - The new content goes to a fresh temporary name (C{O_CREAT|O_EXCL|
   O_NOFOLLOW}, mode 0644 set by descriptor), is flushed, and is renamed over
   the spec file inside the directory descriptor.  The temporary name does
   not end in C{.json}, so no runtime ever reads a half-written spec.  Just
   before the rename the name must still be the file we wrote, and just
   after it the spec name must be: a replacement in between is refused and
   left in place (nothing is deleted that we did not create).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs
from twisted.logger import Logger

from hostpid import defaults
from hostpid.errors import PathRuleError
from hostpid.node import cdi
from hostpid.node.allocation import clean_container_path
from hostpid.node.lockparent import PreparedLockParent, describe_type, prepare_lock_parent

_log = Logger(namespace="hostpid-broker")

#: The spec file's mode: root writes, runtimes (and operators) read.
SPEC_MODE = 0o644
#: A spec directory created here gets this mode.
DIRECTORY_MODE = 0o755
TEMPORARY_SUFFIX = ".tmp"

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

#: Called with a step name between the steps of a write; only tests pass one.
StepHook = Callable[[str], None]


class CdiWriteError(PathRuleError):
    """The spec directory or file is unsafe; nothing was written."""


@attrs.frozen
class WrittenSpec:
    """
    A spec written in place.

    @ivar path: the spec file.
    @ivar device: its C{st_dev}.
    @ivar inode: its C{st_ino}.
    """

    path: str
    device: int
    inode: int


@attrs.frozen
class PublishedSpec:
    """
    What L{publish_spec} did.

    @ivar prepared: the lock parent preparation.
    @ivar spec: the spec (decoded JSON).
    @ivar text: the spec's text.
    @ivar written: where it was written, or C{None} when only rendered.
    """

    prepared: PreparedLockParent
    spec: dict[str, object]
    text: str
    written: WrittenSpec | None


def _step(hook: StepHook | None, name: str) -> None:
    if hook is not None:
        hook(name)


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _split(directory: str) -> tuple[str, str]:
    if not directory.startswith("/"):
        raise CdiWriteError(directory, "the CDI spec directory must be an absolute path")
    parts = [part for part in directory.split("/") if part]
    if not parts:
        raise CdiWriteError(directory, "the CDI spec directory cannot be the root directory")
    if any(part in (".", "..") for part in parts):
        raise CdiWriteError(directory, "the CDI spec directory must not contain '.' or '..'")
    return "/" + "/".join(parts[:-1]), parts[-1]


def _check_owner(st: os.stat_result, trusted_uid: int, shown: str, sticky_ok: bool) -> None:
    if st.st_uid != trusted_uid:
        raise CdiWriteError(
            shown, f"is owned by UID {st.st_uid}, not UID {trusted_uid} (left untouched)"
        )
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        raise CdiWriteError(
            shown,
            f"has mode {_mode(st)}: writable by group or other, so another user could "
            "replace the spec (left untouched)",
        )


def _open_spec_directory(parent: str, name: str, shown: str, trusted_uid: int) -> int:
    try:
        parent_fd = os.open(parent, _DIRECTORY_FLAGS)
    except OSError as e:
        raise CdiWriteError(parent, f"cannot be opened: {e.strerror}") from e
    try:
        _check_owner(os.fstat(parent_fd), trusted_uid, parent, sticky_ok=True)
        created = False
        try:
            os.mkdir(name, DIRECTORY_MODE, dir_fd=parent_fd)
            created = True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                found = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
                raise CdiWriteError(
                    shown, f"is a {describe_type(found)}, not a directory (left untouched)"
                ) from e
            raise CdiWriteError(shown, f"cannot be opened: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            _check_owner(st, trusted_uid, shown, sticky_ok=False)
            if created:
                # mkdir's mode was filtered by the umask: set it by descriptor.
                os.fchmod(fd, DIRECTORY_MODE)
            return fd
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(parent_fd)


class SpecDirectory:
    """
    A checked CDI spec directory, held open by descriptor.

    Open it with L{open_spec_directory}; L{write} replaces the spec file.
    """

    def __init__(self, path: str, fd: int, trusted_uid: int) -> None:
        self.path = path
        self.fd = fd
        self.trusted_uid = trusted_uid

    def _check_existing(self, name: str, shown: str) -> None:
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            raise CdiWriteError(
                shown,
                f"is a {describe_type(st.st_mode)}, not a regular file (left untouched)",
            )
        if st.st_uid != self.trusted_uid:
            raise CdiWriteError(
                shown, f"is owned by UID {st.st_uid}, not UID {self.trusted_uid} "
                "(left untouched)"
            )

    def write(
        self,
        content: str,
        name: str = cdi.SPEC_FILE_NAME,
        between_steps: StepHook | None = None,
    ) -> WrittenSpec:
        """
        Replace C{name} with C{content}, atomically.

        @raise CdiWriteError: the existing file is unsafe, or a name changed
            under us; the spec is then not (or, if the change came after the
            rename, no longer) what we wrote.
        """
        shown = f"{self.path}/{name}"
        self._check_existing(name, shown)
        temporary = f".{name}.{secrets.token_hex(8)}{TEMPORARY_SUFFIX}"
        shown_temporary = f"{self.path}/{temporary}"
        try:
            fd = os.open(temporary, _WRITE_FLAGS, SPEC_MODE, dir_fd=self.fd)
        except OSError as e:
            raise CdiWriteError(shown_temporary, f"cannot be created: {e.strerror}") from e
        renamed = False
        try:
            try:
                written = self._fill_and_rename(fd, content, temporary, name, between_steps)
                renamed = True
            except OSError as e:
                raise CdiWriteError(shown, f"cannot be written: {e.strerror}") from e
            finally:
                if not renamed:
                    self._remove_if_ours(temporary, fd)
        finally:
            os.close(fd)
        return written

    def _fill_and_rename(
        self, fd: int, content: str, temporary: str, name: str,
        between_steps: StepHook | None,
    ) -> WrittenSpec:
        shown = f"{self.path}/{name}"
        shown_temporary = f"{self.path}/{temporary}"
        os.fchmod(fd, SPEC_MODE)
        held = os.fstat(fd)
        if held.st_uid != self.trusted_uid:
            raise CdiWriteError(
                shown_temporary, f"was created owned by UID {held.st_uid}, not UID "
                f"{self.trusted_uid}: run as root"
            )
        view = memoryview(content.encode())
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        _step(between_steps, "written")
        now = self._changed(temporary, held)
        if now is not None:
            raise CdiWriteError(
                shown_temporary,
                f"{now} before the rename; it is left untouched and nothing was renamed",
            )
        os.rename(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        _step(between_steps, "renamed")
        now = self._changed(name, held)
        if now is not None:
            raise CdiWriteError(shown, f"{now} right after it was written (left untouched)")
        os.fsync(self.fd)
        return WrittenSpec(path=shown, device=held.st_dev, inode=held.st_ino)

    def _changed(self, name: str, held: os.stat_result) -> str | None:
        """How C{name} is no longer the file C{held} describes, or C{None}."""
        try:
            named = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return "disappeared"
        if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return None
        return (
            f"was replaced by a {describe_type(named.st_mode)} owned by UID {named.st_uid}"
        )

    def _remove_if_ours(self, temporary: str, fd: int) -> None:
        """Unlink our temporary file, but only while the name is still ours."""
        try:
            if self._changed(temporary, os.fstat(fd)) is None:
                os.unlink(temporary, dir_fd=self.fd)
        except OSError:
            pass


@contextmanager
def open_spec_directory(
    directory: str = cdi.DEFAULT_SPEC_DIRECTORY, trusted_uid: int = 0
) -> Iterator[SpecDirectory]:
    """
    The spec directory, created 0755 if missing, checked and held open.

    @raise CdiWriteError: a rule is broken (nothing was changed beyond
        creating the missing directory).
    """
    parent, name = _split(directory)
    shown = f"{parent.rstrip('/')}/{name}"
    try:
        fd = _open_spec_directory(parent, name, shown, trusted_uid)
    except OSError as e:
        raise CdiWriteError(shown, f"cannot be prepared: {e.strerror}") from e
    try:
        yield SpecDirectory(shown, fd, trusted_uid)
    finally:
        os.close(fd)


def publish_spec(
    directory: str | None = cdi.DEFAULT_SPEC_DIRECTORY,
    *,
    broker_enabled: bool,
    lock_parent: str = defaults.LOCK_PARENT,
    broker_directory: str = defaults.BROKER_DIRECTORY,
    version: str = cdi.DEFAULT_VERSION,
    trusted_uid: int = 0,
) -> PublishedSpec:
    """
    What C{hostpid cdi} and the broker's C{--cdi-dir} do, in this order:
    check the version; check (or create) the spec directory; prepare the
    lock parent (and, with the broker enabled, its broker mountpoint) by the
    same code as C{hostpid allocate}, since a CDI runtime creates no host
    path; build and check the spec; write it.  With C{directory=None} the
    spec is only rendered (C{hostpid cdi --cdi-dir -}).

    @raise cdi.CdiSpecError: a version or path the spec cannot carry.
    @raise hostpid.node.lockparent.LockParentError: an unsafe lock parent.
    @raise CdiWriteError: an unsafe spec directory or file.
    """
    # Everything the spec itself could refuse is refused before anything
    # on disk changes.
    cdi.build_spec(broker_enabled=broker_enabled, lock_parent=_cleaned(lock_parent),
                   broker_directory=broker_directory, version=version)
    if directory is None:
        prepared = prepare_lock_parent(
            lock_parent, broker_enabled=broker_enabled, trusted_uid=trusted_uid
        )
        spec = cdi.build_spec(broker_enabled=broker_enabled, lock_parent=prepared.path,
                              broker_directory=broker_directory, version=version)
        return PublishedSpec(prepared, spec, cdi.spec_to_json(spec), None)
    with open_spec_directory(directory, trusted_uid) as spec_directory:
        prepared = prepare_lock_parent(
            lock_parent, broker_enabled=broker_enabled, trusted_uid=trusted_uid
        )
        spec = cdi.build_spec(broker_enabled=broker_enabled, lock_parent=prepared.path,
                              broker_directory=broker_directory, version=version)
        text = cdi.spec_to_json(spec)
        written = spec_directory.write(text)
    return PublishedSpec(prepared, spec, text, written)


@attrs.frozen
class SpecPublisher:
    """
    The broker's C{--cdi-dir}, as a C{BrokerService(prepareNode=...)}
    callable: at every start, prepare the lock parent and write the spec for
    the broker's gate, so the spec is back after a reboot clears
    C{/var/run/cdi}.  Every refusal is a L{PathRuleError} naming the path,
    which the broker turns into its startup refusal.
    """

    directory: str
    lock_parent: str = defaults.LOCK_PARENT
    broker_directory: str = defaults.BROKER_DIRECTORY

    def __call__(self, broker_enabled: bool) -> None:
        try:
            published = publish_spec(
                self.directory,
                broker_enabled=broker_enabled,
                lock_parent=self.lock_parent,
                broker_directory=self.broker_directory,
            )
        except cdi.CdiSpecError as e:
            raise PathRuleError(self.directory, str(e)) from e
        for line in published.prepared.describe_repairs():
            _log.warn("hostpid-broker: {repair}", repair=line)
        assert published.written is not None
        _log.info(
            "hostpid-broker: CDI spec written: {path} ({device}: {edits})",
            path=published.written.path, device=cdi.qualified_name("broker"),
            edits="broker mounts and gate" if broker_enabled else "lock parent only",
        )


def _cleaned(path: str) -> str:
    """A lock parent as preparation will name it (relative paths are refused there)."""
    return clean_container_path(path) if path.startswith("/") else path
