/*
 * _hostpid_native: the broker's fast-path system calls, made from C, so that
 * the broker's CPU per transaction stays near a C server's.
 *
 * Made through the socket module, the fast path's calls cost far more in
 * Python than in the kernel: a socket object per accepted connection (and
 * the getsockname CPython makes to build it), the address accept() asks for
 * and nobody reads, argument parsing, result tuples, and the GIL dropped
 * and taken again around each call.  This module makes the same calls on a
 * bare descriptor:
 *
 *   - accept, recv, send, close and getsockopt, one system call each: with
 *     them an accepted connection is its descriptor, an int, from accept to
 *     close (hostpid/broker/connections.py);
 *   - read and release, mode "received"'s calls (kernels without
 *     SO_PASSRIGHTS, before Linux 6.16), four more per connection than mode
 *     "refused": SO_OOBINLINE, recvmsg with room for passed descriptors,
 *     shutdown(SHUT_RD) and a closing peek;
 *   - accept_batch, close_all and reply_close, the listening port's turn
 *     in three calls whatever the flood: every accept4 and first read of a
 *     turn (and the peer's PID for a connection with nothing waiting), the
 *     turn's set-aside connections closed together, and mode "refused"'s
 *     reply and close.  Under a reconnecting flood the broker accepts every
 *     connection only to close most of them, and each Python-level call,
 *     socket object and exception per connection was time the backlog
 *     stayed full for real clients (hostpid/broker/port.py);
 *   - fstatfs_type, for the client's sandbox check: the one statfs field
 *     os.fstatvfs does not give, read here so that an exec probe (a fresh
 *     interpreter every few seconds on every node) need not import ctypes.
 *
 * It decides nothing.  Who the peer is (hostpid/peercred.py), what to
 * reply (hostpid/broker/server.py), what to do with a descriptor that
 * arrived, whether there is room for a full message, when a connection goes
 * to the background closer (hostpid/broker/descriptors.py): all of that
 * stays in Python, whose socket-module path (used where this module is not
 * built) is the reference these functions must match, and is tested
 * against the same real sockets.
 *
 * Nothing here closes a descriptor some client passed: read() returns them.
 * The closes of connections are made with the GIL released, as
 * socket.close() does, so that the close watchdog's thread can look at
 * them and interrupt them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/vfs.h>
#include <unistd.h>

/* The kernel's SCM_MAX_FD: descriptors one SCM_RIGHTS message can carry. */
#define SCM_MAX_FD 253

/* The largest read read() makes: its buffer is on the stack. */
#define READ_MAX 4096

/* release()'s answers; descriptors.py names them. */
enum {
    RELEASE_CLOSED = 0,      /* the queue was empty: closed here */
    RELEASE_UNCONNECTED = 1, /* shutdown failed: what is queued is unknown */
    RELEASE_QUEUED = 2,      /* the peek found bytes, or a reset: drain */
    RELEASE_FAILED = 3,      /* the peek failed otherwise */
};

