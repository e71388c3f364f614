/*
 * hostpid bench load generator.
 *
 * Drives a host PID broker (or any server speaking protocol version 1) over
 * its Unix socket and prints ONE JSON line per run.  It is written in C so
 * that the generator is never the bottleneck: a Python generator would need
 * more CPU per transaction than the server it measures.
 *
 * Modes (exactly one):
 *   --clients N --duration S [--expect-pid]
 *        closed loop: N transactions always in flight for S seconds, on one
 *        epoll loop with non-blocking connects (EAGAIN: retry after a short
 *        backoff, like the project's client).
 *   --burst N
 *        N forked processes released at once through a pipe; each does one
 *        transaction and checks the reply carries its own getpid().  This is
 *        N CUDA processes starting together on a node.
 *   --idle N --hold S [--reconnect]
 *        N silent connections (re-opened as the server closes them with
 *        --reconnect) held for S seconds while a separate probe process sends
 *        real requests in a loop, each with its own timeout.
 *   --send-gap-ms M (any mode): each real client pauses M ms between
 *        connect() and send(), as a client that is slow to send.
 *
 * Every mode is bounded by time and by count, and stops by itself.
 * Build: cc -O2 -Wall -o loadgen loadgen.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define REQUEST_SIZE 8
#define RESPONSE_SIZE 12
#define PID_MAX 2147483647u

/* The one request a client sends: "HPID", version 1, command 1. */
static const unsigned char REQUEST[REQUEST_SIZE] = {'H', 'P', 'I', 'D', 0, 1, 0, 1};

/* How a transaction ended, from the client's side. */
enum verdict {
    V_OK = 0,       /* status 0, a plausible PID (and our own, when checked) */
    V_WRONG_PID,    /* status 0 with a PID that is not ours: must never happen */
    V_INVALID,      /* status 1 (or any non-zero status) */
    V_BAD_REPLY,    /* 12 bytes that are not a well-formed reply */
    V_CLOSED,       /* closed with no reply at all: a clean failure */
    V_SHORT,        /* closed after part of a reply */
    V_RESET,        /* ECONNRESET / EPIPE while sending or reading */
    V_REFUSED,      /* connect refused (ECONNREFUSED, ENOENT, ...) */
    V_TIMEOUT,      /* our own deadline passed (connect retries included) */
    V_SEND_FAILED,  /* closed before the request could be sent: it never waited */
    V_NKINDS
};

static const char *VERDICT_NAMES[V_NKINDS] = {
    "ok", "wrong_pid", "invalid", "bad_reply", "closed", "short",
    "reset", "refused", "timeout", "send_failed",
};

/* ---------------------------------------------------------------- utils */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void die(const char *what)
{
    fprintf(stderr, "loadgen: %s: %s\n", what, strerror(errno));
    exit(2);
}

/* Latency samples in microseconds, bounded so a long run cannot eat memory. */
#define SAMPLES_MAX (16u * 1024u * 1024u)

struct samples {
    float *v;
    size_t n, cap;
    uint64_t dropped;
};

