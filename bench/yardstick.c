/*
 * yardstick.c - a C server that does the host PID broker's per-connection
 * work, system call for system call, on one epoll loop: the fair yardstick
 * for the broker's CPU per transaction and for how many real clients it
 * answers under floods.
 *
 * A plain C server (recv, SO_PEERCRED, send, close) is the physical limit,
 * but it is not what the broker must do: the design requires the liveness
 * check (the connector still alive under its PID), and on kernels without
 * SO_PASSRIGHTS the broker must read so that no descriptor a client passes
 * is ever installed or released in its thread.  This server makes exactly
 * the broker's calls, in the broker's order, and applies the broker's
 * limits, so that what remains between the two is CPython and the reactor.
 *
 * Each step below names the broker's code it mirrors (paths from the
 * repository root).  Where it does less, the comment says so and why that
 * cannot change the figures the benchmarks report.
 *
 * Modes (--mode, as the broker's DescriptorMode, hostpid/broker/descriptors.py):
 *   refused   SO_PASSRIGHTS set to 0 on the listener (Linux 6.16+): the
 *             sender's SCM_RIGHTS fails, a plain recv() is safe.
 *   received  the kernel cannot refuse descriptors (or, as the broker's
 *             HOSTPID_BROKER_TEST_RECEIVE_DESCRIPTORS forces, we do not ask
 *             it to): SO_OOBINLINE, a peek with no control buffer and a read
 *             of what it found, and shutdown(SHUT_RD) + a closing peek.
 *             --with-room reads with a control buffer for SCM_MAX_FD
 *             descriptors instead of peeking (PassedDescriptors.receive,
 *             the path for a broker that takes descriptors), closing any
 *             that arrive.
 *
 * Usage: yardstick --socket PATH [--mode refused|received] [--with-room]
 *                  [--limit N] [--deadline S] [--backlog B]
 * On SIGTERM/SIGINT prints its counters as one JSON line on stderr and exits.
 * Build: cc -O2 -Wall -o yardstick yardstick.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SO_PASSRIGHTS
#define SO_PASSRIGHTS 83
#endif
#define SCM_MAX_FD 253
/* server.py _FAST_READ: a little more than the request, so that trailing
 * bytes are swallowed and the close does not reset the reply. */
#define FAST_READ 256
/* waiting.py _READ */
#define WAIT_READ 64
/* port.py ACCEPTS_PER_TURN */
#define ACCEPTS_PER_TURN 128
/* descriptors.py DRAIN_READS */
#define DRAIN_READS 8

static const uint8_t REQUEST[8] = {'H', 'P', 'I', 'D', 0, 1, 0, 1};

struct conn {
    int fd, got, peer;
    uint8_t buf[8];
    uint64_t deadline;
    struct conn *prev, *next;           /* deadline FIFO (ArrivalDeadlines) */
    struct conn *peer_prev, *peer_next; /* its peer's queue, oldest first (PeerQueues) */
};

/* A peer's waiting connections: waiting.py keys them by SO_PEERCRED's PID. */
struct peer {
    int pid, count;
    struct conn *head, *tail;
    struct peer *next_active; /* peers holding at least one */
};

static struct conn *pool, *free_list, *head, *tail;
static struct peer *peers; /* open addressing, 2 x limit entries */
static int peer_slots;
static int active, limit = 1024, max_per_peer, received_mode, with_room, oob_supported;
static uint64_t deadline_ns = 1000000000ull;
static unsigned long long n_ok, n_invalid, n_short, n_gone, n_cred, n_over, n_evicted,
    n_deadline, n_descriptors;
static volatile sig_atomic_t stop;

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void on_signal(int sig)
{
    (void)sig;
    stop = 1;
}

/* --- The peer table (fairness.py PeerQueues, by scan rather than by count
 * groups: the benchmarks' floods are a handful of peers). --- */

