"""
C{twistd hostpid-webhook} as the API server reaches it: AdmissionReviews over
real TLS, with the certificate the chart itself generates (rendered by Helm,
taken from the Secret), verified against the chart's CA and the Service's DNS
name.  Every patch is applied with a real RFC 6902 implementation and the
patched pod validated for the supported Kubernetes versions.

Why each check exists: the API server admits whatever the webhook fails to
answer (C{failurePolicy: Ignore}), so a webhook that crashes, hangs or
buffers without bound turns into pods silently missing the broker, or into a
webhook that is gone for everyone.  So after each hostile request (not
JSON, too large by its header or by its chunks, headers trickled byte by
byte, a body that never ends) a normal review is still answered.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate.utils as kubernetes_validate
import pytest
from support import (
    TWISTD,
    WAIT_SECONDS,
    as_user_argv,
    require_root,
    scaled,
    subprocess_env,
    wait_for,
)
from test_chart import RELEASE_NAMESPACE, by_kind, render, sets
from test_deploy import KUBERNETES_VERSIONS, pod_rule_violations

from hostpid.admission.decision import ANNOTATION_KEY, ANNOTATION_VALUE

#: The name the API server checks the certificate against: the Service, in the
#: namespace the chart is installed into.
SERVICE_NAME = f"hostpid-webhook.{RELEASE_NAMESPACE}.svc"
#: The request deadline the test webhooks run with: short, so that a
#: slowloris is cut within the test, long enough for a loaded CI machine.
REQUEST_TIMEOUT = scaled(2.0)
MAX_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The chart's own generated CA, certificate and key (webhook.enabled=true)."""
    secret = by_kind(render(sets("webhook.enabled=true")), "Secret")
    directory = tmp_path_factory.mktemp("tls")
    files = {}
    for name in ("ca.crt", "tls.crt", "tls.key"):
        path = directory / name
        path.write_bytes(base64.b64decode(secret["data"][name]))
        files[name] = path
    return files