static void samples_add(struct samples *s, double us)
{
    if (s->n == s->cap) {
        if (s->cap >= SAMPLES_MAX) {
            s->dropped++;
            return;
        }
        size_t cap = s->cap ? s->cap * 2 : 4096;
        float *v = realloc(s->v, cap * sizeof *v);
        if (v == NULL) {
            s->dropped++;
            return;
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = (float)us;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void samples_sort(struct samples *s)
{
    if (s->n)
        qsort(s->v, s->n, sizeof *s->v, cmp_float);
}

/* Nearest-rank percentile of sorted samples; 0 when there are none. */
static double pct(const struct samples *s, double p)
{
    if (s->n == 0)
        return 0.0;
    size_t rank = (size_t)ceil(p * (double)s->n);
    if (rank < 1)
        rank = 1;
    if (rank > s->n)
        rank = s->n;
    return s->v[rank - 1];
}

static void print_percentiles(const char *prefix, const struct samples *s, const char *unit,
                              double scale)
{
    printf("\"%sp50_%s\":%.1f,\"%sp90_%s\":%.1f,\"%sp99_%s\":%.1f,\"%sp999_%s\":%.1f,"
           "\"%smax_%s\":%.1f",
           prefix, unit, pct(s, 0.50) * scale, prefix, unit, pct(s, 0.90) * scale, prefix, unit,
           pct(s, 0.99) * scale, prefix, unit, pct(s, 0.999) * scale, prefix, unit,
           pct(s, 1.0) * scale);
}

static void print_kinds(const uint64_t kinds[V_NKINDS])
{
    printf("\"kinds\":{");
    int first = 1;
    for (int k = 0; k < V_NKINDS; k++) {
        if (!kinds[k])
            continue;
        printf("%s\"%s\":%llu", first ? "" : ",", VERDICT_NAMES[k], (unsigned long long)kinds[k]);
        first = 0;
    }
    printf("}");
}

/*
 * Raise RLIMIT_NOFILE so N connections fit: the soft limit up to the hard one,
 * and the hard one too when we may (root).  Returns the soft limit in force.
 */
static rlim_t raise_nofile(rlim_t want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        die("getrlimit");
    if (rl.rlim_cur >= want)
        return rl.rlim_cur;
    if (rl.rlim_max < want) {
        struct rlimit more = {want, want};
        if (setrlimit(RLIMIT_NOFILE, &more) == 0)
            return want;
    }
    rl.rlim_cur = rl.rlim_max < want ? rl.rlim_max : want;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
        die("setrlimit");
    if (rl.rlim_cur < want)
        fprintf(stderr, "loadgen: warning: RLIMIT_NOFILE %llu < %llu wanted\n",
                (unsigned long long)rl.rlim_cur, (unsigned long long)want);
    return rl.rlim_cur;
}

static struct sockaddr_un g_addr;
static socklen_t g_addrlen;

static void set_address(const char *path)
{
    if (strlen(path) >= sizeof g_addr.sun_path) {
        fprintf(stderr, "loadgen: socket path too long: %s\n", path);
        exit(2);
    }
    memset(&g_addr, 0, sizeof g_addr);
    g_addr.sun_family = AF_UNIX;
    strcpy(g_addr.sun_path, path);
    g_addrlen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(path) + 1);
}

static int new_socket(void)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket");
    return fd;
}

/* Judge a complete or truncated reply. */
static enum verdict judge(const unsigned char *buf, int got, uint32_t expect_pid,
                          uint32_t *pid_out)
{
    if (got == 0)
        return V_CLOSED;
    if (got < RESPONSE_SIZE)
        return V_SHORT;
    if (memcmp(buf, "HPID", 4) != 0 || buf[4] != 0 || buf[5] != 1)
        return V_BAD_REPLY;
    unsigned status = ((unsigned)buf[6] << 8) | buf[7];
    uint32_t pid = ((uint32_t)buf[8] << 24) | ((uint32_t)buf[9] << 16) | ((uint32_t)buf[10] << 8) |
                   buf[11];
    if (pid_out)
        *pid_out = pid;
    if (status != 0)
        return pid == 0 ? V_INVALID : V_BAD_REPLY;
    if (pid == 0 || pid > PID_MAX)
        return V_BAD_REPLY;
    if (expect_pid && pid != expect_pid)
        return V_WRONG_PID;
    return V_OK;
}

static enum verdict errno_verdict(int e)
{
    if (e == ECONNRESET || e == EPIPE)
        return V_RESET;
    return V_REFUSED;
}

/*
 * One blocking-style transaction as a real client does it: non-blocking
 * connect, EAGAIN retried after 1 ms doubling to 10 ms, the request sent at
 * once, the reply awaited with poll, all under one deadline.  Used by the
 * burst children and the probe.
 */
/* --send-gap-ms: a pause between connect() and send(), as a client that is slow to send. */
static useconds_t g_send_gap_us;

static enum verdict one_transaction(double timeout_s, uint32_t expect_pid, uint32_t *retries)
{
    uint64_t deadline = now_ns() + (uint64_t)(timeout_s * 1e9);
    unsigned backoff_us = 1000;
    int fd = new_socket();
    for (;;) {
        if (connect(fd, (struct sockaddr *)&g_addr, g_addrlen) == 0)
            break;
        if (errno == EAGAIN) {
            (*retries)++;
            uint64_t t = now_ns();
            if (t >= deadline) {
                close(fd);
                return V_TIMEOUT;
            }
            uint64_t left_us = (deadline - t) / 1000;
            usleep(backoff_us < left_us ? backoff_us : (unsigned)left_us);
            backoff_us = backoff_us * 2 > 10000 ? 10000 : backoff_us * 2;
            continue;
        }
        if (errno == EINPROGRESS) {
            /* Not expected for AF_UNIX, but harmless: wait for writability. */
            struct pollfd p = {fd, POLLOUT, 0};
            int ms = (int)((deadline - now_ns()) / 1000000) + 1;
            int err = 0;
            socklen_t len = sizeof err;
            if (poll(&p, 1, ms) <= 0) {
                close(fd);
                return V_TIMEOUT;
            }
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            if (err) {
                close(fd);
                return errno_verdict(err);
            }
            break;
        }
        int e = errno;
        close(fd);
        return errno_verdict(e);
    }
    if (g_send_gap_us)
        usleep(g_send_gap_us);
    if (send(fd, REQUEST, REQUEST_SIZE, MSG_NOSIGNAL) != REQUEST_SIZE) {
        close(fd);
        return V_SEND_FAILED;
    }
    unsigned char buf[RESPONSE_SIZE];
    int got = 0;
    while (got < RESPONSE_SIZE) {
        uint64_t t = now_ns();
        if (t >= deadline) {
            close(fd);
            return V_TIMEOUT;
        }
        struct pollfd p = {fd, POLLIN, 0};
        int ms = (int)((deadline - t + 999999) / 1000000);
        int r = poll(&p, 1, ms);
        if (r < 0 && errno != EINTR) {
            close(fd);
            return V_RESET;
        }
        if (r <= 0)
            continue;
        ssize_t n = recv(fd, buf + got, RESPONSE_SIZE - got, 0);
        if (n > 0) {
            got += (int)n;
            continue;
        }
        if (n == 0)
            break;
        if (errno == EAGAIN || errno == EINTR)
            continue;
        int e = errno;
        close(fd);
        return got ? V_SHORT : errno_verdict(e);
    }
    close(fd);
    return judge(buf, got, expect_pid, NULL);
}

/* ----------------------------------------------------------- closed loop */

enum cstate { C_FREE, C_RETRY, C_CONNECTING, C_READING };

struct conn {
    int fd;
    enum cstate state;
    uint64_t t_start;  /* first connect attempt of this transaction */
    uint64_t retry_at; /* C_RETRY: when to try connecting again */
    unsigned backoff_us;
    int got;
    unsigned char buf[RESPONSE_SIZE + 4];
};

struct closed_loop {
    int ep;
    struct conn *c;
    int n;
    uint32_t expect_pid;
    uint64_t timeout_ns;
    uint64_t max_tx;
    int starting; /* still starting new transactions */
    uint64_t started, completed, retries, retry_pending;
    uint64_t kinds[V_NKINDS];
    struct samples lat;
};

static void cl_attempt(struct closed_loop *L, int i);

static void cl_start(struct closed_loop *L, int i)
{
    struct conn *c = &L->c[i];
    if (!L->starting || L->started >= L->max_tx) {
        c->state = C_FREE;
        return;
    }
    L->started++;
    c->t_start = now_ns();
    c->backoff_us = 1000;
    cl_attempt(L, i);
}

/* End the transaction in slot i with verdict v and start the next one. */
static void cl_finish(struct closed_loop *L, int i, enum verdict v)
{
    struct conn *c = &L->c[i];
    uint64_t t = now_ns();
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    L->completed++;
    L->kinds[v]++;
    if (v == V_OK)
        samples_add(&L->lat, (double)(t - c->t_start) / 1e3);
    if (v == V_REFUSED && L->starting) {
        /* The server is gone or refusing: pace the next try instead of spinning. */
        c->state = C_RETRY;
        c->retry_at = t + 1000000;
        c->t_start = 0; /* marks "start a new transaction", not "retry connect" */
        L->retry_pending++;
        return;
    }
    cl_start(L, i);
}

static void cl_send_and_read(struct closed_loop *L, int i)
{
    struct conn *c = &L->c[i];
    if (send(c->fd, REQUEST, REQUEST_SIZE, MSG_NOSIGNAL) != REQUEST_SIZE) {
        cl_finish(L, i, V_SEND_FAILED);
        return;
    }
    c->got = 0;
    c->state = C_READING;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
    if (epoll_ctl(L->ep, EPOLL_CTL_MOD, c->fd, &ev) != 0)
        die("epoll_ctl mod");
}

static void cl_attempt(struct closed_loop *L, int i)
{
    struct conn *c = &L->c[i];
    c->fd = new_socket();
    if (connect(c->fd, (struct sockaddr *)&g_addr, g_addrlen) == 0) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(L->ep, EPOLL_CTL_ADD, c->fd, &ev) != 0)
            die("epoll_ctl add");
        cl_send_and_read(L, i);
        return;
    }
    if (errno == EAGAIN) {
        /* Accept queue full: back off like a real client, 1 ms doubling to 10 ms. */
        close(c->fd);
        c->fd = -1;
        L->retries++;
        if (now_ns() - c->t_start >= L->timeout_ns) {
            cl_finish(L, i, V_TIMEOUT);
            return;
        }
        c->state = C_RETRY;
        c->retry_at = now_ns() + (uint64_t)c->backoff_us * 1000;
        c->backoff_us = c->backoff_us * 2 > 10000 ? 10000 : c->backoff_us * 2;
        L->retry_pending++;
        return;
    }
    if (errno == EINPROGRESS) {
        c->state = C_CONNECTING;
        struct epoll_event ev = {.events = EPOLLOUT, .data.u32 = (uint32_t)i};
        if (epoll_ctl(L->ep, EPOLL_CTL_ADD, c->fd, &ev) != 0)
            die("epoll_ctl add");
        return;
    }
    cl_finish(L, i, errno_verdict(errno));
}