static struct peer *peer_find(int pid, int create)
{
    unsigned h = (unsigned)pid * 2654435761u;
    for (int i = 0; i < peer_slots; i++) {
        struct peer *p = &peers[(h + (unsigned)i) % (unsigned)peer_slots];
        if (p->pid == pid)
            return p;
        if (p->pid == 0) {
            if (!create)
                return NULL;
            p->pid = pid;
            return p;
        }
    }
    return NULL;
}

/* The peer holding the most, ties to the first found: fairness.py victim(). */
static struct peer *peer_most(void)
{
    struct peer *best = NULL;
    for (int i = 0; i < peer_slots; i++)
        if (peers[i].count > 0 && (best == NULL || peers[i].count > best->count))
            best = &peers[i];
    return best;
}

/* --- The liveness check: hostpid/peercred.py PeerIdentifier.host_pid with
 * LivenessCheck.PEERPIDFD and signalCheck (pidfd_send_signal usable). --- */

/* 0: the PID to answer in *pid; -1 close with no reply (PEER_GONE or
 * PEER_CREDENTIALS in server.py answer()). */
static int host_pid(int fd, int *pid)
{
    int value = 0, pidfd = -1;
    socklen_t len = sizeof value;
    /* peercred.py: _getsockopt(sock, SOL_SOCKET, SO_PEERCRED), the PID alone
     * as a C int (the kernel copies the head of struct ucred). */
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &value, &len) != 0 || value <= 0) {
        n_cred++;
        return -1;
    }
    /* peercred.py: _getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD). */
    len = sizeof pidfd;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) != 0) {
        if (errno == EINVAL) { /* PEERPIDFD_GONE */
            n_gone++;
            return -1;
        }
        n_cred++;
        return -1;
    }
    /* peercred.py: _pidfd_send_signal(pidfd, 0); ESRCH is PeerGone, EPERM
     * still alive; then os.close(pidfd) in the finally. */
    int gone = syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) != 0 && errno == ESRCH;
    close(pidfd);
    if (gone) {
        n_gone++;
        return -1;
    }
    *pid = value;
    return 0;
}

/* server.py answer(): the 12 reply bytes in rep, or -1 for no reply. */
static int answer(int fd, const uint8_t *req, uint8_t rep[12])
{
    uint16_t status;
    uint32_t pid = 0;
    int got;
    if (memcmp(req, REQUEST, 8) != 0) {
        status = 1; /* wire.INVALID_REQUEST_RESPONSE */
        n_invalid++;
    } else {
        if (host_pid(fd, &got) != 0)
            return -1;
        status = 0;
        pid = (uint32_t)got;
        n_ok++;
    }
    memcpy(rep, "HPID\0\1", 6);
    uint16_t st = htons(status);
    uint32_t p = htonl(pid);
    memcpy(rep + 6, &st, 2);
    memcpy(rep + 8, &p, 4);
    return 0;
}

/* --- Reads and closes: descriptors.py PassedDescriptors (mode received)
 * or the plain socket calls (mode refused). --- */

/* The first read of a connection just accepted.  Returns bytes read (0 end
 * of file), -1 with errno (EAGAIN: nothing yet), -2 descriptors waiting. */
static ssize_t read_first(int fd, uint8_t *data, size_t size)
{
    if (!received_mode)
        /* server.py answerWaiting: self._recv(sock, _FAST_READ, MSG_DONTWAIT). */
        return recv(fd, data, size, MSG_DONTWAIT);
    /* native read(): SO_OOBINLINE first where the kernel has Unix OOB data. */
    if (oob_supported) {
        int on = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_OOBINLINE, &on, sizeof on) < 0)
            return -1;
    }
    struct iovec iov = {.iov_base = data, .iov_len = size};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    union {
        struct cmsghdr align;
        char buffer[CMSG_SPACE(SCM_MAX_FD * sizeof(int))];
    } control;
    if (with_room) {
        /* PassedDescriptors.receive: recvmsg with room for a full message;
         * the broker disposes of what arrives, here it is closed. */
        msg.msg_control = control.buffer;
        msg.msg_controllen = sizeof control.buffer;
        ssize_t n = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0)
            return n;
        if (CMSG_FIRSTHDR(&msg) != NULL || (msg.msg_flags & MSG_CTRUNC)) {
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                    continue;
                int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (int i = 0; i < k; i++) {
                    int passed;
                    memcpy(&passed, CMSG_DATA(c) + i * sizeof(int), sizeof passed);
                    close(passed);
                }
            }
            return -2;
        }
        return n;
    }
    /* The broker's path (takesDescriptors=False: mayReceive() is false, so
     * native read() without room): peek with no control buffer, and read
     * exactly what the peek found if it met no descriptor. */
    ssize_t n = recvmsg(fd, &msg, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0)
        return n;
    if (msg.msg_flags & MSG_CTRUNC)
        return -2;
    if (n > 0) {
        struct msghdr again = {.msg_iov = &iov, .msg_iovlen = 1};
        iov.iov_len = (size_t)n;
        n = recvmsg(fd, &again, MSG_DONTWAIT);
    }
    return n;
}

