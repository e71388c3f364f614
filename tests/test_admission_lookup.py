"""
The webhook's reads of claim objects (L{hostpid.admission.claims}) against
a real HTTP server on loopback (twisted.web on the real reactor), with a
L{Clock} for the deadlines so that no test waits on wall time.

What each proves: a pod whose claim template names a listed device class is
patched, one naming another class is not, and one whose template cannot be
read (404, 403, no answer in time, a body past the cap) is admitted by its
resources alone with a warning and a counted outcome; a read past the
deadline or the cap aborts its connection (the server sees it go) instead
of waiting or buffering; at most C{max_in_flight} reads reach the server at
once, C{max_waiting} more wait, and the rest are not made; the reviews held
for their reads are bounded in number and size; in-cluster credentials
verify the API server's IP against the mounted CA alone.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted  # type: ignore[import-untyped]
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.web import server
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest

from hostpid.admission import claims
from hostpid.admission.claims import ClaimLookup, InClusterCredentials, StaticCredentials
from hostpid.admission.decision import ClaimSource, Config
from hostpid.admission.service import MutateResource, WebhookMetrics

GPU_CLASS = "gpu.example.com"
NAMESPACE = "team"
TOKEN = b"a-service-account-token"


def template(device_class: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": NAMESPACE},
            "spec": {"spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": device_class}}]}}}}


class FakeAPIServer(Resource):
    """
    C{GET /apis/resource.k8s.io/v1/namespaces/NS/KIND/NAME}, answered by
    NAME: C{gpu-*} a template of L{GPU_CLASS}, C{other} of another class,
    C{forbidden} 403, C{hang-*} never (held in L{held}), C{huge-length} a
    C{Content-Length} of 10 MB, C{huge-stream} 2 KiB of a body that never
    ends; anything else 404.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[bytes, bytes | None]] = []
        self.held: list[server.Request] = []
        self.lost: list[bytes] = []
        self.in_flight = 0
        self.most_in_flight = 0

    def render_GET(self, request: server.Request) -> bytes | int:
        assert request.path is not None
        self.requests.append((request.path, request.getHeader(b"authorization")))
        name = request.path.rsplit(b"/", 1)[-1].decode()
        request.setHeader(b"content-type", b"application/json")
        if name.startswith("gpu") or name == "other":
            return json.dumps(template(GPU_CLASS if name != "other" else "cpu.example.com")
                              ).encode()
        if name == "forbidden":
            request.setResponseCode(403)
            return b'{"kind":"Status","code":403}'
        if name.startswith("hang") or name.startswith("huge"):
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.held.append(request)

            def gone(_: object, path: bytes = request.path) -> None:
                self.in_flight -= 1
                self.lost.append(path)

            request.notifyFinish().addErrback(gone)
            if name == "huge-length":
                request.setHeader(b"content-length", b"%d" % (10 * 1024 * 1024,))
                request.write(b"{" + b" " * 2047)
            elif name == "huge-stream":
                request.write(b"{" + b" " * 2047)
            return server.NOT_DONE_YET
        request.setResponseCode(404)
        return b'{"kind":"Status","code":404}'

    def answer(self, request: server.Request) -> None:
        self.in_flight -= 1
        request.write(json.dumps(template(GPU_CLASS)).encode())
        request.finish()


@pytest.fixture
def api() -> Iterator[tuple[FakeAPIServer, str]]:
    from twisted.internet import reactor

    resource = FakeAPIServer()
    site = server.Site(resource)
    site.noisy = False
    port = reactor.listenTCP(0, site, interface="127.0.0.1")  # type: ignore[arg-type]
    try:
        yield resource, f"http://127.0.0.1:{port.getHost().port}"  # type: ignore[attr-defined]
    finally:
        for request in resource.held:
            if not request.finished and not request._disconnected:
                request.loseConnection()
        pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


def make_lookup(url: str, **kwargs: Any) -> tuple[ClaimLookup, Clock, list[str]]:
    from twisted.internet import reactor

    clock = Clock()
    seen: list[str] = []
    lookup = ClaimLookup(StaticCredentials(url, token=TOKEN), reactor, clock=clock,
                         observe=lambda outcome, seconds: seen.append(outcome), **kwargs)
    return lookup, clock, seen


async def close(lookup: ClaimLookup) -> None:
    await lookup.agent()._pool.closeCachedConnections()