static void cl_event(struct closed_loop *L, int i, uint32_t events)
{
    struct conn *c = &L->c[i];
    if (c->state == C_CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            cl_finish(L, i, errno_verdict(err));
            return;
        }
        cl_send_and_read(L, i);
        return;
    }
    if (c->state != C_READING)
        return;
    (void)events;
    for (;;) {
        ssize_t n = recv(c->fd, c->buf + c->got, sizeof c->buf - (size_t)c->got, 0);
        if (n > 0) {
            c->got += (int)n;
            if (c->got >= RESPONSE_SIZE) {
                cl_finish(L, i, judge(c->buf, c->got, L->expect_pid, NULL));
                return;
            }
            continue;
        }
        if (n == 0) {
            cl_finish(L, i, judge(c->buf, c->got, L->expect_pid, NULL));
            return;
        }
        if (errno == EAGAIN || errno == EINTR)
            return;
        cl_finish(L, i, c->got ? V_SHORT : errno_verdict(errno));
        return;
    }
}

/* Retries that are due, and transactions past their deadline. */
static void cl_housekeeping(struct closed_loop *L, int check_timeouts)
{
    uint64_t t = now_ns();
    for (int i = 0; i < L->n; i++) {
        struct conn *c = &L->c[i];
        if (c->state == C_RETRY && L->retry_pending && t >= c->retry_at) {
            L->retry_pending--;
            if (c->t_start == 0)
                cl_start(L, i); /* paced start after a refusal */
            else
                cl_attempt(L, i); /* connect retry; cl_attempt enforces the deadline */
        } else if (check_timeouts && (c->state == C_READING || c->state == C_CONNECTING) &&
                   t - c->t_start >= L->timeout_ns) {
            cl_finish(L, i, V_TIMEOUT);
        }
    }
}