/* Send the reply if any, then close: native release() in mode received
 * (send, shutdown(SHUT_RD), a one-byte peek, close when the queue reads as
 * end of file), send + close in mode refused (server.py answerWaiting). */
static void release(int fd, const uint8_t *rep)
{
    if (rep != NULL)
        send(fd, rep, 12, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (!received_mode) {
        close(fd);
        return;
    }
    if (shutdown(fd, SHUT_RD) == 0) {
        char byte;
        ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n > 0 || (n < 0 && errno == ECONNRESET)) {
            /* descriptors.py _drain: bounded reads with room.  The broker
             * hands a queue that holds descriptors to its disposer process;
             * the benchmarks' clients pass none, so this never runs there. */
            char sink[4096];
            for (int i = 0; i < DRAIN_READS; i++) {
                n = recv(fd, sink, sizeof sink, MSG_DONTWAIT);
                if (n == 0 || (n < 0 && errno != ECONNRESET))
                    break;
            }
        }
    }
    close(fd);
}

/* --- The waiting room: hostpid/broker/waiting.py WaitingRoom. --- */

static void unlink_conn(struct conn *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        tail = c->prev;
    struct peer *p = peer_find(c->peer, 0);
    if (p != NULL) {
        if (c->peer_prev)
            c->peer_prev->peer_next = c->peer_next;
        else
            p->head = c->peer_next;
        if (c->peer_next)
            c->peer_next->peer_prev = c->peer_prev;
        else
            p->tail = c->peer_prev;
        p->count--;
    }
}

/* WaitingConnection.finish: leave the queues and the deadlines, free the
 * slot, close (close() also leaves the epoll set). */
static void finish(struct conn *c, const uint8_t *rep)
{
    unlink_conn(c);
    active--;
    release(c->fd, rep);
    c->next = free_list;
    free_list = c;
}

/* WaitingRoom.admit, after closeOverLimit's check by the caller. */
static void admit(int ep, int fd, int peer_pid, const uint8_t *prefix, int got)
{
    if (active >= limit) {
        /* The connector_gone looks (LookBackoff) are skipped: the floods
         * here are live processes, for which the broker skips them too on
         * 32 newcomers of 33.  Then the fairness rule: the oldest waiting
         * connection of the peer holding the most is EVICTED. */
        struct peer *most = peer_most();
        if (most == NULL || most->head == NULL) {
            release(fd, NULL);
            n_over++;
            return;
        }
        n_evicted++;
        finish(most->head, NULL);
    }
    struct conn *c = free_list;
    free_list = c->next;
    c->fd = fd;
    c->got = got;
    c->peer = peer_pid;
    memcpy(c->buf, prefix, (size_t)got);
    /* ArrivalDeadlines.start: one deadline for all, so FIFO. */
    c->deadline = now_ns() + deadline_ns;
    c->prev = tail;
    c->next = NULL;
    if (tail)
        tail->next = c;
    else
        head = c;
    tail = c;
    struct peer *p = peer_find(peer_pid, 1);
    c->peer_prev = p->tail;
    c->peer_next = NULL;
    if (p->tail)
        p->tail->peer_next = c;
    else
        p->head = c;
    p->tail = c;
    p->count++;
    active++;
    /* reactor.addReader(connection) */
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0)
        finish(c, NULL);
}