static int
as_fd(PyObject *value, int *fd)
{
    long number = PyLong_AsLong(value);
    if (number == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (number < 0 || number > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a descriptor");
        return -1;
    }
    *fd = (int)number;
    return 0;
}

/*
 * A descriptor, or an object with fileno() (a socket object), for the
 * calls that leave the connection open: tests and the general path may hold
 * socket objects, which the calls that close must never be given.  A
 * closed socket object (fileno() -1) gets EBADF, as its own methods do.
 */
static int
as_socket_fd(PyObject *value, int *fd)
{
    PyObject *number;
    long n;

    if (PyLong_CheckExact(value)) {
        return as_fd(value, fd);
    }
    number = PyObject_CallMethod(value, "fileno", NULL);
    if (number == NULL) {
        return -1;
    }
    n = PyLong_AsLong(number);
    Py_DECREF(number);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (n < 0 || n > INT_MAX) {
        errno = EBADF;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    *fd = (int)n;
    return 0;
}

/* An SCM_RIGHTS message, well formed (the kernel's always are). */
static int
is_rights(const struct cmsghdr *cmsg)
{
    return cmsg->cmsg_level == SOL_SOCKET && cmsg->cmsg_type == SCM_RIGHTS
        && cmsg->cmsg_len >= CMSG_LEN(0);
}

/*
 * The descriptors an SCM_RIGHTS message put in our table, as a tuple (empty
 * when the message carried other ancillary data, or was truncated).  On
 * MemoryError they stay open: closing one here could block this thread,
 * which is what the caller exists to avoid.
 */
static PyObject *
passed_descriptors(struct msghdr *msg)
{
    Py_ssize_t count = 0, at = 0;
    struct cmsghdr *cmsg;
    PyObject *fds;

    for (cmsg = CMSG_FIRSTHDR(msg); cmsg != NULL; cmsg = CMSG_NXTHDR(msg, cmsg)) {
        if (is_rights(cmsg)) {
            count += (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        }
    }
    fds = PyTuple_New(count);
    if (fds == NULL) {
        return NULL;
    }
    for (cmsg = CMSG_FIRSTHDR(msg); cmsg != NULL; cmsg = CMSG_NXTHDR(msg, cmsg)) {
        size_t i, n;
        if (!is_rights(cmsg)) {
            continue;
        }
        n = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (i = 0; i < n && at < count; i++) {
            int fd;
            PyObject *number;
            memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
            number = PyLong_FromLong(fd);
            if (number == NULL) {
                Py_DECREF(fds);
                return NULL;
            }
            PyTuple_SET_ITEM(fds, at++, number);
        }
    }
    return fds;
}

/*
 * After a system call failed: 1 to make it again (EINTR, and no Python
 * signal handler raised: PEP 475, as the socket module does), 0 to report
 * errno, -1 if a handler raised (its exception is set).
 */
static int
again(void)
{
    if (errno != EINTR) {
        return 0;
    }
    return PyErr_CheckSignals() < 0 ? -1 : 1;
}

/* recvmsg, retried after EINTR; -2 if a signal handler raised. */
static ssize_t
receive(int fd, struct msghdr *msg, int flags)
{
    ssize_t n;
    int retry = 0;

    while ((n = recvmsg(fd, msg, flags)) < 0 && (retry = again()) > 0) {
    }
    if (n < 0) {
        if (retry < 0) {
            return -2;
        }
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return n;
}

/* The arguments' count, or a TypeError naming what the function takes. */
static int
check_args(Py_ssize_t nargs, Py_ssize_t expected, const char *usage)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s", usage);
        return -1;
    }
    return 0;
}

static int
as_int(PyObject *value, int *out)
{
    long number = PyLong_AsLong(value);
    if (number == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (number < INT_MIN || number > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "out of range for a C int");
        return -1;
    }
    *out = (int)number;
    return 0;
}

/* A read's size: 1 to READ_MAX (the buffers are on the stack). */
static int
as_read_size(PyObject *value, Py_ssize_t *size)
{
    *size = PyLong_AsSsize_t(value);
    if (*size == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*size < 1 || *size > READ_MAX) {
        PyErr_SetString(PyExc_ValueError, "size out of range");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(accept_doc,
"accept(listener) -> int\n"
"\n"
"accept4(listener, NULL, NULL, SOCK_CLOEXEC): the new connection's\n"
"descriptor.  No address is asked for (a Unix client's is unnamed).\n"
"Raises OSError as accept (BlockingIOError: nothing waiting).");

static PyObject *
native_accept(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int listener, fd;

    if (check_args(nargs, 1, "accept() takes listener") < 0 || as_fd(args[0], &listener) < 0) {
        return NULL;
    }
    fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(fd);
}

PyDoc_STRVAR(recv_doc,
"recv(sock, size, flags) -> bytes\n"
"\n"
"recv(2) on sock (a descriptor, or an object with fileno()), at most\n"
"READ_MAX bytes, retried after EINTR as the socket module does.  Raises\n"
"OSError as recv, and ValueError for MSG_TRUNC: with it the kernel\n"
"returns the length of the whole message or of the bytes it discarded,\n"
"not of what it copied, and the bytes returned would be the buffer's.");

static PyObject *
native_recv(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, flags, retry = 0;
    Py_ssize_t size;
    ssize_t n;
    char data[READ_MAX];

    if (check_args(nargs, 3, "recv() takes sock, size, flags") < 0
        || as_socket_fd(args[0], &fd) < 0 || as_int(args[2], &flags) < 0
        || as_read_size(args[1], &size) < 0) {
        return NULL;
    }
    if (flags & MSG_TRUNC) {
        PyErr_SetString(PyExc_ValueError, "MSG_TRUNC is not supported");
        return NULL;
    }
    while ((n = recv(fd, data, (size_t)size, flags)) < 0 && (retry = again()) > 0) {
    }
    if (n < 0) {
        return retry < 0 ? NULL : PyErr_SetFromErrno(PyExc_OSError);
    }
    /* Never more than the buffer holds, whatever the kernel reports. */
    if (n > size) {
        n = size;
    }
    return PyBytes_FromStringAndSize(data, n);
}

PyDoc_STRVAR(send_doc,
"send(sock, data, flags) -> int\n"
"\n"
"send(2) on sock (a descriptor, or an object with fileno()): the bytes\n"
"sent, retried after EINTR.  Raises OSError as send.");

static PyObject *
native_send(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, flags, retry = 0;
    char *data;
    Py_ssize_t length;
    ssize_t n;

    if (check_args(nargs, 3, "send() takes sock, data, flags") < 0
        || as_socket_fd(args[0], &fd) < 0 || as_int(args[2], &flags) < 0
        || PyBytes_AsStringAndSize(args[1], &data, &length) < 0) {
        return NULL;
    }
    while ((n = send(fd, data, (size_t)length, flags)) < 0 && (retry = again()) > 0) {
    }
    if (n < 0) {
        return retry < 0 ? NULL : PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(n);
}

PyDoc_STRVAR(close_doc,
"close(fd) -> None\n"
"\n"
"close(fd) with the GIL released, as socket.close() does.  Linux releases\n"
"the descriptor even when close fails, so the descriptor is gone either\n"
"way; EINTR (an interrupted close, see closewatch.py) is not an error,\n"
"anything else raises OSError.");

static PyObject *
native_close(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, result;

    if (check_args(nargs, 1, "close() takes fd") < 0 || as_fd(args[0], &fd) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    result = close(fd);
    Py_END_ALLOW_THREADS
    if (result < 0 && errno != EINTR) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(getsockopt_doc,
"getsockopt(sock, level, option) -> int\n"
"\n"
"getsockopt(2) of an int option: sock is a descriptor, or any object\n"
"with fileno() (a socket object: the read does not touch the object).\n"
"The kernel copies as much of a larger option as an int holds (the PID\n"
"of SO_PEERCRED's struct ucred comes first).  Raises OSError as\n"
"getsockopt.");

static PyObject *
native_getsockopt(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, level, option, value = 0;
    socklen_t length = sizeof value;

    if (check_args(nargs, 3, "getsockopt() takes sock, level, option") < 0
        || as_socket_fd(args[0], &fd) < 0 || as_int(args[1], &level) < 0
        || as_int(args[2], &option) < 0) {
        return NULL;
    }
    if (getsockopt(fd, level, option, &value, &length) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(value);
}

PyDoc_STRVAR(fstatfs_type_doc,
"fstatfs_type(fd) -> int\n"
"\n"
"fstatfs(2)'s f_type for the filesystem fd (any descriptor, O_PATH too)\n"
"is on, as an unsigned 32-bit number, the width of the kernel's magic\n"
"numbers (include/uapi/linux/magic.h).  Raises OSError as fstatfs fails.");

static PyObject *
native_fstatfs_type(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd;
    struct statfs info;

    if (check_args(nargs, 1, "fstatfs_type() takes fd") < 0 || as_fd(args[0], &fd) < 0) {
        return NULL;
    }
    if (fstatfs(fd, &info) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLong((unsigned long)info.f_type & 0xFFFFFFFFUL);
}

PyDoc_STRVAR(read_doc,
"read(sock, size, oobinline, room) -> bytes | tuple[int, ...]\n"
"\n"
"The first read of a connection just accepted, without blocking.  If\n"
"oobinline, first set SO_OOBINLINE (out-of-band bytes read inline, so no\n"
"ordinary read discards an out-of-band message and its descriptors).\n"
"With room, recvmsg with an ancillary buffer for SCM_MAX_FD descriptors;\n"
"without, peek with none, and read only the bytes the peek found, if it\n"
"met no descriptor.\n"
"\n"
"Returns the bytes read, or, if the message carried descriptors (or any\n"
"ancillary data, or was truncated; read without room: has descriptors\n"
"waiting, unread), a tuple of the descriptors now in this process's\n"
"table, for the caller to dispose of.  Raises OSError as recvmsg\n"
"(BlockingIOError: nothing waiting).");

static PyObject *
native_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, oobinline, room;
    Py_ssize_t size;
    ssize_t n;
    char data[READ_MAX];
    union {
        struct cmsghdr align;
        char buffer[CMSG_SPACE(SCM_MAX_FD * sizeof(int))];
    } control;
    struct iovec iov;
    struct msghdr msg;

    if (check_args(nargs, 4, "read() takes sock, size, oobinline, room") < 0
        || as_socket_fd(args[0], &fd) < 0 || as_read_size(args[1], &size) < 0) {
        return NULL;
    }
    if ((oobinline = PyObject_IsTrue(args[2])) < 0 || (room = PyObject_IsTrue(args[3])) < 0) {
        return NULL;
    }
    if (oobinline) {
        int on = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_OOBINLINE, &on, sizeof on) < 0) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    memset(&msg, 0, sizeof msg);
    iov.iov_base = data;
    iov.iov_len = (size_t)size;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (room) {
        msg.msg_control = control.buffer;
        msg.msg_controllen = sizeof control.buffer;
        n = receive(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            return NULL;
        }
        if (CMSG_FIRSTHDR(&msg) != NULL || (msg.msg_flags & MSG_CTRUNC)) {
            return passed_descriptors(&msg);
        }
        return PyBytes_FromStringAndSize(data, n);
    }
    /*
     * No room: a peek with no ancillary buffer installs no descriptor and
     * drops none (the kernel takes its loaned references back and sets
     * MSG_CTRUNC).  A stream peek stops after the first message with
     * descriptors, so bytes peeked without MSG_CTRUNC carry none, and
     * reading exactly that many (the only reader) cannot reach one.
     */
    n = receive(fd, &msg, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0) {
        return NULL;
    }
    if (msg.msg_flags & MSG_CTRUNC) {
        return PyTuple_New(0);
    }
    if (n > 0) {
        memset(&msg, 0, sizeof msg);
        iov.iov_len = (size_t)n;
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        n = receive(fd, &msg, MSG_DONTWAIT);
        if (n < 0) {
            return NULL;
        }
    }
    return PyBytes_FromStringAndSize(data, n);
}

/*
 * Send reply (bytes, or None for none) as the broker's reply is sent:
 * MSG_DONTWAIT | MSG_NOSIGNAL, retried after EINTR.  A reply of a few bytes
 * on a fresh connection fits or fails at once, and a failure is ignored
 * (the client went away or left no room: either way it gets no answer).
 * -1 only when reply is not bytes (the exception is set).
 */
static int
send_reply(int fd, PyObject *value)
{
    char *reply;
    Py_ssize_t length;

    if (value == Py_None) {
        return 0;
    }
    if (PyBytes_AsStringAndSize(value, &reply, &length) < 0) {
        return -1;
    }
    while (send(fd, reply, (size_t)length, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
    return 0;
}

PyDoc_STRVAR(release_doc,
"release(fd, reply) -> int\n"
"\n"
"Send reply (bytes, or None for none) without blocking, as the broker's\n"
"reply is sent (MSG_DONTWAIT | MSG_NOSIGNAL, a failure ignored: the\n"
"client went away or left no room, and either way gets no answer).\n"
"Then begin closing the connection without dropping a passed descriptor's\n"
"last reference in this thread: shutdown(SHUT_RD), so the peer can queue\n"
"nothing more, then peek one byte.  A queue that reads as end of file is\n"
"empty for good: fd is closed (with the GIL released) and RELEASE_CLOSED\n"
"returned.  Otherwise fd is left open and the answer says why:\n"
"RELEASE_UNCONNECTED (shutdown failed), RELEASE_QUEUED (bytes or a\n"
"reset are queued: drain), RELEASE_FAILED (the peek failed).");

static PyObject *
native_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd;
    char byte;
    ssize_t n;

    if (check_args(nargs, 2, "release() takes fd, reply") < 0 || as_fd(args[0], &fd) < 0) {
        return NULL;
    }
    if (send_reply(fd, args[1]) < 0) {
        return NULL;
    }
    if (shutdown(fd, SHUT_RD) < 0) {
        return PyLong_FromLong(RELEASE_UNCONNECTED);
    }
    n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0 || (n < 0 && errno == ECONNRESET)) {
        return PyLong_FromLong(RELEASE_QUEUED);
    }
    if (n < 0) {
        return PyLong_FromLong(RELEASE_FAILED);
    }
    /* Linux releases the descriptor even when close fails (EINTR included). */
    Py_BEGIN_ALLOW_THREADS
    close(fd);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(RELEASE_CLOSED);
}


PyDoc_STRVAR(accept_batch_doc,
"accept_batch(listener, count, size, received, oobinline) -> (list, int)\n"
"\n"
"The listening port's accept turn, its system calls made here: up to count\n"
"times accept4(listener, SOCK_CLOEXEC), and on each connection the first\n"
"read the fast path makes of it.  Mode refused (received false): recv of\n"
"up to size bytes with MSG_DONTWAIT, as recv().  Mode received: as read()\n"
"without room (SO_OOBINLINE first if oobinline, a peek with no control\n"
"buffer, and a read of exactly what it found if it met no descriptor).\n"
"\n"
"Returns the connections, each (fd, data, peer): data is the bytes read\n"
"(b'' at end of file), None when nothing is waiting yet (EAGAIN), an int\n"
"errno when the read failed otherwise, or () when descriptors are waiting\n"
"(mode received: nothing read).  peer is SO_PEERCRED's PID when data is\n"
"None (the waiting room's key), else -1 (-1 too where the kernel\n"
"refuses).  And why the turn ended: 0 (count reached), EAGAIN (the queue\n"
"is empty), or accept's errno (resource errors and fatal ones: the caller\n"
"decides).  ECONNABORTED, EPERM, EPROTO and EINTR concern one connection:\n"
"skipped, as the port skips them.  Decides nothing else.");

static PyObject *
native_accept_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int listener, count, received, oobinline, ended = 0;
    Py_ssize_t size;
    PyObject *items;
    char data[READ_MAX];

    if (check_args(nargs, 5, "accept_batch() takes listener, count, size, received, oobinline") < 0
        || as_fd(args[0], &listener) < 0 || as_int(args[1], &count) < 0
        || as_read_size(args[2], &size) < 0) {
        return NULL;
    }
    if ((received = PyObject_IsTrue(args[3])) < 0 || (oobinline = PyObject_IsTrue(args[4])) < 0) {
        return NULL;
    }
    items = PyList_New(0);
    if (items == NULL) {
        return NULL;
    }
    for (int k = 0; k < count; k++) {
        int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        ssize_t n;
        int error = 0, peer = -1;
        PyObject *value, *item;

        if (fd < 0) {
            if (errno == ECONNABORTED || errno == EPERM || errno == EPROTO || errno == EINTR) {
                continue;
            }
            ended = errno;
            break;
        }
        if (!received) {
            n = recv(fd, data, (size_t)size, MSG_DONTWAIT);
        } else {
            struct iovec iov = {.iov_base = data, .iov_len = (size_t)size};
            struct msghdr msg;
            memset(&msg, 0, sizeof msg);
            msg.msg_iov = &iov;
            msg.msg_iovlen = 1;
            n = 0;
            if (oobinline) {
                int on = 1;
                if (setsockopt(fd, SOL_SOCKET, SO_OOBINLINE, &on, sizeof on) < 0) {
                    n = -1;
                }
            }
            if (n == 0) {
                n = recvmsg(fd, &msg, MSG_PEEK | MSG_DONTWAIT);
            }
            if (n >= 0 && (msg.msg_flags & MSG_CTRUNC)) {
                n = -2; /* descriptors waiting: nothing read */
            } else if (n > 0) {
                memset(&msg, 0, sizeof msg);
                iov.iov_len = (size_t)n;
                msg.msg_iov = &iov;
                msg.msg_iovlen = 1;
                n = recvmsg(fd, &msg, MSG_DONTWAIT);
            }
        }
        if (n == -1) {
            error = errno;
        }
        if (n == -2) {
            value = PyTuple_New(0);
        } else if (n >= 0) {
            value = PyBytes_FromStringAndSize(data, n > size ? size : n);
        } else if (error == EAGAIN) {
            struct ucred cred;
            socklen_t length = sizeof cred;
            if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) == 0) {
                peer = cred.pid;
            }
            value = Py_NewRef(Py_None);
        } else {
            value = PyLong_FromLong(error);
        }
        item = value == NULL ? NULL : Py_BuildValue("(iNi)", fd, value, peer);
        if (item == NULL || PyList_Append(items, item) < 0) {
            /* Out of memory: this connection is closed, those already in
             * the list go to the caller with the error. */
            Py_XDECREF(item);
            close(fd);
            Py_DECREF(items);
            return NULL;
        }
        Py_DECREF(item);
    }
    return Py_BuildValue("(Ni)", items, ended);
}


PyDoc_STRVAR(close_all_doc,
"close_all(fds) -> None\n"
"\n"
"close() of every descriptor in fds (a list of ints), in order, with the\n"
"GIL released once around them all: the connections an accept turn sets\n"
"aside, closed together at its end.  As close(), a failed close still\n"
"releases its descriptor; the first error other than EINTR is raised once\n"
"every descriptor is closed.  A list with anything but ints in it raises\n"
"before any is closed.");

static PyObject *
native_close_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t count, i;
    int *fds, failed = 0;

    if (check_args(nargs, 1, "close_all() takes fds") < 0) {
        return NULL;
    }
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "close_all() takes a list");
        return NULL;
    }
    count = PyList_GET_SIZE(args[0]);
    fds = PyMem_New(int, count > 0 ? count : 1);
    if (fds == NULL) {
        return PyErr_NoMemory();
    }
    for (i = 0; i < count; i++) {
        if (as_fd(PyList_GET_ITEM(args[0], i), &fds[i]) < 0) {
            PyMem_Free(fds);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < count; i++) {
        if (close(fds[i]) < 0 && errno != EINTR && !failed) {
            failed = errno;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(fds);
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}


PyDoc_STRVAR(reply_close_doc,
"reply_close(fd, reply) -> None\n"
"\n"
"Mode refused's end of a transaction on the fast path, in one call: send\n"
"reply (bytes, or None for none) as the broker's reply is sent\n"
"(MSG_DONTWAIT | MSG_NOSIGNAL, a failure ignored: the client went away or\n"
"left no room, and either way gets no answer), then close(fd) with the\n"
"GIL released, as close() does.  Only where the kernel refuses passed\n"
"descriptors: a plain close cannot drop one here.");

static PyObject *
native_reply_close(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd;

    if (check_args(nargs, 2, "reply_close() takes fd, reply") < 0 || as_fd(args[0], &fd) < 0) {
        return NULL;
    }
    if (send_reply(fd, args[1]) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    close(fd);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef native_methods[] = {
    {"accept", (PyCFunction)(void (*)(void))native_accept, METH_FASTCALL, accept_doc},
    {"recv", (PyCFunction)(void (*)(void))native_recv, METH_FASTCALL, recv_doc},
    {"send", (PyCFunction)(void (*)(void))native_send, METH_FASTCALL, send_doc},
    {"close", (PyCFunction)(void (*)(void))native_close, METH_FASTCALL, close_doc},
    {"getsockopt", (PyCFunction)(void (*)(void))native_getsockopt, METH_FASTCALL, getsockopt_doc},
    {"read", (PyCFunction)(void (*)(void))native_read, METH_FASTCALL, read_doc},
    {"fstatfs_type", (PyCFunction)(void (*)(void))native_fstatfs_type, METH_FASTCALL,
     fstatfs_type_doc},
    {"release", (PyCFunction)(void (*)(void))native_release, METH_FASTCALL, release_doc},
    {"reply_close", (PyCFunction)(void (*)(void))native_reply_close, METH_FASTCALL,
     reply_close_doc},
    {"close_all", (PyCFunction)(void (*)(void))native_close_all, METH_FASTCALL, close_all_doc},
    {"accept_batch", (PyCFunction)(void (*)(void))native_accept_batch, METH_FASTCALL,
     accept_batch_doc},
    {NULL, NULL, 0, NULL},
};

static int
native_exec(PyObject *module)
{
    if (PyModule_AddIntConstant(module, "SCM_MAX_FD", SCM_MAX_FD) < 0
        || PyModule_AddIntConstant(module, "READ_MAX", READ_MAX) < 0
        || PyModule_AddIntConstant(module, "RELEASE_CLOSED", RELEASE_CLOSED) < 0
        || PyModule_AddIntConstant(module, "RELEASE_UNCONNECTED", RELEASE_UNCONNECTED) < 0
        || PyModule_AddIntConstant(module, "RELEASE_QUEUED", RELEASE_QUEUED) < 0
        || PyModule_AddIntConstant(module, "RELEASE_FAILED", RELEASE_FAILED) < 0) {
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, native_exec},
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hostpid_native",
    .m_doc = "The broker's fast-path system calls (see hostpid.broker.connections), "
             "and fstatfs for the client's sandbox check.",
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC
PyInit__hostpid_native(void)
{
    return PyModuleDef_Init(&native_module);
}