static int cl_busy(const struct closed_loop *L)
{
    for (int i = 0; i < L->n; i++)
        if (L->c[i].state != C_FREE)
            return 1;
    return 0;
}

static int run_closed_loop(int clients, double duration, int expect_pid, double timeout_s,
                           uint64_t max_tx)
{
    struct closed_loop L;
    memset(&L, 0, sizeof L);
    raise_nofile((rlim_t)clients + 64);
    L.n = clients;
    L.c = calloc((size_t)clients, sizeof *L.c);
    if (L.c == NULL)
        die("calloc");
    L.ep = epoll_create1(EPOLL_CLOEXEC);
    if (L.ep < 0)
        die("epoll_create1");
    L.expect_pid = expect_pid ? (uint32_t)getpid() : 0;
    L.timeout_ns = (uint64_t)(timeout_s * 1e9);
    L.max_tx = max_tx;
    L.starting = 1;
    for (int i = 0; i < clients; i++)
        L.c[i].fd = -1;

    uint64_t t0 = now_ns();
    uint64_t t_end = t0 + (uint64_t)(duration * 1e9);
    /* After the run, in-flight transactions get one timeout to finish. */
    uint64_t t_drain = t_end + L.timeout_ns + 1000000000u;
    for (int i = 0; i < clients; i++)
        cl_start(&L, i);

    struct epoll_event events[512];
    uint64_t next_check = t0 + 10000000u;
    for (;;) {
        int ms = L.retry_pending ? 1 : 10;
        int n = epoll_wait(L.ep, events, 512, ms);
        if (n < 0 && errno != EINTR)
            die("epoll_wait");
        for (int k = 0; k < n; k++)
            cl_event(&L, (int)events[k].data.u32, events[k].events);
        uint64_t t = now_ns();
        if (L.starting && (t >= t_end || L.started >= L.max_tx))
            L.starting = 0;
        int check = t >= next_check;
        if (check)
            next_check = t + 10000000u;
        if (L.retry_pending || check)
            cl_housekeeping(&L, check);
        if (!L.starting && !cl_busy(&L))
            break;
        if (t >= t_drain) {
            for (int i = 0; i < L.n; i++)
                if (L.c[i].state != C_FREE) {
                    /* A paced restart (t_start 0) was already counted. */
                    if (L.c[i].state != C_RETRY || L.c[i].t_start != 0)
                        cl_finish(&L, i, V_TIMEOUT);
                    L.c[i].state = C_FREE;
                }
            break;
        }
    }
    uint64_t t1 = now_ns();
    double elapsed = (double)(t1 - t0) / 1e9;
    samples_sort(&L.lat);
    uint64_t errors = L.completed - L.kinds[V_OK] - L.kinds[V_WRONG_PID];
    printf("{\"mode\":\"closed\",\"clients\":%d,\"duration_s\":%.3f,\"elapsed_s\":%.3f,"
           "\"expect_pid\":%s,\"tx\":%llu,\"ok\":%llu,\"errors\":%llu,\"wrong_pid\":%llu,"
           "\"tps\":%.1f,\"connect_retries\":%llu,",
           clients, duration, elapsed, expect_pid ? "true" : "false",
           (unsigned long long)L.completed, (unsigned long long)L.kinds[V_OK],
           (unsigned long long)errors, (unsigned long long)L.kinds[V_WRONG_PID],
           elapsed > 0 ? (double)L.kinds[V_OK] / elapsed : 0.0, (unsigned long long)L.retries);
    print_percentiles("", &L.lat, "us", 1.0);
    printf(",\"samples_dropped\":%llu,", (unsigned long long)L.lat.dropped);
    print_kinds(L.kinds);
    printf("}\n");
    fflush(stdout);
    return 0;
}