/* port.py BrokerPort._acceptBatch: accept4 without NONBLOCK (the broker's
 * native accept), each connection answered at accept when its request is
 * there (server.py answerWaiting), others admitted; newcomers of a peer at
 * its share are closed after the turn (WaitingRoom.closeOverLimit). */
static int accepts_per_turn = 1;
static int over_fds[ACCEPTS_PER_TURN];

static void on_accept(int ep, int lfd)
{
    int accepted = 0, over = 0, turn = accepts_per_turn;
    for (int k = 0; k < turn; k++) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN) {
                accepts_per_turn = accepted > 1 ? accepted : 1;
                goto done;
            }
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                goto done; /* the broker backs off; level-triggered here */
            continue;      /* CONNECTION_ERRORS */
        }
        accepted++;
        uint8_t data[FAST_READ];
        ssize_t n = read_first(fd, data, sizeof data);
        if (n == -2) { /* Outcome.DESCRIPTORS */
            n_descriptors++;
            release(fd, NULL);
            continue;
        }
        if (n >= 8) {
            uint8_t rep[12];
            release(fd, answer(fd, data, rep) == 0 ? rep : NULL);
            continue;
        }
        if (n == 0 || (n < 0 && errno != EAGAIN)) { /* Outcome.SHORT */
            n_short++;
            release(fd, NULL);
            continue;
        }
        /* The general path.  waiting.py peer_pid: SO_PEERCRED, read once. */
        int pid = -1;
        socklen_t len = sizeof pid;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &pid, &len) != 0)
            pid = -1;
        struct peer *p = peer_find(pid, 0);
        if (p != NULL && p->count >= max_per_peer) {
            over_fds[over++] = fd;
            continue;
        }
        admit(ep, fd, pid, data, n > 0 ? (int)n : 0);
    }
    accepts_per_turn = turn * 2 > ACCEPTS_PER_TURN ? ACCEPTS_PER_TURN : turn * 2;
done:
    for (int i = 0; i < over; i++) { /* Outcome.OVER_LIMIT */
        n_over++;
        release(over_fds[i], NULL);
    }
}

/* waiting.py WaitingConnection.doRead */
static void on_readable(struct conn *c)
{
    uint8_t data[WAIT_READ];
    ssize_t n;
    if (received_mode) {
        /* receiveWithoutRoom (the broker never has room: it takes none) */
        struct iovec iov = {.iov_base = data, .iov_len = sizeof data};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
        n = recvmsg(c->fd, &msg, MSG_PEEK | MSG_DONTWAIT);
        if (n > 0 && (msg.msg_flags & MSG_CTRUNC)) {
            n_descriptors++;
            finish(c, NULL);
            return;
        }
        if (n > 0)
            n = recv(c->fd, data, (size_t)n, MSG_DONTWAIT);
    } else {
        n = recv(c->fd, data, sizeof data, MSG_DONTWAIT);
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        n_short++;
        finish(c, NULL);
        return;
    }
    int take = 8 - c->got < (int)n ? 8 - c->got : (int)n;
    memcpy(c->buf + c->got, data, (size_t)take);
    c->got += take;
    if (c->got < 8)
        return;
    uint8_t rep[12];
    finish(c, answer(c->fd, c->buf, rep) == 0 ? rep : NULL);
}

/* descriptors.py unix_out_of_band_supported: one OOB byte over a pair. */
static int probe_oob(void)
{
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0)
        return 1;
    int ok = send(pair[0], "!", 1, MSG_OOB | MSG_DONTWAIT) == 1 || errno != EOPNOTSUPP;
    close(pair[0]);
    close(pair[1]);
    return ok;
}

