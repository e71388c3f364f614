/*
 * A contract client for the host PID broker, protocol version 1.
 *
 * It exists to prove that the Twisted broker is byte-compatible with a C
 * peer that applies HAMi-core's trust rules.  It applies the same checks as
 * hostpid.client, in the same order and under the same names:
 *
 *   gate, sandbox, directory, socket, read-only-mount, (connect), peer-uid,
 *   peer-pid, reply, and one monotonic deadline over connect, write and read
 *   (deadline).
 *
 * sandbox: gVisor's kernel (its uname version string) or a 9p broker
 * directory (fstatfs f_type V9FS_MAGIC) is refused.  peer-pid: the listener
 * SO_PEERCRED names must be 0 (outside) when this process is in a private PID
 * namespace (there, this process itself is what gVisor echoes on a host
 * socket), and a real PID in the host's.
 *
 * In a user namespace that does not map the trusted UID (Kubernetes
 * hostUsers: false; docs/userns.md argues the rule) the owner and peer
 * checks change, and only there: the directory and the socket may show the
 * host's root as the trusted UID (an idmapped mount) or as the overflow UID
 * (a plain one), and the listener as the trusted UID (peer-pid then judges
 * its PID) or as the overflow UID with PID 0.
 * The initial user namespace (uid_map "0 0 4294967295") keeps the trusted
 * UID exactly; an unreadable uid_map is judged as the initial one.
 *
 * Usage:
 *   hostpid_client [--socket PATH] [--trusted-uid UID] [--deadline-ms MS]
 *                  [--without CHECK]... [--barrier-fd FD]
 *
 * --without turns off one of directory, socket, read-only-mount, peer-uid;
 * sandbox and peer-pid cannot be turned off.
 * --barrier-fd FD blocks reading FD until end of file before starting, so a
 * test can release hundreds of clients at once.
 *
 * Success: prints "HOSTPID GETPID" (the broker's answer and this process's
 * own getpid()) on stdout and exits 0.  Failure: prints
 * "hostpid_client: CHECK: OBSERVED" on stderr and exits 1.  Usage: exit 2.
 * It never sends a PID and never prints one the reply did not carry.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#define GVISOR_KERNEL_VERSION "#1 SMP Sun Jan 10 15:06:54 PST 2016"
#define V9FS_MAGIC_NUMBER 0x01021997
#define PROC_PID_INIT_INO 0xEFFFFFFCUL
#define RESPONSE_SIZE 12
#define REQUEST_SIZE 8

enum { SKIP_DIRECTORY = 1, SKIP_SOCKET = 2, SKIP_READ_ONLY = 4, SKIP_PEER_UID = 8 };

struct options {
    const char *socket_path;
    uid_t trusted_uid;
    long deadline_ms;
    unsigned skipped;
    int barrier_fd;
};

/*
 * The user namespace, read once: whether the rule for a namespace that does
 * not map the trusted UID applies, and what the kernel shows an unmapped UID
 * as.
 */
struct user_namespace {
    int unmaps_trusted;
    uid_t overflow_uid;
};

static struct user_namespace read_user_namespace(uid_t trusted_uid)
{
    struct user_namespace found = {.unmaps_trusted = 0, .overflow_uid = 65534};
    FILE *overflow = fopen("/proc/sys/kernel/overflowuid", "re");
    if (overflow != NULL) {
        unsigned long value;
        if (fscanf(overflow, "%lu", &value) == 1)
            found.overflow_uid = (uid_t)value;
        fclose(overflow);
    }
    FILE *map = fopen("/proc/self/uid_map", "re");
    if (map == NULL)
        return found; /* unknown: the host's rule, which refuses here */
    unsigned long inside, outside, count;
    int extents = 0, identity = 0, covers = 0;
    while (fscanf(map, "%lu %lu %lu", &inside, &outside, &count) == 3) {
        extents++;
        if (inside == 0 && outside == 0 && count == 4294967295UL)
            identity = 1;
        if (outside <= trusted_uid && trusted_uid - outside < count)
            covers = 1;
    }
    int complete = feof(map);
    fclose(map);
    if (complete && extents > 0 && !(extents == 1 && identity) && !covers)
        found.unmaps_trusted = 1;
    return found;
}