/* ----------------------------------------------------------------- burst */

struct burst_result {
    int32_t verdict;
    uint32_t retries;
    uint64_t t_done;
};

static int read_full(int fd, void *buf, size_t size, int timeout_ms)
{
    size_t got = 0;
    while (got < size) {
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, timeout_ms);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        ssize_t n = read(fd, (char *)buf + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    return 0;
}

static int run_burst(int n, double timeout_s, int times)
{
    int release[2], ready[2], results[2];
    if (pipe2(release, O_CLOEXEC) || pipe2(ready, O_CLOEXEC) || pipe2(results, O_CLOEXEC))
        die("pipe");
    raise_nofile(256);
    pid_t *kids = calloc((size_t)n, sizeof *kids);
    if (kids == NULL)
        die("calloc");
    int forked = 0;
    for (; forked < n; forked++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "loadgen: fork stopped at %d: %s\n", forked, strerror(errno));
            break;
        }
        if (pid == 0) {
            close(release[1]);
            close(ready[0]);
            close(results[0]);
            char x = 'r';
            if (write(ready[1], &x, 1) != 1)
                _exit(3);
            /* Blocks until the parent closes the write end: all go at once. */
            while (read(release[0], &x, 1) < 0 && errno == EINTR)
                ;
            struct burst_result r = {0, 0, 0};
            r.verdict = one_transaction(timeout_s, (uint32_t)getpid(), &r.retries);
            r.t_done = now_ns();
            /* Smaller than PIPE_BUF: each record arrives whole. */
            if (write(results[1], &r, sizeof r) != (ssize_t)sizeof r)
                _exit(4);
            _exit(0);
        }
        kids[forked] = pid;
    }
    close(ready[1]);
    close(results[1]);
    close(release[0]);
    /* Wait until every child is parked on the release pipe. */
    int parked = 0;
    char junk[256];
    while (parked < forked) {
        struct pollfd p = {ready[0], POLLIN, 0};
        if (poll(&p, 1, 60000) <= 0)
            break;
        ssize_t k = read(ready[0], junk, sizeof junk);
        if (k <= 0)
            break;
        parked += (int)k;
    }
    uint64_t t0 = now_ns();
    close(release[1]);

    uint64_t kinds[V_NKINDS] = {0};
    uint64_t retries = 0, received = 0, last = t0;
    struct samples done = {0};
    int wait_ms = (int)(timeout_s * 1000) + 30000;
    struct burst_result r;
    while (received < (uint64_t)forked && read_full(results[0], &r, sizeof r, wait_ms) == 0) {
        received++;
        if (r.verdict < 0 || r.verdict >= V_NKINDS)
            r.verdict = V_BAD_REPLY;
        kinds[r.verdict]++;
        retries += r.retries;
        if (r.t_done > last)
            last = r.t_done;
        samples_add(&done, (double)(r.t_done - t0) / 1e3);
    }
    for (int i = 0; i < forked; i++)
        waitpid(kids[i], NULL, 0);
    samples_sort(&done);
    uint64_t lost = (uint64_t)n - received;
    uint64_t failures = received - kinds[V_OK] - kinds[V_WRONG_PID] + lost;
    int all_ok = kinds[V_OK] == (uint64_t)n;
    printf("{\"mode\":\"burst\",\"n\":%d,\"forked\":%d,\"parked\":%d,\"ok\":%llu,\"all_ok\":%s,"
           "\"wrong_pid\":%llu,\"failures\":%llu,\"lost\":%llu,\"connect_retries\":%llu,"
           "\"wall_ms\":%.3f,",
           n, forked, parked, (unsigned long long)kinds[V_OK], all_ok ? "true" : "false",
           (unsigned long long)kinds[V_WRONG_PID], (unsigned long long)failures,
           (unsigned long long)lost, (unsigned long long)retries, (double)(last - t0) / 1e6);
    print_percentiles("done_", &done, "ms", 1e-3);
    printf(",");
    print_kinds(kinds);
    if (times) {
        /* Every completion time, sorted, for plots; 0.01 ms is plenty. */
        printf(",\"done_ms\":[");
        for (size_t i = 0; i < done.n; i++)
            printf("%s%.2f", i ? "," : "", done.v[i] / 1e3);
        printf("]");
    }
    printf("}\n");
    fflush(stdout);
    return 0;
}

