# The C helper's interface (native/_hostpid_received.c), for type checkers.
SCM_MAX_FD: int
READ_MAX: int
RELEASE_CLOSED: int
RELEASE_UNCONNECTED: int
RELEASE_QUEUED: int
RELEASE_FAILED: int

def read(fd: int, size: int, oobinline: bool, room: bool, /) -> bytes | tuple[int, ...]: ...
def release(fd: int, reply: bytes | None, /) -> int: ...