/* Whether OWNER is the host's trusted UID as a mount can show it here. */
static int owner_is_trusted(uid_t owner, uid_t trusted_uid, const struct user_namespace *ns)
{
    if (owner == trusted_uid)
        return 1; /* the host's rule, or an idmapped mount with the pod's mapping */
    return ns->unmaps_trusted && owner == ns->overflow_uid; /* a plain mount */
}

static int fail(const char *check, const char *format, ...)
{
    va_list args;
    fprintf(stderr, "hostpid_client: %s: ", check);
    va_start(args, format);
    vfprintf(stderr, format, args);
    va_end(args);
    fputc('\n', stderr);
    return 1;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *kind(mode_t mode)
{
    if (S_ISSOCK(mode)) return "socket";
    if (S_ISLNK(mode)) return "symlink";
    if (S_ISREG(mode)) return "regular file";
    if (S_ISDIR(mode)) return "directory";
    if (S_ISFIFO(mode)) return "fifo";
    return "other file type";
}

static int usage(const char *message)
{
    fprintf(stderr, "hostpid_client: usage: %s\n", message);
    return 2;
}

static int parse(int argc, char **argv, struct options *options)
{
    options->socket_path = "/tmp/vgpulock/hostpid/broker.sock";
    options->trusted_uid = 0;
    options->deadline_ms = 500;
    options->skipped = 0;
    options->barrier_fd = -1;
    for (int i = 1; i < argc; i++) {
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (value == NULL)
            return usage("every option takes a value");
        if (strcmp(argv[i], "--socket") == 0) {
            options->socket_path = value;
        } else if (strcmp(argv[i], "--trusted-uid") == 0) {
            options->trusted_uid = (uid_t)strtoul(value, NULL, 10);
        } else if (strcmp(argv[i], "--deadline-ms") == 0) {
            options->deadline_ms = strtol(value, NULL, 10);
            if (options->deadline_ms <= 0)
                return usage("--deadline-ms must be positive");
        } else if (strcmp(argv[i], "--barrier-fd") == 0) {
            options->barrier_fd = (int)strtol(value, NULL, 10);
        } else if (strcmp(argv[i], "--without") == 0) {
            if (strcmp(value, "directory") == 0) options->skipped |= SKIP_DIRECTORY;
            else if (strcmp(value, "socket") == 0) options->skipped |= SKIP_SOCKET;
            else if (strcmp(value, "read-only-mount") == 0) options->skipped |= SKIP_READ_ONLY;
            else if (strcmp(value, "peer-uid") == 0) options->skipped |= SKIP_PEER_UID;
            else return usage("--without takes directory, socket, read-only-mount or peer-uid");
        } else {
            return usage("unknown option");
        }
        i++;
    }
    return 0;
}

/* Wait for EVENTS on FD until DEADLINE; 0 when ready, -1 when it passed. */
static int wait_for(int fd, short events, double deadline)
{
    for (;;) {
        double left = deadline - now();
        if (left <= 0)
            return -1;
        struct pollfd p = {.fd = fd, .events = events};
        int ready = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (ready > 0)
            return 0;
        if (ready < 0 && errno != EINTR)
            return 0; /* let the following call report the error */
    }
}

/* sandbox: 0 when nothing says this is a sandboxed runtime, else 1 (reported). */
static int sandbox_check(int directory_fd)
{
    struct utsname kernel;
    if (uname(&kernel) == 0) {
        size_t length = strlen(kernel.release);
        const char *suffix = "-gvisor";
        if (strcmp(kernel.version, GVISOR_KERNEL_VERSION) == 0 ||
            (length >= strlen(suffix) && strcmp(kernel.release + length - strlen(suffix),
                                                suffix) == 0))
            return fail("sandbox", "gVisor (runsc) detected: uname '%s' '%s'; sandboxed runtime: "
                        "the broker would see the sandbox's gofer, not this process",
                        kernel.release, kernel.version);
    }
    struct statfs filesystem;
    if (directory_fd >= 0 && fstatfs(directory_fd, &filesystem) == 0 &&
        ((unsigned long)filesystem.f_type & 0xFFFFFFFFUL) == V9FS_MAGIC_NUMBER)
        return fail("sandbox", "the broker directory is on a 9p filesystem (gVisor's gofer or "
                    "a VM runtime's share); sandboxed runtime: the broker would not see this "
                    "process");
    return 0;
}

/*
 * peer-pid: 0 when PID can be the host's broker, else 1 (reported).  From a
 * private PID namespace the broker, outside, shows as 0, and anything else is
 * refused (this process itself is what gVisor reports); from the host PID
 * namespace it shows as a real PID (possibly this process, embedding it).
 */
static int peer_pid_check(pid_t pid)
{
    char task[64];
    struct stat info;
    if (pid < 0)
        return fail("peer-pid", "pid %d is not a PID", (int)pid);
    int known = stat("/proc/self/ns/pid", &info) == 0;
    int saved = errno;
    int host = known && (unsigned long)info.st_ino == PROC_PID_INIT_INO;
    if (host)
        return pid == 0 ? fail("peer-pid", "pid 0 in the host PID namespace: no listener named")
                        : 0;
    if (pid == 0)
        return 0;
    if (pid == getpid())
        return fail("peer-pid", "pid %d is this process itself: sandboxed runtime", (int)pid);
    snprintf(task, sizeof task, "/proc/self/task/%d", (int)pid);
    struct stat thread;
    if (stat(task, &thread) == 0)
        return fail("peer-pid", "pid %d is a thread of this process: sandboxed runtime",
                    (int)pid);
    if (!known)
        return fail("peer-pid", "pid %d: cannot tell whether the listener is outside this PID "
                    "namespace (/proc/self/ns/pid: %s)", (int)pid, strerror(saved));
    return fail("peer-pid", "pid %d is inside this process's PID namespace pid:[%lu]: the "
                "listener runs in this container, not in the host PID namespace",
                (int)pid, (unsigned long)info.st_ino);
}

int main(int argc, char **argv)
{
    struct options options;
    int status = parse(argc, argv, &options);
    if (status != 0)
        return status;

    if (options.barrier_fd >= 0) {
        char byte;
        for (;;) {
            ssize_t n = read(options.barrier_fd, &byte, 1);
            if (n == 0 || (n < 0 && errno != EINTR))
                break;
        }
        close(options.barrier_fd);
    }

    /* gate */
    const char *gate = getenv("LIBVGPU_HOSTPID_BROKER");
    if (gate == NULL || strcmp(gate, "1") != 0)
        return fail("gate", "LIBVGPU_HOSTPID_BROKER=%s%s%s", gate ? "'" : "",
                    gate ? gate : "unset", gate ? "'" : "");

    char directory[PATH_MAX];
    const char *slash = strrchr(options.socket_path, '/');
    const char *name = slash ? slash + 1 : options.socket_path;
    if (slash == NULL) {
        strcpy(directory, ".");
    } else if (slash == options.socket_path) {
        strcpy(directory, "/");
    } else {
        size_t length = (size_t)(slash - options.socket_path);
        if (length >= sizeof directory)
            return usage("socket path too long");
        memcpy(directory, options.socket_path, length);
        directory[length] = '\0';
    }

    struct user_namespace ns = read_user_namespace(options.trusted_uid);

    /* directory: judged from its lstat, through one O_PATH descriptor */
    int directory_fd = open(directory, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    int open_error = errno;

    /* sandbox: before anything is trusted, with the directory if it opened */
    if (sandbox_check(directory_fd) != 0)
        return 1;

    if (directory_fd < 0)
        return fail("directory", "cannot open: %s", strerror(open_error));
    struct stat info;
    if (fstat(directory_fd, &info) != 0)
        return fail("directory", "cannot fstat: %s", strerror(errno));
    if (!(options.skipped & SKIP_DIRECTORY)) {
        if (!S_ISDIR(info.st_mode))
            return fail("directory", "%s: not a real directory", kind(info.st_mode));
        if (!owner_is_trusted(info.st_uid, options.trusted_uid, &ns))
            return fail("directory", "owner uid %u is not uid %u%s", (unsigned)info.st_uid,
                        (unsigned)options.trusted_uid,
                        ns.unmaps_trusted ? " (user namespace: nor the overflow uid)" : "");
        if (info.st_mode & (S_IWGRP | S_IWOTH))
            return fail("directory", "mode %04o: group or other may write",
                        (unsigned)(info.st_mode & 07777));
    } else if (S_ISLNK(info.st_mode)) {
        close(directory_fd);
        directory_fd = open(directory, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (directory_fd < 0)
            return fail("directory", "cannot open: %s", strerror(errno));
    }

    /* socket */
    if (fstatat(directory_fd, name, &info, AT_SYMLINK_NOFOLLOW) != 0)
        return fail("socket", "cannot lstat: %s", strerror(errno));
    if (!(options.skipped & SKIP_SOCKET)) {
        if (!S_ISSOCK(info.st_mode))
            return fail("socket", "%s: not a socket", kind(info.st_mode));
        if (!owner_is_trusted(info.st_uid, options.trusted_uid, &ns))
            return fail("socket", "owner uid %u is not uid %u%s", (unsigned)info.st_uid,
                        (unsigned)options.trusted_uid,
                        ns.unmaps_trusted ? " (user namespace: nor the overflow uid)" : "");
    }

    /* read-only-mount */
    struct statvfs mount;
    if (!(options.skipped & SKIP_READ_ONLY)) {
        if (fstatvfs(directory_fd, &mount) != 0)
            return fail("read-only-mount", "cannot statvfs: %s", strerror(errno));
        if (!(mount.f_flag & ST_RDONLY))
            return fail("read-only-mount", "read-write mount");
    }

    /* connect, through the checked directory when procfs agrees */
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    struct stat seen, held;
    char via[64];
    snprintf(via, sizeof via, "/proc/self/fd/%d", directory_fd);
    int through_fd = stat(via, &seen) == 0 && fstat(directory_fd, &held) == 0 &&
                     seen.st_dev == held.st_dev && seen.st_ino == held.st_ino;
    int written = through_fd
        ? snprintf(address.sun_path, sizeof address.sun_path, "%s/%s", via, name)
        : snprintf(address.sun_path, sizeof address.sun_path, "%s", options.socket_path);
    if (written < 0 || (size_t)written >= sizeof address.sun_path) {
        written = snprintf(address.sun_path, sizeof address.sun_path, "%s",
                           options.socket_path);
        if (written < 0 || (size_t)written >= sizeof address.sun_path)
            return fail("connect", "socket path too long");
    }

    double deadline = now() + (double)options.deadline_ms / 1000.0;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fail("connect", "socket: %s", strerror(errno));
    long backoff_us = 1000;
    while (connect(fd, (struct sockaddr *)&address, sizeof address) != 0) {
        if (errno != EAGAIN && errno != EINTR)
            return fail("connect", "%s", strerror(errno));
        double left = deadline - now();
        if (left <= 0)
            return fail("deadline", "%.3g s passed while connecting: accept queue full (EAGAIN)",
                        (double)options.deadline_ms / 1000.0);
        long sleep_us = backoff_us;
        if ((double)sleep_us > left * 1e6)
            sleep_us = (long)(left * 1e6) + 1;
        struct timespec pause = {.tv_sec = 0, .tv_nsec = sleep_us * 1000};
        nanosleep(&pause, NULL);
        backoff_us = backoff_us * 2 > 10000 ? 10000 : backoff_us * 2;
    }
    close(directory_fd);

    /* peer-uid, before a byte is sent */
    struct ucred credentials;
    socklen_t size = sizeof credentials;
    int credentials_error = 0;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &size) != 0) {
        credentials_error = errno;
        if (!(options.skipped & SKIP_PEER_UID))
            return fail("peer-uid", "cannot read SO_PEERCRED: %s", strerror(errno));
    } else if (!(options.skipped & SKIP_PEER_UID) && ns.unmaps_trusted &&
               credentials.uid != options.trusted_uid) {
        /* The host's root shows as the overflow uid, which the pod maps too
         * (its nobody): only pid 0, a listener outside this PID namespace,
         * sets the host's broker apart.  The trusted uid as shown here
         * passes as on the host, and peer-pid judges its PID. */
        if (credentials.uid != ns.overflow_uid || credentials.pid != 0)
            return fail("peer-uid", "uid %u (pid %d): not the overflow uid %u with pid 0 "
                        "(user namespace)", (unsigned)credentials.uid, (int)credentials.pid,
                        (unsigned)ns.overflow_uid);
    } else if (!(options.skipped & SKIP_PEER_UID) && credentials.uid != options.trusted_uid) {
        return fail("peer-uid", "uid %u (pid %d): not uid %u", (unsigned)credentials.uid,
                    (int)credentials.pid, (unsigned)options.trusted_uid);
    }

    /* peer-pid, before a byte is sent; no option turns it off */
    if (credentials_error != 0)
        return fail("peer-pid", "cannot read SO_PEERCRED: %s", strerror(credentials_error));
    if (peer_pid_check(credentials.pid) != 0)
        return 1;

    /* the request: magic, version 1, command 1; never a PID */
    const unsigned char request[REQUEST_SIZE] = {'H', 'P', 'I', 'D', 0, 1, 0, 1};
    size_t sent = 0;
    while (sent < sizeof request) {
        if (wait_for(fd, POLLOUT, deadline) != 0)
            return fail("deadline", "%.3g s passed sending the request",
                        (double)options.deadline_ms / 1000.0);
        ssize_t n = send(fd, request + sent, sizeof request - sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            return fail("reply", "cannot send: %s", strerror(errno));
        }
        sent += (size_t)n;
    }

    unsigned char reply[RESPONSE_SIZE];
    size_t got = 0;
    while (got < sizeof reply) {
        if (wait_for(fd, POLLIN, deadline) != 0)
            return fail("deadline", "%.3g s passed waiting for the reply (%zu of %d bytes)",
                        (double)options.deadline_ms / 1000.0, got, RESPONSE_SIZE);
        ssize_t n = recv(fd, reply + got, sizeof reply - got, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            return fail("reply", "cannot receive after %zu bytes: %s", got, strerror(errno));
        }
        if (n == 0)
            return fail("reply", "cut short: %zu of %d bytes", got, RESPONSE_SIZE);
        got += (size_t)n;
    }
    close(fd);

    /* reply: magic, version, status, PID, in that order */
    if (memcmp(reply, "HPID", 4) != 0)
        return fail("reply", "bad magic");
    unsigned version = ((unsigned)reply[4] << 8) | reply[5];
    unsigned code = ((unsigned)reply[6] << 8) | reply[7];
    uint32_t pid = ((uint32_t)reply[8] << 24) | ((uint32_t)reply[9] << 16) |
                   ((uint32_t)reply[10] << 8) | (uint32_t)reply[11];
    if (version != 1)
        return fail("reply", "bad version %u", version);
    if (code != 0)
        return fail("reply", "status %u, not 0", code);
    if (pid < 1 || pid > (uint32_t)INT32_MAX)
        return fail("reply", "PID %u outside 1..%d", (unsigned)pid, INT32_MAX);

    printf("%u %d\n", (unsigned)pid, (int)getpid());
    return 0;
}