async def settle(condition: Any) -> None:
    """Turn the real reactor until C{condition()} holds (loopback I/O only, bounded)."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    for _ in range(2000):
        if condition():
            return
        await deferLater(reactor, 0.001, lambda: None)
    raise AssertionError("the loopback exchange did not complete")


def source(name: str, kind: str = "ResourceClaimTemplate") -> ClaimSource:
    return ClaimSource("gpu", kind, name)


@pytest_twisted.ensureDeferred
async def test_found_with_the_token_and_the_right_path(api: tuple[FakeAPIServer, str]) -> None:
    fake, url = api
    lookup, _, seen = make_lookup(url)
    found = await lookup.lookup(NAMESPACE, source("gpu-a"))
    claim = await lookup.lookup(NAMESPACE, source("gpu-b", "ResourceClaim"))
    assert (found.outcome, found.classes) == ("found", (frozenset({GPU_CLASS}),))
    assert claim.outcome == "found"
    assert fake.requests == [
        (b"/apis/resource.k8s.io/v1/namespaces/team/resourceclaimtemplates/gpu-a",
         b"Bearer " + TOKEN),
        (b"/apis/resource.k8s.io/v1/namespaces/team/resourceclaims/gpu-b", b"Bearer " + TOKEN)]
    assert seen == ["found", "found"]
    await close(lookup)


@pytest_twisted.ensureDeferred
async def test_absent_forbidden_and_invalid_names(api: tuple[FakeAPIServer, str]) -> None:
    fake, url = api
    lookup, _, seen = make_lookup(url)
    results = await lookup.lookup_all(NAMESPACE, [
        source("missing"), source("forbidden"), source("../../secrets/x"),
        source("Upper")])
    assert [r.outcome for r in results] == ["not_found", "forbidden", "invalid", "invalid"]
    # A name that is not a Kubernetes name never reaches a URL.
    assert len(fake.requests) == 2
    assert sorted(seen) == sorted(["not_found", "forbidden", "invalid", "invalid"])
    await close(lookup)


@pytest_twisted.ensureDeferred
async def test_no_answer_is_cancelled_at_the_deadline(api: tuple[FakeAPIServer, str]) -> None:
    fake, url = api
    lookup, clock, seen = make_lookup(url, timeout=2.0)
    read = lookup.lookup(NAMESPACE, source("hang-1"))
    await settle(lambda: len(fake.held) == 1)
    assert not read.called
    clock.advance(1.9)
    assert not read.called
    clock.advance(0.2)
    result = await read
    assert (result.outcome, result.classes) == ("timeout", ())
    # The connection is aborted, not left to the server.
    await settle(lambda: fake.lost == [fake.held[0].path])
    assert seen == ["timeout"] and clock.getDelayedCalls() == []
    await close(lookup)


@pytest.mark.parametrize("name", ["huge-length", "huge-stream"])
@pytest_twisted.ensureDeferred
async def test_a_body_past_the_cap_is_not_read(api: tuple[FakeAPIServer, str], name: str) -> None:
    """Before the cap, a body that never ended held its read till the deadline; now: at once."""
    fake, url = api
    lookup, clock, seen = make_lookup(url, max_body=1024)
    result = await lookup.lookup(NAMESPACE, source(name))
    assert result.outcome == "too_large", result
    await settle(lambda: len(fake.lost) == 1)
    assert seen == ["too_large"] and clock.getDelayedCalls() == []
    await close(lookup)


@pytest_twisted.ensureDeferred
async def test_reads_at_once_and_waiting_are_capped(api: tuple[FakeAPIServer, str]) -> None:
    fake, url = api
    lookup, clock, seen = make_lookup(url, max_in_flight=2, max_waiting=2)
    reads = [lookup.lookup(NAMESPACE, source(f"hang-{n}")) for n in range(5)]
    # The fifth finds two in flight and two waiting: it is not made.
    assert reads[4].called and reads[4].result.outcome == "busy"  # type: ignore[attr-defined]
    await settle(lambda: len(fake.held) == 2)
    assert fake.in_flight == 2 and not any(r.called for r in reads[:4])
    for request in fake.held[:2]:
        fake.answer(request)
    await settle(lambda: len(fake.held) == 4)
    for request in fake.held[2:]:
        fake.answer(request)
    results = [await r for r in reads]
    assert [r.outcome for r in results] == ["found"] * 4 + ["busy"]
    assert fake.most_in_flight == 2
    assert sorted(seen) == sorted(["found"] * 4 + ["busy"])
    await close(lookup)


@pytest_twisted.ensureDeferred
async def test_waiting_counts_against_the_deadline(api: tuple[FakeAPIServer, str]) -> None:
    """A read waiting for a slot is given up at its deadline, and never made after it."""
    fake, url = api
    lookup, clock, _ = make_lookup(url, max_in_flight=1, timeout=2.0)
    first = lookup.lookup(NAMESPACE, source("hang-1"))
    second = lookup.lookup(NAMESPACE, source("gpu-late"))
    await settle(lambda: len(fake.held) == 1)
    clock.advance(2.1)
    assert [(await first).outcome, (await second).outcome] == ["timeout", "timeout"]
    await settle(lambda: len(fake.lost) == 1)
    assert [path for path, _ in fake.requests] == [fake.held[0].path]
    await close(lookup)


def test_in_cluster_credentials(tmp_path: Any) -> None:
    (tmp_path / "token").write_bytes(b"tok\n")
    credentials = InClusterCredentials(tmp_path, {"KUBERNETES_SERVICE_HOST": "fd00::1",
                                                  "KUBERNETES_SERVICE_PORT": "443"})
    assert credentials.server() == "https://[fd00::1]:443"
    assert credentials.authorization() == b"Bearer tok"
    (tmp_path / "token").write_bytes(b"rotated")
    assert credentials.authorization() == b"Bearer rotated"
    (tmp_path / "token").unlink()
    with pytest.raises(claims.CredentialsUnavailable):
        credentials.authorization()
    with pytest.raises(claims.CredentialsUnavailable):
        InClusterCredentials(tmp_path, {}).server()


def review(claim_template: str, gpu_limit: bool = False) -> bytes:
    container: dict[str, Any] = {"name": "c", "image": "x",
                                 "resources": {"claims": [{"name": "gpu"}]}}
    if gpu_limit:
        container["resources"]["limits"] = {"nvidia.com/gpu": "1"}
    return json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "operation": "CREATE", "namespace": NAMESPACE,
                    "object": {"metadata": {"name": "p"}, "spec": {
                        "resourceClaims": [{"name": "gpu",
                                            "resourceClaimTemplateName": claim_template}],
                        "containers": [container]}}}}).encode()


async def mutate(resource: MutateResource, body: bytes) -> dict[str, Any]:
    request = DummyRequest([b"mutate"])
    request.method = b"POST"
    request.content = io.BytesIO(body)  # type: ignore[attr-defined]
    rendered = resource.render(request)
    if rendered == server.NOT_DONE_YET:
        if not request.finished:
            await request.notifyFinish()
    else:
        request.write(rendered)
    response: dict[str, Any] = json.loads(b"".join(request.written))["response"]
    return response


def patched_paths(response: dict[str, Any]) -> list[str]:
    if "patch" not in response:
        return []
    return [op["path"] for op in json.loads(base64.b64decode(response["patch"]))]


@pytest_twisted.ensureDeferred
async def test_the_webhook_qualifies_by_the_claims_device_class(
        api: tuple[FakeAPIServer, str]) -> None:
    fake, url = api
    lookup, _, _ = make_lookup(url)
    metrics = WebhookMetrics()
    lookup.observe = metrics.observe_lookup
    config = Config(mode="mounts", gate=True, device_classes=(GPU_CLASS,))
    resource = MutateResource(config, metrics, lookup=lookup)

    gpu = await mutate(resource, review("gpu-whole"))
    assert gpu["allowed"] is True
    assert "/spec/volumes" in patched_paths(gpu), gpu

    other = await mutate(resource, review("other"))
    assert other["allowed"] is True and "patch" not in other and "warnings" not in other

    missing = await mutate(resource, review("missing"))
    assert missing["allowed"] is True and "patch" not in missing
    assert "not_found" in missing["warnings"][0], missing

    # A container that qualifies by its resources needs no read.
    before = len(fake.requests)
    assert patched_paths(await mutate(resource, review("missing", gpu_limit=True)))
    assert len(fake.requests) == before

    def count(outcome: str) -> float:
        return metrics.registry.get_sample_value(
            "hostpid_webhook_claim_lookups_total", {"outcome": outcome}) or 0.0
    assert (count("found"), count("not_found")) == (2, 1)
    assert metrics.registry.get_sample_value("hostpid_webhook_claim_lookup_seconds_count") == 3

    # Without device classes no read is made: today's behaviour.
    plain = MutateResource(Config(mode="mounts", gate=True), metrics, lookup=lookup)
    assert "patch" not in await mutate(plain, review("gpu-whole"))
    assert len(fake.requests) == before
    await close(lookup)


@pytest_twisted.ensureDeferred
async def test_the_webhook_answers_within_the_deadline(api: tuple[FakeAPIServer, str]) -> None:
    """An API server that never answers delays the review by the deadline, then admits it."""
    fake, url = api
    lookup, clock, _ = make_lookup(url, timeout=2.0)
    resource = MutateResource(Config(mode="mounts", gate=True, device_classes=(GPU_CLASS,)),
                              WebhookMetrics(), lookup=lookup)
    answered = defer.ensureDeferred(mutate(resource, review("hang-9")))
    await settle(lambda: len(fake.held) == 1)
    assert not answered.called
    clock.advance(2.0)
    response = await answered
    assert response["allowed"] is True and "patch" not in response
    assert "timeout" in response["warnings"][0]
    await close(lookup)


@pytest_twisted.ensureDeferred
async def test_reviews_held_for_reads_are_bounded(api: tuple[FakeAPIServer, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A review waiting for its reads holds its parsed pod: past the cap of
    such reviews, and for a review larger than the reads are made for, the
    pod is decided at once without reads, counted.
    """
    from hostpid.admission import service

    fake, url = api
    monkeypatch.setattr(service, "MAX_WAITING_REVIEWS", 1)
    lookup, clock, seen = make_lookup(url, timeout=2.0)
    resource = MutateResource(Config(mode="mounts", gate=True, device_classes=(GPU_CLASS,)),
                              WebhookMetrics(), lookup=lookup)
    held = defer.ensureDeferred(mutate(resource, review("hang-1")))
    await settle(lambda: len(fake.held) == 1)
    busy = await mutate(resource, review("gpu-whole"))
    assert "patch" not in busy and "busy" in busy["warnings"][0]
    large = json.loads(review("gpu-whole"))
    large["request"]["object"]["metadata"]["annotations"] = {"a": "x" * service.MAX_READ_BODY}
    skipped = await mutate(resource, json.dumps(large).encode())
    assert "patch" not in skipped and "skipped" in skipped["warnings"][0]
    assert len(fake.requests) == 1
    clock.advance(2.0)
    await held
    assert resource.waiting == 0
    assert sorted(seen) == ["busy", "skipped", "timeout"]
    await close(lookup)