/* --------------------------------------------------------- silent attack */

struct probe_stats {
    uint64_t sent, answered, wrong_pid, refused, send_failed, reset, closed, timeout, other, retries;
    double first_answer_ms; /* -1: none */
    double p50_us, p99_us, max_us;
};

/* The probe: a real client in its own process, asking in a loop. */
static void probe_loop(int start_fd, int out_fd, double hold_s, double probe_timeout,
                       double interval_ms, uint64_t max_probes)
{
    char x;
    if (read(start_fd, &x, 1) != 1)
        _exit(0); /* the parent gave up before the attack was in place */
    struct probe_stats s;
    memset(&s, 0, sizeof s);
    s.first_answer_ms = -1;
    struct samples lat = {0};
    uint32_t me = (uint32_t)getpid();
    uint64_t t0 = now_ns(), t_end = t0 + (uint64_t)(hold_s * 1e9);
    while (now_ns() < t_end && s.sent < max_probes) {
        uint64_t t = now_ns();
        uint32_t retries = 0;
        enum verdict v = one_transaction(probe_timeout, me, &retries);
        uint64_t t1 = now_ns();
        s.sent++;
        s.retries += retries;
        switch (v) {
        case V_OK:
            s.answered++;
            samples_add(&lat, (double)(t1 - t) / 1e3);
            if (s.first_answer_ms < 0)
                s.first_answer_ms = (double)(t1 - t0) / 1e6;
            break;
        case V_WRONG_PID:
            s.wrong_pid++;
            break;
        case V_REFUSED:
            s.refused++;
            break;
        case V_SEND_FAILED:
            s.send_failed++;
            break;
        case V_RESET:
            s.reset++;
            break;
        case V_CLOSED:
        case V_SHORT:
            s.closed++;
            break;
        case V_TIMEOUT:
            s.timeout++;
            break;
        default:
            s.other++;
        }
        if (interval_ms > 0)
            usleep((useconds_t)(interval_ms * 1000));
    }
    samples_sort(&lat);
    s.p50_us = pct(&lat, 0.5);
    s.p99_us = pct(&lat, 0.99);
    s.max_us = pct(&lat, 1.0);
    if (write(out_fd, &s, sizeof s) != (ssize_t)sizeof s)
        _exit(5);
    _exit(0);
}

struct idle_conn {
    int fd; /* -1: not connected */
    uint64_t retry_at;
    int ever_connected;
};

/* An event on idle slot i: if the server closed it, close our end and return 1. */
static int idle_closed(struct idle_conn *c, int i, int *open_now)
{
    if (c[i].fd < 0)
        return 0;
    char buf[64];
    ssize_t got = recv(c[i].fd, buf, sizeof buf, MSG_DONTWAIT);
    if (got > 0 || (got < 0 && errno == EAGAIN))
        return 0;
    close(c[i].fd);
    c[i].fd = -1;
    (*open_now)--;
    return 1;
}

static int run_idle(int n, double hold_s, int reconnect, double probe_timeout, double interval_ms,
                    uint64_t max_probes)
{
    int start[2], out[2];
    if (pipe2(start, O_CLOEXEC) || pipe2(out, O_CLOEXEC))
        die("pipe");
    fflush(stdout);
    /* Fork the probe before opening anything, so it holds none of our descriptors. */
    pid_t probe = fork();
    if (probe < 0)
        die("fork");
    if (probe == 0) {
        close(start[1]);
        close(out[0]);
        probe_loop(start[0], out[1], hold_s, probe_timeout, interval_ms, max_probes);
    }
    close(start[0]);
    close(out[1]);
    raise_nofile((rlim_t)n + 64);

    struct idle_conn *c = calloc((size_t)n, sizeof *c);
    if (c == NULL)
        die("calloc");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0)
        die("epoll_create1");
    uint64_t connects = 0, closed_by_server = 0, reconnects = 0, retries = 0, errors = 0;
    int open_now = 0;

    /* Open (or re-open) slot i; on EAGAIN schedule a retry 1 ms later. */
