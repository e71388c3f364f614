/*
 * Continuous HAMi-core-like load on the broker socket, for tests of restarts
 * and handovers: every INTERVAL microseconds a new process (fork) does what
 * HAMi-core does once per process: a non-blocking connect retried on EAGAIN,
 * one 8-byte request, a 12-byte reply, all under one 0.5 s deadline.  Each
 * child checks that the PID answered is its own.
 *
 * Usage: hamiload SOCKET INTERVAL_US [DEADLINE_MS]
 * Runs until SIGTERM or SIGINT, then waits for its children and prints one
 * line of JSON: clients, answered, fallbacks (any failure: the workload would
 * use its slow path), wrong (a PID that is not the client's), the fallbacks
 * by reason, and the longest gap: the longest stretch from the start of a
 * client that fell back to the start of the next client that was answered,
 * in milliseconds.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum outcome { OK = 0, WRONG = 2, F_ENOENT = 10, F_REFUSED, F_TIMEOUT, F_SHORT, F_OTHER, F_BADREPLY };
static const char *names[] = {
    [F_ENOENT] = "ENOENT", [F_REFUSED] = "ECONNREFUSED", [F_TIMEOUT] = "deadline",
    [F_SHORT] = "closed", [F_OTHER] = "other", [F_BADREPLY] = "bad-reply",
};

static volatile sig_atomic_t stopping;
static void on_stop(int signum) { (void)signum; stopping = 1; }

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int left_ms(double deadline)
{
    double left = deadline - now();
    return left <= 0 ? 0 : (int)(left * 1000) + 1;
}

static int client(const char *path, int deadline_ms)
{
    double deadline = now() + deadline_ms / 1000.0;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return F_OTHER;
    while (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        if (errno == ENOENT)
            return F_ENOENT;
        if (errno == ECONNREFUSED)
            return F_REFUSED;
        if (errno != EAGAIN)
            return F_OTHER;
        if (left_ms(deadline) == 0)
            return F_TIMEOUT;
        usleep(1000);
    }
    static const unsigned char request[8] = {'H', 'P', 'I', 'D', 0, 1, 0, 1};
    if (send(fd, request, sizeof request, MSG_NOSIGNAL) != (ssize_t)sizeof request)
        return F_OTHER;
    unsigned char reply[12];
    size_t got = 0;
    while (got < sizeof reply) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ms = left_ms(deadline);
        if (ms == 0 || poll(&p, 1, ms) <= 0)
            return F_TIMEOUT;
        ssize_t n = recv(fd, reply + got, sizeof reply - got, 0);
        if (n == 0)
            return F_SHORT;
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            return F_SHORT;
        }
        got += (size_t)n;
    }
    if (memcmp(reply, "HPID\0\1\0\0", 8) != 0)
        return F_BADREPLY;
    uint32_t pid = ((uint32_t)reply[8] << 24) | (reply[9] << 16) | (reply[10] << 8) | reply[11];
    return pid == (uint32_t)getpid() ? OK : WRONG;
}

#define MAX_CLIENTS 200000
static double started[MAX_CLIENTS];
static pid_t pids[MAX_CLIENTS];
static int outcomes[MAX_CLIENTS];

static void reap(int count, int block)
{
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, block ? 0 : WNOHANG)) > 0) {
        for (int i = count - 1; i >= 0; i--)
            if (pids[i] == pid) {
                outcomes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : F_OTHER;
                break;
            }
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: hamiload SOCKET INTERVAL_US [DEADLINE_MS]\n");
        return 2;
    }
    const char *path = argv[1];
    long interval = atol(argv[2]);
    int deadline_ms = argc > 3 ? atoi(argv[3]) : 500;
    signal(SIGTERM, on_stop);
    signal(SIGINT, on_stop);
    int count = 0;
    while (!stopping && count < MAX_CLIENTS) {
        started[count] = now();
        outcomes[count] = -1;
        pid_t pid = fork();
        if (pid == 0)
            _exit(client(path, deadline_ms));
        if (pid < 0) {
            perror("fork");
            break;
        }
        pids[count++] = pid;
        reap(count, 0);
        usleep((useconds_t)interval);
    }
    reap(count, 1);
    int answered = 0, wrong = 0, fallbacks = 0, by[F_BADREPLY + 1] = {0};
    double gap = 0, gap_start = -1;
    for (int i = 0; i < count; i++) {
        int o = outcomes[i];
        if (o == OK) {
            answered++;
            if (gap_start >= 0 && started[i] - gap_start > gap)
                gap = started[i] - gap_start;
            gap_start = -1;
        } else if (o == WRONG) {
            wrong++;
        } else {
            fallbacks++;
            by[o >= F_ENOENT && o <= F_BADREPLY ? o : F_OTHER]++;
            if (gap_start < 0)
                gap_start = started[i];
        }
    }
    if (gap_start >= 0 && count > 0 && now() - gap_start > gap)
        gap = now() - gap_start;
    printf("{\"clients\": %d, \"answered\": %d, \"fallbacks\": %d, \"wrong\": %d, "
           "\"longest_gap_ms\": %.1f, \"by_reason\": {", count, answered, fallbacks, wrong,
           gap * 1000);
    int first = 1;
    for (int o = F_ENOENT; o <= F_BADREPLY; o++)
        if (by[o]) {
            printf("%s\"%s\": %d", first ? "" : ", ", names[o], by[o]);
            first = 0;
        }
    printf("}}\n");
    return 0;
}