@pytest_twisted.ensureDeferred
async def test_no_ca_no_connection(api: tuple[FakeAPIServer, str], tmp_path: Any) -> None:
    """Without the mounted CA a read is never made (no fallback to the system's CAs)."""
    from twisted.internet import reactor

    fake, url = api
    (tmp_path / "token").write_bytes(b"tok")
    host, port = url.removeprefix("http://").split(":")
    credentials = InClusterCredentials(tmp_path, {"KUBERNETES_SERVICE_HOST": host,
                                                  "KUBERNETES_SERVICE_PORT": port})
    lookup = ClaimLookup(credentials, reactor, clock=Clock())
    result = await lookup.lookup(NAMESPACE, source("gpu-a"))
    assert result.outcome == "error" and "no API server CA" in result.detail, result
    assert fake.requests == []
    await close(lookup)


def _pki(directory: Path) -> Any:
    """The cluster tier's certificate authority (C{tests/cluster/pki.py}), imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "hostpid_cluster_pki", Path(__file__).parent / "cluster" / "pki.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Pki(directory)


@pytest_twisted.ensureDeferred
async def test_in_cluster_over_tls(tmp_path: Path) -> None:
    """
    As in a pod: the API server's address as an IP, its certificate naming
    that IP, verified against the mounted CA, the token sent; a server whose
    certificate another CA signed gets no request.
    """
    from twisted.internet import reactor, ssl

    authority = _pki(tmp_path / "pki")
    pair = authority.issue("apiserver", "kube-apiserver", ips=("127.0.0.1",), server=True)
    fake = FakeAPIServer()
    site = server.Site(fake)
    options = ssl.PrivateCertificate.loadPEM(
        pair.cert.read_bytes() + pair.key.read_bytes()).options()
    port = reactor.listenSSL(0, site, options,  # type: ignore[attr-defined]
                             interface="127.0.0.1")
    mounted = tmp_path / "serviceaccount"
    mounted.mkdir()
    (mounted / "token").write_bytes(TOKEN)
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(port.getHost().port)}
    try:
        (mounted / "ca.crt").write_bytes(authority.ca.cert.read_bytes())
        lookup = ClaimLookup(InClusterCredentials(mounted, environ), reactor, clock=Clock())
        found = await lookup.lookup(NAMESPACE, source("gpu-a"))
        assert found.outcome == "found", found
        assert fake.requests[0][1] == b"Bearer " + TOKEN
        await close(lookup)

        other = _pki(tmp_path / "other")
        (mounted / "ca.crt").write_bytes(other.ca.cert.read_bytes())
        lookup = ClaimLookup(InClusterCredentials(mounted, environ), reactor, clock=Clock())
        refused = await lookup.lookup(NAMESPACE, source("gpu-b"))
        assert refused.outcome == "error", refused
        assert len(fake.requests) == 1
        await close(lookup)
    finally:
        await port.stopListening()