#define IDLE_OPEN(i)                                                                             \
    do {                                                                                         \
        int fd_ = new_socket();                                                                  \
        if (connect(fd_, (struct sockaddr *)&g_addr, g_addrlen) == 0) {                          \
            struct epoll_event ev_ = {.events = EPOLLIN | EPOLLRDHUP, .data.u32 = (uint32_t)(i)}; \
            if (epoll_ctl(ep, EPOLL_CTL_ADD, fd_, &ev_) != 0)                                    \
                die("epoll_ctl add");                                                            \
            c[i].fd = fd_;                                                                       \
            c[i].ever_connected = 1;                                                             \
            connects++;                                                                          \
            open_now++;                                                                          \
        } else {                                                                                 \
            if (errno == EAGAIN)                                                                 \
                retries++;                                                                       \
            else                                                                                 \
                errors++;                                                                        \
            close(fd_);                                                                          \
            c[i].fd = -1;                                                                        \
            c[i].retry_at = now_ns() + 1000000u;                                                 \
        }                                                                                        \
    } while (0)

    uint64_t t_setup = now_ns();
    uint64_t setup_limit = t_setup + 30000000000u; /* bounded even if the server never accepts */
    for (int i = 0; i < n; i++)
        IDLE_OPEN(i);
    struct epoll_event events[512];
    int pending;
    uint64_t closed_during_setup = 0;
    /* Set up: every slot connected at least once (closed ones stay closed without --reconnect). */
    do {
        int r = epoll_wait(ep, events, 512, 1);
        for (int k = 0; k < r; k++) {
            int i = (int)events[k].data.u32;
            if (!idle_closed(c, i, &open_now))
                continue;
            closed_during_setup++;
            c[i].retry_at = reconnect ? 0 : UINT64_MAX;
        }
        pending = 0;
        uint64_t t = now_ns();
        for (int i = 0; i < n; i++) {
            if (c[i].fd >= 0)
                continue;
            if (c[i].ever_connected && !reconnect)
                continue;
            if (t >= c[i].retry_at) {
                if (c[i].ever_connected)
                    reconnects++;
                IDLE_OPEN(i);
            }
            if (!c[i].ever_connected)
                pending++;
        }
    } while (pending && now_ns() < setup_limit);
    double setup_ms = (double)(now_ns() - t_setup) / 1e6;
    int open_at_probe_start = open_now;

    /* Release the probe and hold. */
    char go = 'g';
    if (write(start[1], &go, 1) != 1)
        die("write probe start");
    uint64_t t0 = now_ns(), t_end = t0 + (uint64_t)(hold_s * 1e9);
    int open_min = open_now, open_max = open_now;
    uint64_t next_scan = 0;
    while (now_ns() < t_end) {
        int r = epoll_wait(ep, events, 512, 1);
        for (int k = 0; k < r; k++) {
            int i = (int)events[k].data.u32;
            if (!idle_closed(c, i, &open_now))
                continue;
            closed_by_server++;
            if (reconnect) {
                reconnects++;
                IDLE_OPEN(i);
            }
        }
        uint64_t t = now_ns();
        if (reconnect && t >= next_scan) {
            next_scan = t + 1000000u;
            for (int i = 0; i < n; i++)
                if (c[i].fd < 0 && t >= c[i].retry_at) {
                    reconnects++;
                    IDLE_OPEN(i);
                }
        }
        if (open_now < open_min)
            open_min = open_now;
        if (open_now > open_max)
            open_max = open_now;
    }
    for (int i = 0; i < n; i++)
        if (c[i].fd >= 0)
            close(c[i].fd);

    struct probe_stats s;
    memset(&s, 0, sizeof s);
    s.first_answer_ms = -1;
    int have = read_full(out[0], &s, sizeof s, (int)(probe_timeout * 1000) + 10000) == 0;
    if (!have)
        kill(probe, SIGKILL);
    waitpid(probe, NULL, 0);

    printf("{\"mode\":\"idle\",\"idle\":%d,\"hold_s\":%.3f,\"reconnect\":%s,\"setup_ms\":%.1f,"
           "\"idle_connects\":%llu,\"idle_closed_during_setup\":%llu,"
           "\"idle_closed_by_server\":%llu,\"idle_reconnects\":%llu,\"idle_connect_retries\":%llu,"
           "\"idle_connect_errors\":%llu,\"idle_open_at_probe_start\":%d,\"idle_open_min\":%d,"
           "\"idle_open_max\":%d,\"probe_ok\":%s,\"probes_sent\":%llu,\"probes_answered\":%llu,"
           "\"probes_wrong_pid\":%llu,\"probes_refused\":%llu,\"probes_send_failed\":%llu,\"probes_reset\":%llu,\"probes_closed\":%llu,"
           "\"probes_timeout\":%llu,\"probes_other\":%llu,\"probe_connect_retries\":%llu,"
           "\"probe_p50_us\":%.1f,\"probe_p99_us\":%.1f,\"probe_max_us\":%.1f,",
           n, hold_s, reconnect ? "true" : "false", setup_ms, (unsigned long long)connects,
           (unsigned long long)closed_during_setup, (unsigned long long)closed_by_server,
           (unsigned long long)reconnects, (unsigned long long)retries,
           (unsigned long long)errors, open_at_probe_start, open_min, open_max,
           have ? "true" : "false", (unsigned long long)s.sent, (unsigned long long)s.answered,
           (unsigned long long)s.wrong_pid, (unsigned long long)s.refused,
           (unsigned long long)s.send_failed, (unsigned long long)s.reset, (unsigned long long)s.closed, (unsigned long long)s.timeout,
           (unsigned long long)s.other, (unsigned long long)s.retries, s.p50_us, s.p99_us,
           s.max_us);
    if (s.first_answer_ms >= 0)
        printf("\"first_answer_ms\":%.3f}\n", s.first_answer_ms);
    else
        printf("\"first_answer_ms\":null}\n");
    fflush(stdout);
    return 0;
}