static void usage(void)
{
    fprintf(stderr, "usage: yardstick --socket PATH [--mode refused|received] [--with-room] "
                    "[--limit N] [--deadline S] [--backlog B]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {{"socket", required_argument, 0, 's'},
                                         {"mode", required_argument, 0, 'm'},
                                         {"with-room", no_argument, 0, 'w'},
                                         {"limit", required_argument, 0, 'l'},
                                         {"deadline", required_argument, 0, 'd'},
                                         {"backlog", required_argument, 0, 'b'},
                                         {0, 0, 0, 0}};
    const char *path = NULL;
    int backlog = 1024, c; /* hostpid/defaults.py LISTEN_BACKLOG */
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's': path = optarg; break;
        case 'm':
            if (strcmp(optarg, "received") == 0)
                received_mode = 1;
            else if (strcmp(optarg, "refused") != 0)
                usage();
            break;
        case 'w': with_room = 1; break;
        case 'l': limit = atoi(optarg); break;
        case 'd': deadline_ns = (uint64_t)(atof(optarg) * 1e9); break;
        case 'b': backlog = atoi(optarg); break;
        default: usage();
        }
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (!path || limit < 1 || strlen(path) >= sizeof addr.sun_path || (with_room && !received_mode))
        usage();
    strcpy(addr.sun_path, path);
    /* server.py max_waiting_per_peer: limit // PER_PEER_SHARE, at least 1. */
    max_per_peer = limit / 16 > 1 ? limit / 16 : 1;
    oob_supported = received_mode && probe_oob();

    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigset_t block, waitmask;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &waitmask);
    sigdelset(&waitmask, SIGTERM);
    sigdelset(&waitmask, SIGINT);
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    pool = calloc((size_t)limit, sizeof *pool);
    peer_slots = 2 * limit + 1;
    peers = calloc((size_t)peer_slots, sizeof *peers);
    if (!pool || !peers) {
        perror("calloc");
        return 1;
    }
    for (int i = limit - 1; i >= 0; i--) {
        pool[i].next = free_list;
        free_list = &pool[i];
    }

    /* port.py: a listener born 0666 (under a umask), SO_PASSRIGHTS set to 0
     * before listen() in mode refused (refuse_descriptor_passing). */
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    unlink(path);
    mode_t old = umask(0111);
    int bound = lfd >= 0 && bind(lfd, (struct sockaddr *)&addr, sizeof addr) == 0;
    umask(old);
    if (!bound) {
        perror("bind");
        return 1;
    }
    if (!received_mode) {
        int zero = 0;
        if (setsockopt(lfd, SOL_SOCKET, SO_PASSRIGHTS, &zero, sizeof zero) != 0) {
            perror("setsockopt SO_PASSRIGHTS (mode refused needs Linux 6.16+)");
            return 1;
        }
    }
    if (listen(lfd, backlog) < 0) {
        perror("listen");
        return 1;
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);

    struct epoll_event evs[256];
    while (!stop) {
        int timeout = -1;
        if (head) {
            uint64_t now = now_ns();
            timeout = head->deadline <= now ? 0 : (int)((head->deadline - now + 999999) / 1000000);
        }
        int n = epoll_pwait(ep, evs, 256, timeout, &waitmask);
        for (int k = 0; k < n; k++) {
            if (evs[k].data.ptr == NULL)
                on_accept(ep, lfd);
            else
                on_readable(evs[k].data.ptr);
        }
        /* ArrivalDeadlines._fire: Outcome.DEADLINE, oldest first. */
        if (head) {
            uint64_t now = now_ns();
            while (head && head->deadline <= now) {
                n_deadline++;
                finish(head, NULL);
            }
        }
    }
    unlink(path);
    fprintf(stderr,
            "{\"server\":\"yardstick\",\"mode\":\"%s\",\"ok\":%llu,\"invalid\":%llu,\"short\":%llu,"
            "\"peer_gone\":%llu,\"peer_credentials\":%llu,\"over_limit\":%llu,\"evicted\":%llu,"
            "\"deadline\":%llu,\"descriptors\":%llu,\"active\":%d}\n",
            received_mode ? "received" : "refused", n_ok, n_invalid, n_short, n_gone, n_cred,
            n_over, n_evicted, n_deadline, n_descriptors, active);
    return 0;
}
