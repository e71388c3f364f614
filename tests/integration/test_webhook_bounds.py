"""
A real C{twistd hostpid-webhook} over TLS against what a hostile tenant can
send it: anyone who may create a pod reaches the webhook with whatever pod
it likes, since the API server calls mutating webhooks before it validates
names, paths or quantities; and any pod in the cluster may reach its port.

Each check is something that once knocked the webhook over or made it
answer wrongly:

  - an amplifier pod (one long container name, many mounts under the broker
    directory) that turned 135 KB into a 40 MB answer and a 42 s reactor
    stall;
  - zero-GPU pods (C{"0"}, C{"0.0"}, ...) that got the broker;
  - a 250 KB pod name copied into every log line;
  - a cdi annotation that pushed a pod past the API server's 256 KiB
    annotations limit;
  - 40 connections holding almost 1 MiB each, draining the body budget so
    that normal reviews were answered 503;
  - a connection flood evicting the API server's kept-alive connection.

One module-scoped webhook per mode serves every test; the memory check at
the end reads the peak RSS the attacks before it left.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import TWISTD, WAIT_SECONDS, cpu_seconds, scaled, subprocess_env, wait_for
from test_webhook_tls import (
    MAX_BODY,
    SERVICE_NAME,
    Webhook,
    admission_review,
    gpu,
    patched,
    pod,
    tls,  # noqa: F401 - the module-scoped fixture
    valid,
    with_broker,
)

from hostpid.admission.decision import ANNOTATION_KEY

#: The largest answer any request under the body cap may get.
MAX_ANSWER = 64 * 1024
#: The chart's memory limit for the webhook's container.
CHART_MEMORY_LIMIT = 128 * 1024 * 1024
#: What the peak RSS must stay under: the limit less the margin the docs state.
RSS_BOUND = 100 * 1024 * 1024
#: The request deadline of the webhook the connection flood is run against.
FLOOD_TIMEOUT = scaled(30.0)


@pytest.fixture(scope="module")
def hooks(tls: dict[str, Path]) -> Iterator[dict[str, Webhook]]:  # noqa: F811
    started: dict[str, Webhook] = {}
    try:
        started["mounts"] = Webhook(tls, "mounts", "1")
        # Long enough for a flood past the connection cap to be opened
        # before the first of its connections times out.
        started["cdi"] = Webhook(tls, "cdi", "1", timeout=FLOOD_TIMEOUT)
        yield started
    finally:
        for webhook in started.values():
            webhook.stop()


def timed_post(webhook: Webhook, body: bytes) -> tuple[int, bytes, float]:
    connection = webhook.connection()
    try:
        started = time.monotonic()
        connection.request("POST", "/mutate", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        return response.status, data, time.monotonic() - started
    finally:
        connection.close()


def cpu_post(webhook: Webhook, body: bytes) -> tuple[int, bytes, float]:
    """
    C{body} posted, and the webhook's CPU time (user and system) for it: the
    cost of building the answer, whatever else the shared machine runs.
    """
    before = cpu_seconds(webhook.process.pid)
    status, data, _ = timed_post(webhook, body)
    return status, data, cpu_seconds(webhook.process.pid) - before


def amplifier(name_bytes: int, mounts: int) -> dict[str, Any]:
    container = gpu("n" * name_bytes, volumeMounts=[
        {"name": f"v{i}", "mountPath": f"/tmp/vgpulock/hostpid/{i}"} for i in range(mounts)])
    return pod(container)


@pytest.mark.parametrize("name_bytes, mounts", [(20_000, 2_000), (200_000, 13_000)],
                         ids=["135KB", "near-the-body-cap"])
def test_an_amplifier_pod_gets_a_small_answer_at_once(hooks: dict[str, Webhook],
                                                       name_bytes: int, mounts: int) -> None:
    """
    One warning per shadowing mount, each repeating a long container name
    (135 KB in was 40 MB out and 42 s; near the body cap, gigabytes): the
    answer stays under 64 KiB and is built well inside a second (of the
    webhook's CPU, which receiving and parsing the body take most of), and
    the warnings say how many more there were.
    """
    webhook = hooks["mounts"]
    body = json.dumps(admission_review(amplifier(name_bytes, mounts), str(uuid.uuid4()))).encode()
    assert len(body) < MAX_BODY
    status, data, took = cpu_post(webhook, body)
    assert status == 200, data[:200]
    assert len(data) < MAX_ANSWER, len(data)
    assert took < scaled(0.5), took
    response = json.loads(data)["response"]
    assert response["allowed"] is True and "patch" not in response
    assert any("more" in warning for warning in response["warnings"]), response["warnings"]


def test_the_answer_to_many_qualifying_containers_stays_small(
        hooks: dict[str, Webhook]) -> None:
    """Thousands of GPU containers: a patch for each would be megabytes; none is given."""
    webhook = hooks["mounts"]
    many = pod(*[gpu(f"c{i}") for i in range(10_000)])
    body = json.dumps(admission_review(many, str(uuid.uuid4()))).encode()
    assert len(body) < MAX_BODY
    status, data, took = cpu_post(webhook, body)
    assert status == 200 and len(data) < MAX_ANSWER, (status, len(data))
    assert took < scaled(0.5), took
    response = json.loads(data)["response"]
    assert "patch" not in response and response["warnings"], response


@pytest.mark.parametrize("where", ["requests", "limits"])
@pytest.mark.parametrize("amount", ["0", "0.0", "00", "0Gi", "0e3", "-0", "0m", "+0", ".0", 0])
def test_a_zero_gpu_pod_does_not_qualify(hooks: dict[str, Webhook], amount: Any,
                                         where: str) -> None:
    webhook = hooks["mounts"]
    zero = pod({"name": "cuda", "image": "cuda:12",
                "resources": {where: {"nvidia.com/gpu": amount}}})
    response = webhook.review(zero)
    assert "patch" not in response, response


@pytest.mark.parametrize("amount", ["1", "1e0", "2", 1, "1k", "1Ki", "0.5"])
def test_a_positive_quantity_qualifies(hooks: dict[str, Webhook], amount: Any) -> None:
    webhook = hooks["mounts"]
    one = pod({"name": "cuda", "image": "cuda:12",
               "resources": {"requests": {"nvidia.com/gpu": amount}}})
    result = patched(one, webhook.review(one))
    assert with_broker(result) == 1


def test_a_long_pod_name_is_not_copied_into_the_log(hooks: dict[str, Webhook]) -> None:
    """20 reviews of a pod whose name is 250 KB write a few kilobytes of log, not 5 MB."""
    webhook = hooks["mounts"]
    named = pod(gpu("cuda"))
    named["metadata"]["name"] = "p" * 250_000
    before = len(webhook.output())
    for _ in range(20):
        assert "patch" in webhook.review(named)
    written = len(webhook.output()) - before
    assert written < 20 * 1024, written


def annotated(total: int) -> dict[str, Any]:
    """A GPU pod whose annotations' sizes (key plus value) add up to C{total} bytes."""
    annotations = {"big": "a" * (total - len("big") - len("small") - 1), "small": "b"}
    assert sum(len(k) + len(v) for k, v in annotations.items()) == total
    return pod(gpu("cuda"), annotations=annotations)


def test_cdi_does_not_push_annotations_past_the_api_servers_limit(
        hooks: dict[str, Webhook]) -> None:
    """
    The API server refuses a pod whose annotations (keys and values) pass
    256 KiB, whatever the failurePolicy: a pod 40 bytes short of it is left
    unpatched with a warning; one with room gets the annotation.
    """
    webhook = hooks["cdi"]
    limit = 256 * 1024
    near = annotated(limit - 40)
    response = webhook.review(near)
    assert "patch" not in response, response
    assert any("256" in w and "annotation" in w for w in response["warnings"]), response
    room = annotated(limit - 47)
    result = patched(room, webhook.review(room))
    assert ANNOTATION_KEY in result["metadata"]["annotations"]
    assert sum(len(k) + len(v) for k, v in result["metadata"]["annotations"].items()) <= limit
    valid(result)


#: Forty connections, each sending just under 1 MiB of a 1 MiB body and
#: holding it, starting over a tenth of a second after the webhook cuts it: argv port, CA
#: file, server name, connections.  Prints a line once each has sent its body
#: or been cut trying (or after 20 s); runs until killed.  A process of its own, so that its TLS
#: work does not slow the test's own reviews.
DRAINERS = r"""
import socket, ssl, sys, threading, time
port, cafile, name, count = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
context = ssl.create_default_context(cafile=cafile)
head = (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (1024 * 1024,))
chunk = b" " * 65536
sent = set()
def drain(index):
    while True:
        try:
            raw = socket.create_connection(("127.0.0.1", port), timeout=30)
            with context.wrap_socket(raw, server_hostname=name) as sock:
                sock.sendall(head)
                for _ in range(15):
                    sock.sendall(chunk)
                sock.sendall(chunk[:-1])
                sent.add(index)
                while sock.recv(4096):
                    pass
        except OSError:
            sent.add(index)  # cut before it was all sent: it tried
        time.sleep(0.1)
for index in range(count):
    threading.Thread(target=drain, args=(index,), daemon=True).start()
started = time.monotonic()
while len(sent) < count and time.monotonic() - started < 20:
    time.sleep(0.05)
print("sent", len(sent), flush=True)
sys.stdin.read()
"""


def test_forty_connections_cannot_drain_the_body_budget(hooks: dict[str, Webhook]) -> None:
    """
    While 40 connections each hold almost 1 MiB of a body (and start over
    when cut), no normal review is refused and each is answered within a
    second: at most 3 of 30 may be late on a machine shared with other work
    (it is the webhook's CPU that decrypts the drainers' bodies and their
    handshakes); a refusal, what a drained budget gave, has no such excuse.
    """
    # The webhook with the long request deadline: the drainers that got in
    # hold their bodies for the whole test, those refused start over at
    # once, and no normal review is cut by the deadline on a
    # loaded machine.
    webhook = hooks["cdi"]
    drainers = subprocess.Popen(
        [sys.executable, "-c", DRAINERS, str(webhook.port), str(webhook.tls["ca.crt"]),
         SERVICE_NAME, "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    answered = late = refused = failed = 0
    try:
        assert drainers.stdout is not None
        # Every drainer has sent its body once (the script gives up waiting
        # after 20 s, so this line always comes).
        assert drainers.stdout.readline().startswith("sent ")
        # The budget is full: a drainer was refused for want of room.
        wait_for(lambda: refused_count(webhook, "busy") >= 1, "a drainer refused 503",
                 timeout=WAIT_SECONDS * 4)
        body = json.dumps(admission_review(pod(gpu("cuda")), "drain")).encode()
        for _ in range(30):
            try:
                status, _, took = timed_post(webhook, body)
            except (OSError, http.client.HTTPException):
                failed += 1
                continue
            if status != 200:
                refused += 1
            elif took >= scaled(1.0):
                late += 1
            else:
                answered += 1
    finally:
        drainers.kill()
        drainers.wait()
    assert refused == 0 and late + failed <= 3, (answered, late, refused, failed)


def test_a_kept_alive_client_survives_a_connection_flood(hooks: dict[str, Webhook]) -> None:
    """
    Past the 256-connection cap, the connections evicted are those that never
    completed a request, not the API server's kept-alive one: it keeps being
    answered while 300 idle connections are opened, and after.
    """
    webhook = hooks["cdi"]
    kept = webhook.connection()
    flood: list[socket.socket] = []
    done = threading.Event()

    def open_flood() -> None:
        try:
            for _ in range(300):
                flood.append(socket.create_connection(("127.0.0.1", webhook.port),
                                                      timeout=WAIT_SECONDS))
        finally:
            done.set()

    flooder = threading.Thread(target=open_flood, daemon=True)
    try:
        assert "patch" in webhook.review(pod(gpu("cuda")), kept)
        flooder.start()
        answered = 0
        while not done.is_set():
            assert "patch" in webhook.review(pod(gpu("cuda")), kept)
            answered += 1
        for _ in range(5):
            assert "patch" in webhook.review(pod(gpu("cuda")), kept)
        assert len(flood) == 300
        assert refused_count(webhook, "evicted") >= 300 - 256, "the flood passed the cap"
    finally:
        done.wait(WAIT_SECONDS)
        kept.close()
        for sock in flood:
            sock.close()


def refused_count(webhook: Webhook, reason: str) -> float:
    """C{hostpid_webhook_refused_requests_total{reason}}, from the webhook's /metrics."""
    connection = webhook.connection()
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    match = re.search(rf'^hostpid_webhook_refused_requests_total\{{reason="{reason}"\}} (\S+)',
                      text, re.M)
    assert match, text
    return float(match.group(1))


def test_peak_memory_under_the_attacks_stays_under_the_chart_limit(
        hooks: dict[str, Webhook]) -> None:
    """Runs last: VmHWM is the process's peak RSS over every attack above."""
    for webhook in hooks.values():
        status = Path(f"/proc/{webhook.process.pid}/status").read_text()
        peak = int(next(line.split()[1] for line in status.splitlines()
                        if line.startswith("VmHWM:"))) * 1024
        print(f"peak RSS {peak / 2**20:.1f} MiB")
        assert peak < RSS_BOUND < CHART_MEMORY_LIMIT, peak


def inode_of(path: Path) -> int | None:
    """C{path}'s inode, or None while a rotation has it renamed."""
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def test_log_file_rotation_keeps_a_bounded_number_of_files(
        tls: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """
    twistd's own --logfile keeps every rotated file; the webhook's keeps
    --log-files of them: five rotations (SIGUSR1, as at each megabyte) leave
    the log and two rotated files.
    """
    log = tmp_path / "webhook.log"
    argv = [*TWISTD, "--nodaemon", "--pidfile=", "--logfile", str(log), "hostpid-webhook",
            "--endpoint", f"ssl:0:interface=127.0.0.1:privateKey={tls['tls.key']}"
                          f":certKey={tls['tls.crt']}", "--log-files", "2"]
    process = subprocess.Popen(argv, env=subprocess_env(), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               cwd=tmp_path)
    try:
        wait_for(lambda: log.exists() and "listening on port" in log.read_text(),
                 "the webhook's listening line in its log file")
        for _ in range(5):
            inode = inode_of(log)
            process.send_signal(signal.SIGUSR1)
            wait_for(lambda inode=inode: inode_of(log) not in (None, inode),  # type: ignore[misc]
                     "a rotation")
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "webhook.log", "webhook.log.1", "webhook.log.2"]
    finally:
        process.terminate()
        process.wait(WAIT_SECONDS)