/* ------------------------------------------------------------------ main */

static void usage(void)
{
    fprintf(stderr,
            "usage: loadgen --socket PATH MODE [options]   (prints one JSON line)\n"
            "modes:\n"
            "  --clients N --duration S [--expect-pid] [--max-tx K]  closed loop\n"
            "  --burst N [--times]                                  N processes at once\n"
            "  --idle N --hold S [--reconnect] [--probe-timeout S] [--probe-interval-ms M]\n"
            "                                                       silent-client attack\n"
            "options:\n"
            "  --timeout S   per-transaction deadline (closed loop, burst), default 5\n"
            "  --send-gap-ms M  pause M ms between connect() and send() in every real\n"
            "                transaction (burst, probe): a client slow to send\n");
    exit(2);
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    int clients = 0, burst = 0, idle = 0, expect_pid = 0, reconnect = 0, times = 0;
    double duration = 0, hold = 0, timeout_s = 5.0, probe_timeout = 0.5, interval_ms = 0;
    uint64_t max_tx = 100000000u, max_probes = 10000000u;
    static const struct option opts[] = {
        {"socket", required_argument, 0, 's'},
        {"clients", required_argument, 0, 'c'},
        {"duration", required_argument, 0, 'd'},
        {"expect-pid", no_argument, 0, 'e'},
        {"max-tx", required_argument, 0, 'm'},
        {"burst", required_argument, 0, 'b'},
        {"idle", required_argument, 0, 'i'},
        {"hold", required_argument, 0, 'h'},
        {"reconnect", no_argument, 0, 'r'},
        {"timeout", required_argument, 0, 't'},
        {"probe-timeout", required_argument, 0, 'p'},
        {"probe-interval-ms", required_argument, 0, 'I'},
        {"max-probes", required_argument, 0, 'M'},
        {"times", no_argument, 0, 'T'},
        {"send-gap-ms", required_argument, 0, 'G'},
        {0, 0, 0, 0},
    };
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 's': path = optarg; break;
        case 'c': clients = atoi(optarg); break;
        case 'd': duration = atof(optarg); break;
        case 'e': expect_pid = 1; break;
        case 'm': max_tx = strtoull(optarg, NULL, 10); break;
        case 'b': burst = atoi(optarg); break;
        case 'i': idle = atoi(optarg); break;
        case 'h': hold = atof(optarg); break;
        case 'r': reconnect = 1; break;
        case 't': timeout_s = atof(optarg); break;
        case 'p': probe_timeout = atof(optarg); break;
        case 'I': interval_ms = atof(optarg); break;
        case 'M': max_probes = strtoull(optarg, NULL, 10); break;
        case 'T': times = 1; break;
        case 'G': {
            double gap_ms = atof(optarg);
            if (!(gap_ms >= 0 && gap_ms <= 1000))
                usage();
            g_send_gap_us = (useconds_t)(gap_ms * 1000);
            break;
        }
        default: usage();
        }
    }
    int modes = (clients > 0) + (burst > 0) + (idle > 0);
    if (path == NULL || modes != 1 || optind != argc || timeout_s <= 0 || probe_timeout <= 0)
        usage();
    /* Bounded by time always: refuse runs that would not end by themselves. */
    if (clients > 0 && !(duration > 0 && duration <= 3600))
        usage();
    if (idle > 0 && !(hold > 0 && hold <= 3600))
        usage();
    if (burst > 100000 || clients > 1000000 || idle > 1000000)
        usage();
    signal(SIGPIPE, SIG_IGN);
    set_address(path);
    if (clients > 0)
        return run_closed_loop(clients, duration, expect_pid, timeout_s, max_tx);
    if (burst > 0)
        return run_burst(burst, timeout_s, times);
    return run_idle(idle, hold, reconnect, probe_timeout, interval_ms, max_probes);
}