class Webhook:
    """A real C{twistd hostpid-webhook} on a TLS port of its own."""

    def __init__(self, tls: dict[str, Path], mode: str, gate: str,
                 argv: list[str] | None = None, timeout: float = REQUEST_TIMEOUT) -> None:
        self.tls = tls
        env = subprocess_env(LIBVGPU_HOSTPID_BROKER=gate)
        self._log = tempfile.TemporaryFile()
        if argv is None:
            argv = [*TWISTD, "--nodaemon", "--pidfile=", "hostpid-webhook",
                    "--endpoint", f"ssl:0:interface=127.0.0.1:privateKey={tls['tls.key']}"
                                  f":certKey={tls['tls.crt']}",
                    "--mode", mode, "--resource", "nvidia.com/gpu",
                    "--request-timeout", str(timeout)]
        self.process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir())
        found = wait_for(self._port, "the webhook's listening line")
        self.port = int(found)  # type: ignore[call-overload]

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def _port(self) -> str | None:
        if self.process.poll() is not None:
            raise AssertionError(f"the webhook exited {self.process.returncode}:\n"
                                 + self.output())
        match = re.search(r"hostpid-webhook: listening on port (\d+)", self.output())
        return match.group(1) if match else None

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.tls["ca.crt"]))
        return context

    def tls_socket(self) -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_SECONDS)
        return self.context().wrap_socket(raw, server_hostname=SERVICE_NAME)

    def connection(self) -> http.client.HTTPSConnection:
        """An HTTPS connection verified against the chart's CA as the Service's name."""
        connection = http.client.HTTPSConnection(SERVICE_NAME, self.port, timeout=WAIT_SECONDS,
                                                 context=self.context())
        connection.sock = self.tls_socket()
        return connection

    def post(self, body: bytes, connection: http.client.HTTPSConnection | None = None
             ) -> tuple[int, bytes]:
        own = connection is None
        connection = connection or self.connection()
        try:
            connection.request("POST", "/mutate", body,
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            if own:
                connection.close()

    def review(self, pod: dict[str, Any],
               connection: http.client.HTTPSConnection | None = None) -> dict[str, Any]:
        uid = str(uuid.uuid4())
        status, data = self.post(json.dumps(admission_review(pod, uid)).encode(), connection)
        assert status == 200, data
        answer = json.loads(data)
        assert answer["apiVersion"] == "admission.k8s.io/v1"
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == uid
        assert answer["response"]["allowed"] is True
        return answer["response"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def admission_review(pod: dict[str, Any], uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team", "operation": "CREATE", "object": pod,
            "userInfo": {"username": "system:serviceaccount:team:deployer"},
        },
    }


@pytest.fixture(scope="module")
def webhooks(tls: dict[str, Path]) -> Iterator[dict[str, Webhook]]:
    started: dict[str, Webhook] = {}
    try:
        for name, mode, gate in (("cdi", "cdi", "1"), ("mounts", "mounts", "1"),
                                 ("gate off", "mounts", "0"), ("gate not 1", "cdi", "true")):
            started[name] = Webhook(tls, mode, gate)
        yield started
    finally:
        for webhook in started.values():
            webhook.stop()


def gpu(name: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "image": "cuda:12", "resources": {"limits": {"nvidia.com/gpu": "1"}},
            **more}


def plain(name: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "image": "nginx:1", **more}


def pod(*containers: dict[str, Any], init: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None,
        volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"generateName": "job-", "namespace": "team"}
    if annotations is not None:
        metadata["annotations"] = annotations
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = init
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


HAMI_POD = pod(
    gpu("cuda", env=[{"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"}],
        volumeMounts=[{"name": "lock", "mountPath": "/tmp/vgpulock"},
                      {"name": "hostpid", "mountPath": "/tmp/vgpulock/hostpid",
                       "readOnly": True}]),
    volumes=[{"name": "lock", "hostPath": {"path": "/tmp/vgpulock"}},
             {"name": "hostpid", "hostPath": {"path": "/var/run/hami/hostpid"}}])

PODS: dict[str, dict[str, Any]] = {
    "GPU pod": pod(gpu("cuda")),
    "several containers": pod(gpu("a"), plain("sidecar"), gpu("b")),
    "init containers": pod(plain("main"), init=[gpu("warmup"), plain("fetch")]),
    "HAMi's own env and mounts": HAMI_POD,
    "non-GPU pod": pod(plain("web")),
    "non-GPU pod with the annotation": pod(plain("web"),
                                           annotations={ANNOTATION_KEY: ANNOTATION_VALUE}),
    "shadowing volume": pod(gpu("cuda", volumeMounts=[{"name": "scratch",
                                                       "mountPath": "/tmp/vgpulock"}]),
                            volumes=[{"name": "scratch", "emptyDir": {}}]),
}

#: case -> {webhook: (annotated, containers with the broker mounts)}
EXPECTED: dict[str, dict[str, tuple[bool, int]]] = {
    "GPU pod": {"cdi": (True, 0), "mounts": (False, 1)},
    "several containers": {"cdi": (True, 0), "mounts": (False, 2)},
    "init containers": {"cdi": (True, 0), "mounts": (False, 1)},
    "HAMi's own env and mounts": {"cdi": (True, 1), "mounts": (False, 1)},
    "non-GPU pod": {"cdi": (False, 0), "mounts": (False, 0)},
    "non-GPU pod with the annotation": {"cdi": (False, 0), "mounts": (False, 0)},
    "shadowing volume": {"cdi": (False, 0), "mounts": (False, 0)},
}


def patched(original: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    if "patch" not in response:
        assert "patchType" not in response
        return original
    assert response["patchType"] == "JSONPatch"
    operations = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(original, operations)


def with_broker(result: dict[str, Any]) -> int:
    count = 0
    for field in ("initContainers", "containers"):
        for container in result["spec"].get(field, []):
            paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
            if "/tmp/vgpulock/hostpid" in paths:
                assert {"name": "LIBVGPU_HOSTPID_BROKER", "value": "1"} in container["env"]
                count += 1
    return count


def valid(result: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(result, version, strict=True)
    assert pod_rule_violations(result["spec"], "patched") == []


@pytest.mark.parametrize("mode", ["cdi", "mounts"])
@pytest.mark.parametrize("case", sorted(PODS))
def test_review_round_trip(webhooks: dict[str, Webhook], case: str, mode: str) -> None:
    original = PODS[case]
    response = webhooks[mode].review(original)
    result = patched(original, response)
    valid(result)
    annotated = result["metadata"].get("annotations", {}).get(ANNOTATION_KEY) == ANNOTATION_VALUE
    assert (annotated, with_broker(result)) == EXPECTED[case][mode], response
    if case == "shadowing volume":
        assert "'scratch'" in response["warnings"][0]
    if case == "non-GPU pod with the annotation":
        assert ANNOTATION_KEY in response["warnings"][0]
    # Reinvocation (reinvocationPolicy: IfNeeded) changes nothing more.
    assert "patch" not in webhooks[mode].review(result)


def test_reinvoked_after_a_later_webhook_added_sys_admin_it_removes_the_broker(
        webhooks: dict[str, Webhook]) -> None:
    """
    A user-namespaced pod patched in mode mounts; a later webhook adds
    C{SYS_ADMIN} to a sidecar and the API server reinvokes this one: over
    TLS, its answer takes the broker's volumes, mounts and gate away again,
    and the result is what the later webhook left, a valid pod.
    """
    original = pod(gpu("cuda"), plain("sidecar"))
    original["spec"]["hostUsers"] = False
    first = patched(original, webhooks["mounts"].review(original))
    assert with_broker(first) == 1
    later = json.loads(json.dumps(first))
    later["spec"]["containers"][1]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    response = webhooks["mounts"].review(later)
    result = patched(later, response)
    valid(result)
    assert with_broker(result) == 0
    assert result["spec"]["volumes"] == []
    assert response["warnings"][0].startswith("hostpid broker removed: ")
    assert result["spec"]["containers"][1] == later["spec"]["containers"][1]
    assert result["spec"]["containers"][0]["volumeMounts"] == []
    assert result["spec"]["containers"][0]["env"] == []


@pytest.mark.parametrize("webhook", ["gate off", "gate not 1"])
def test_gate_off_patches_nothing_but_removes_the_annotation(
        webhooks: dict[str, Webhook], webhook: str) -> None:
    for case in ("GPU pod", "several containers", "init containers"):
        assert "patch" not in webhooks[webhook].review(PODS[case])
    annotated = pod(gpu("cuda"), annotations={ANNOTATION_KEY: ANNOTATION_VALUE, "keep": "x"})
    result = patched(annotated, webhooks[webhook].review(annotated))
    assert result["metadata"]["annotations"] == {"keep": "x"}


def test_a_kept_alive_connection_serves_many_reviews(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["cdi"]
    connection = webhook.connection()
    try:
        for _ in range(20):
            assert "patch" in webhook.review(PODS["GPU pod"], connection)
    finally:
        connection.close()


def still_answered(webhook: Webhook) -> None:
    response = webhook.review(PODS["GPU pod"])
    assert "patch" in response


def test_not_an_admission_review(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["mounts"]
    for body in (b"{not json", b"[]", b'{"request": {}}', b"\xff\xfe", b"[" * 100_000):
        status, data = webhook.post(body)
        assert status == 400 and len(data) < 200, (body[:20], data)
        still_answered(webhook)


def test_a_review_of_something_else_is_allowed_unpatched(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["mounts"]
    other = admission_review(PODS["GPU pod"], "u-1")
    other["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
    old = admission_review(PODS["GPU pod"], "u-2") | {"apiVersion": "admission.k8s.io/v1beta1"}
    for review, uid in ((other, "u-1"), (old, "u-2")):
        status, data = webhook.post(json.dumps(review).encode())
        response = json.loads(data)["response"]
        assert status == 200 and response["uid"] == uid and response["allowed"] is True
        assert "patch" not in response
    still_answered(webhook)


def raw_exchange(webhook: Webhook, data: bytes) -> bytes:
    with webhook.tls_socket() as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_an_oversized_body_is_refused_by_its_length_unread(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["cdi"]
    head = (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    answer = raw_exchange(webhook, head)
    assert answer.startswith(b"HTTP/1.1 413 ")
    still_answered(webhook)


def test_a_refused_request_is_closed_with_its_answer(webhooks: dict[str, Webhook]) -> None:
    """
    A 413 says C{Connection: close}, and over TLS the server closes right
    after it: a refusal that left the channel registered as the TLS
    transport's producer kept the connection (and its slot) until the client
    left or the request deadline fired.
    """
    webhook = webhooks["cdi"]
    head = (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    with webhook.tls_socket() as sock:
        sock.sendall(head)
        sock.settimeout(WAIT_SECONDS)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
        waited = closed_within(sock, REQUEST_TIMEOUT * 0.9)
    assert waited < REQUEST_TIMEOUT * 0.9, waited
    still_answered(webhook)


def test_an_oversized_chunked_body_is_cut_at_the_cap(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["cdi"]
    with webhook.tls_socket() as sock:
        sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        sent = 0
        answer = b""
        while sent < 4 * MAX_BODY:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                break
            sent += len(chunk)
        sock.settimeout(WAIT_SECONDS)
        try:
            answer = sock.recv(4096)
        except (ConnectionResetError, ssl.SSLError):
            pass
        assert answer.startswith(b"HTTP/1.1 413 "), (sent, answer[:80])
    still_answered(webhook)


def closed_within(sock: ssl.SSLSocket, bound: float) -> float:
    """Seconds until the server closes C{sock} (fails past C{bound})."""
    started = time.monotonic()
    sock.settimeout(bound)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, ssl.SSLError):
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {bound} s") from None
    return time.monotonic() - started


def test_a_slowloris_is_cut_at_the_request_deadline(webhooks: dict[str, Webhook]) -> None:
    """
    Headers one byte at a time, each well inside any idle timeout: the
    deadline counts from the connection, not from the last byte.  A normal
    review is answered while it trickles, and after.
    """
    webhook = webhooks["mounts"]
    sock = webhook.tls_socket()
    started = time.monotonic()
    request = b"POST /mutate HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    cut = False
    try:
        for index, byte in enumerate(request):
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                cut = True
                break
            if index == 3:
                still_answered(webhook)
            time.sleep(0.05)
            if time.monotonic() - started > REQUEST_TIMEOUT + scaled(5.0):
                break
        if not cut:
            closed_within(sock, scaled(5.0))
        elapsed = time.monotonic() - started
        assert REQUEST_TIMEOUT * 0.9 <= elapsed < REQUEST_TIMEOUT + scaled(5.0), elapsed
    finally:
        sock.close()
    still_answered(webhook)


def test_a_body_that_never_ends_is_cut_at_the_request_deadline(
        webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["cdi"]
    sock = webhook.tls_socket()
    try:
        sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{\"a\"")
        still_answered(webhook)
        waited = closed_within(sock, REQUEST_TIMEOUT + scaled(5.0))
        assert waited <= REQUEST_TIMEOUT + scaled(5.0)
    finally:
        sock.close()
    still_answered(webhook)


def test_health_ready_and_metrics(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["gate off"]
    for path, expected in (("/healthz", b"ok"), ("/readyz", b"ready: mode mounts, gate off")):
        connection = webhook.connection()
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200 and response.read().startswith(expected)
        connection.close()
    webhook.review(PODS["GPU pod"])
    connection = webhook.connection()
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    assert re.search(r'^hostpid_webhook_reviews_total\{outcome="gate_off"\} [1-9]', text, re.M)
    assert "hostpid_webhook_review_seconds_bucket" in text
    assert "python_gc" not in text, "a registry of its own"


def test_a_tls_handshake_that_never_completes_is_cut(webhooks: dict[str, Webhook]) -> None:
    """The deadline starts at the TCP connection: no TLS bytes, or half a ClientHello."""
    webhook = webhooks["cdi"]
    for first_bytes in (b"", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
        with socket.create_connection(("127.0.0.1", webhook.port)) as raw:
            raw.sendall(first_bytes)
            started = time.monotonic()
            raw.settimeout(REQUEST_TIMEOUT + scaled(5.0))
            try:
                while raw.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < REQUEST_TIMEOUT + scaled(5.0)
        still_answered(webhook)


@pytest.mark.parametrize("args, message", [
    (["--mode", "sidecar"], "--mode must be one of cdi, mounts, not 'sidecar'"),
    (["--resource", "gpu"], "--resource 'gpu': an extended resource name (DOMAIN/NAME)"),
    (["--request-timeout", "0"], "--request-timeout must be a number of seconds from 0 to 60"),
    (["--device-class", "Not_A_Class"], "--device-class 'Not_A_Class': a DeviceClass name"),
    (["--claim-lookup-timeout", "31"],
     "--claim-lookup-timeout must be a number of seconds from 0 to 30"),
    (["--endpoint", "nonsense:1"], "--endpoint 'nonsense:1': not a Twisted server endpoint"),
    ([], "--endpoint is required"),
])
def test_a_bad_option_refuses_to_start(args: list[str], message: str) -> None:
    argv = [*TWISTD, "--nodaemon", "--pidfile=", "hostpid-webhook"]
    if "--endpoint" not in args and args:
        argv += ["--endpoint", "tcp:0:interface=127.0.0.1"]
    done = subprocess.run([*argv, *args], env=subprocess_env(), capture_output=True, text=True,
                          timeout=WAIT_SECONDS * 4, cwd=tempfile.gettempdir(), check=False)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr


def test_the_charts_webhook_container_serves_as_rendered(tls: dict[str, Path]) -> None:
    """
    The Deployment's own command, arguments and gate (mode mounts, gate on),
    run as its non-root UID with no capability beyond reading the test's
    files: the port and the Secret's mount path are the only changes.
    """
    require_root()
    docs = render(sets("webhook.enabled=true", "webhook.mode=mounts", "webhook.gate=true",
                       "hostPIDBroker.enabled=true"))
    spec = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    ((mount,),) = [container["volumeMounts"]]
    uid = spec["securityContext"]["runAsUser"]
    assert container["command"][0] == "twistd"
    argv = [*TWISTD, *container["command"][1:], *container["args"]]
    where = f"{mount['mountPath']}/"
    port = f"ssl:{container['ports'][0]['containerPort']}:"
    here = f"{tls['tls.key'].parent}/"
    argv = [a.replace(port, "ssl:0:interface=127.0.0.1:").replace(where, here) for a in argv]
    (gate,) = [e["value"] for e in container["env"] if e["name"] == "LIBVGPU_HOSTPID_BROKER"]
    webhook = Webhook(tls, "mounts", gate, as_user_argv(uid, argv))
    try:
        status = Path(f"/proc/{webhook.process.pid}/status").read_text()
        assert re.search(rf"^Uid:\s+{uid}\s+{uid}\s", status, re.M), status
        result = patched(PODS["several containers"], webhook.review(PODS["several containers"]))
        assert with_broker(result) == 2
        valid(result)
    finally:
        webhook.stop()
