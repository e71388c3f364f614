"""
C{hostpid nri-probe}: the kubelet's exec probe of the NRI plugin.

The plugin's C{/healthz} and C{/readyz} used to be the kubelet's C{httpGet}
probes on its metrics port, which listens on the pod's address for
Prometheus: any pod could reach it, and one flooding process (100,346
connects in 20 s) failed 8 of 9 liveness probes, three in a row restart the
container, and flooding the standby's port too restarts both.  So the
probes run inside the plugin's container (an exec probe, as the broker's
C{hostpid probe}) and ask the plugin's C{--health} listener, which listens
where no other pod can connect (the pod's loopback, or a Unix socket) and has
its own connection cap (L{hostpid.nri.health}).

One C{GET}, one answer, blocking, with one deadline: the interpreter is
started afresh every few seconds on every node, so this module imports only
the standard library's C{socket}.
"""

from __future__ import annotations

import socket
import time

from hostpid.defaults import NRI_PROBE_TIMEOUT

#: The most of an answer read: the plugin's are a line.
MAX_ANSWER = 16384


class ProbeError(Exception):
    """The plugin did not answer 200; the text says what happened."""


def parse_address(text: str) -> tuple[int, str | tuple[str, int]]:
    """
    C{HOST:PORT} (C{[::1]:PORT} for IPv6) or an absolute Unix socket path, as
    a socket family and the address C{connect} takes.

    @raise ValueError: anything else.
    """
    if text.startswith("/"):
        return socket.AF_UNIX, text
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is neither HOST:PORT nor an absolute Unix socket path")
    if host.startswith("[") and host.endswith("]"):
        return socket.AF_INET6, (host[1:-1], int(port))
    return socket.AF_INET, (host, int(port))


def get(address: str, path: str, timeout: float = NRI_PROBE_TIMEOUT) -> str:
    """
    C{GET path} from the plugin's health listener at C{address}; its body
    when the answer is 200.

    @raise ProbeError: no 200 within C{timeout} seconds, with the reason.
    @raise ValueError: C{address} is not an address (L{parse_address}).
    """
    family, where = parse_address(address)
    deadline = time.monotonic() + timeout
    shown = f"{address}{path}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(where)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n"
                         "Connection: close\r\n\r\n".encode("ascii"))
            answer = b""
            while len(answer) < MAX_ANSWER:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(MAX_ANSWER - len(answer))
                if not chunk:
                    break
                answer += chunk
    except TimeoutError:
        raise ProbeError(f"{shown}: no answer within {timeout:g} s") from None
    except OSError as e:
        raise ProbeError(f"{shown}: {e.strerror or e}") from None
    head, _, body = answer.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    text = body.decode("utf-8", "replace").strip()
    if len(status) < 2 or not status[1].isdigit():
        raise ProbeError(f"{shown}: not an HTTP answer")
    if status[1] != b"200":
        raise ProbeError(f"{shown}: {status[1].decode()} {text}".rstrip())
    return text
