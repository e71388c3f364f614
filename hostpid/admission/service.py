"""
The AdmissionReview server: twisted.web around L{hostpid.admission.decision}.

  - C{POST /mutate}: an C{admission.k8s.io/v1} AdmissionReview in, the
    review's response out: C{allowed: true} always, the decision's JSON Patch
    (base64, C{patchType: JSONPatch}) and warnings.
  - C{/healthz}, C{/readyz}: the reactor answers; ready says the mode and
    the gate.
  - C{/metrics}: reviews per outcome and the decision's latency, claim
    object reads per outcome and their latency, from a registry of this
    server's own.

A pod with ResourceClaims, when the operator listed device classes
(L{Config.device_classes}) and a L{ClaimLookup} is given, is answered once
the templates or claims its containers name are read from the API server
(L{hostpid.admission.claims}: each read bounded in time, concurrency and
size, a failed one leaving the container to its resources); its body is
parsed first and released at once, as any other's.

The webhook never refuses a pod: whatever it is sent, the answer is an
allowed review when a C{uid} can be read, else a short 400.  Its costs are
bounded whatever a client does (L{WebhookChannel}): a body larger than
L{MAX_BODY} is refused from its C{Content-Length}, or as soon as a chunked
body passes it, and is never buffered whole (twisted.web would otherwise
keep any body in memory or a temporary file: C{http.Request.gotLength},
C{_getContentFile}); each request must arrive whole within the site's
timeout of the connection opening or the previous answer, trickling data
not extending it (a slowloris holds a connection for that long at most);
and at most L{MAX_CONNECTIONS} connections are held, a newcomer at the cap
evicting the oldest that has not completed a request; the bodies held at
once are bounded too, with room kept for small ones (L{SMALL_BODY},
L{MAX_LARGE_BUFFERED}).  The answer never grows with what the pod supplies
(L{hostpid.admission.decision}: clipped strings, few warnings, a bounded
patch), and neither does a log line.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram
from twisted.internet import defer
from twisted.internet.interfaces import IAddress
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from hostpid.admission.claims import (
    BUSY,
    FOUND,
    LOOKUP_OUTCOMES,
    SKIPPED,
    ClaimLookup,
    Lookup,
    claim_classes,
    json_object,
)
from hostpid.admission.decision import (
    OUTCOMES,
    ClaimSource,
    Config,
    Decision,
    claim_sources,
    clip,
    container_claims,
    decide,
    requests_resource,
)
from hostpid.boundedhttp import (
    BoundedChannel,
    BoundedSite,
    PrometheusResource,
    internal_error,
    plain_text,
)

#: The largest AdmissionReview accepted, in bytes.  The API server limits a
#: whole object to about 1.5 MiB in etcd, but a Pod spec is a few kilobytes;
#: a larger body is answered 413 without being read.
MAX_BODY = 1024 * 1024
#: Each request must arrive whole within this many seconds (of the
#: connection opening, or of the previous answer on a kept-alive
#: connection).  The API server gives the webhook at most its
#: C{timeoutSeconds} (the chart: 5), so a longer wait serves nobody.
REQUEST_TIMEOUT = 10.0
#: Connections held at once.  A few API servers keep a few connections each.
MAX_CONNECTIONS = 256
#: The first bytes of every request body, held from a share each connection
#: has of its own: MAX_CONNECTIONS of them (16 MiB) are always room, so a
#: review of an ordinary pod (a few kilobytes) is never refused for want of
#: memory, whatever other connections hold.
SMALL_BODY = 32 * 1024
#: Body bytes past each request's first SMALL_BODY, held at once over every
#: connection.  Without a bound MAX_CONNECTIONS slow clients each stopping
#: just short of MAX_BODY would hold 256 MiB, past the chart's memory limit
#: (128 MiB); with one bound for every byte (32 MiB, as it was), 40 such
#: clients made the webhook answer 503 to most normal reviews.  A chunk that
#: would pass this is answered 503 and its connection closed: only pods of
#: more than 64 KiB can be kept waiting by such clients.
MAX_LARGE_BUFFERED = 8 * 1024 * 1024
#: Every body byte that can be held at once.
MAX_BUFFERED = MAX_CONNECTIONS * SMALL_BODY + MAX_LARGE_BUFFERED
#: The longest C{request.uid} answered (it is echoed back): the API server's
#: are UUIDs, 36 characters.
MAX_UID = 128
#: Latency buckets of the decision, in seconds.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0,
                   2.5, 5.0)
#: Latency buckets of one claim object read, in seconds.
LOOKUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Outcomes beyond the decision's own: reviews answered without a decision.
INVALID = "invalid"
NOT_POD = "not_pod"
REQUEST_OUTCOMES = (*OUTCOMES, INVALID, NOT_POD)

API_VERSION = "admission.k8s.io/v1"

#: Reviews whose claim objects are read, waiting at once, at most; past it
#: a review is decided without reads (each counted C{busy}).  Each holds
#: its parsed pod until its reads are done (at most the read deadline).
MAX_WAITING_REVIEWS = 32
#: The largest review whose claim objects are read (a pod of a few
#: containers is a few kilobytes): what the waiting reviews hold stays
#: under MAX_WAITING_REVIEWS times this, parsed.  A larger one is decided
#: without reads (C{skipped}).
MAX_READ_BODY = 64 * 1024


class WebhookMetrics:
    """This server's own registry: nothing else in the process appears in it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reviews = Counter(
            "hostpid_webhook_reviews", "AdmissionReviews answered, per outcome.",
            ["outcome"], registry=self.registry)
        for outcome in REQUEST_OUTCOMES:
            self.reviews.labels(outcome)
        self.latency = Histogram(
            "hostpid_webhook_review_seconds",
            "Time from a whole request body to its answer (decode, claim reads, decide, "
            "encode).",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.claim_lookups = Counter(
            "hostpid_webhook_claim_lookups",
            "ResourceClaimTemplates and ResourceClaims read from the API server (with "
            "--device-class), per outcome.",
            ["outcome"], registry=self.registry)
        for outcome in LOOKUP_OUTCOMES:
            self.claim_lookups.labels(outcome)
        self.claim_lookup_latency = Histogram(
            "hostpid_webhook_claim_lookup_seconds",
            "Time of one claim object read, whatever its outcome.",
            buckets=LOOKUP_BUCKETS, registry=self.registry)
        self.refused = Counter(
            "hostpid_webhook_refused_requests",
            "Requests answered without a review: too_large (413), busy (503: every body "
            "byte the server holds at once in use), timed_out, evicted, bad_request (400), "
            "method (405).",
            ["reason"], registry=self.registry)
        for reason in ("too_large", "busy", "timed_out", "evicted", "bad_request", "method"):
            self.refused.labels(reason)

    def observe_lookup(self, outcome: str, seconds: float) -> None:
        """One claim object read (L{ClaimLookup.observe})."""
        self.claim_lookups.labels(outcome).inc()
        self.claim_lookup_latency.observe(seconds)


class _BadReview(ValueError):
    """A body that is no AdmissionReview; the message is the 400's text."""


def _allowed(uid: str, decision: Decision | None = None,
             warnings: tuple[str, ...] = ()) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if decision is not None and decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(
            json.dumps(list(decision.patch), separators=(",", ":")).encode()).decode("ascii")
    all_warnings = (*(decision.warnings if decision else ()), *warnings)
    if all_warnings:
        response["warnings"] = list(all_warnings)
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


@attrs.frozen
class ParsedReview:
    """
    A request body read: the C{uid}, and either the answer already known
    (C{answer}, C{outcome}: not a Pod CREATE, not a v1 review) or the pod to
    decide on, its namespace (the review's: a pod being created may have
    none in its metadata) and C{namespace/name} for the log.
    """

    uid: str
    pod: dict[str, Any] | None = None
    namespace: str = ""
    who: str = ""
    answer: dict[str, Any] | None = None
    outcome: str = ""


def parse_review(body: bytes) -> ParsedReview:
    """
    @raise _BadReview: no C{uid} can be read, so there is nothing to answer.
    """
    try:
        document = json_object(body)
    except ValueError as e:
        raise _BadReview(f"the body is {e}") from None
    request = document.get("request")
    uid = request.get("uid") if isinstance(request, dict) else None
    if not isinstance(uid, str) or not uid:
        raise _BadReview("no request.uid: not an AdmissionReview")
    if len(uid) > MAX_UID:
        raise _BadReview(f"request.uid is longer than {MAX_UID} characters")
    assert isinstance(request, dict)
    if document.get("apiVersion") != API_VERSION or document.get("kind") != "AdmissionReview":
        return ParsedReview(uid, answer=_allowed(uid, warnings=(
            f"hostpid webhook: expected an {API_VERSION} AdmissionReview; pod not changed",)),
            outcome=INVALID)
    kind = request.get("kind")
    pod = request.get("object")
    if (not isinstance(kind, dict) or kind.get("kind") != "Pod" or kind.get("group", "") != ""
            or not isinstance(pod, dict) or request.get("operation", "CREATE") != "CREATE"):
        return ParsedReview(uid, answer=_allowed(uid), outcome=NOT_POD)
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        metadata = {}
    name = request.get("name") or metadata.get("name") or metadata.get("generateName") or ""
    namespace = request.get("namespace") or metadata.get("namespace") or ""
    namespace = namespace if isinstance(namespace, str) else ""
    return ParsedReview(uid, pod, namespace, f"{clip(namespace)}/{clip(name)}")


def answer(parsed: ParsedReview, config: Config,
           claim_classes: Mapping[str, tuple[frozenset[str], ...]] | None = None,
           warnings: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """The answer to a parsed review and its outcome label."""
    if parsed.answer is not None:
        return parsed.answer, parsed.outcome
    assert parsed.pod is not None
    decision = decide(parsed.pod, config, claim_classes)
    return _allowed(parsed.uid, decision, warnings), decision.outcome


def review(body: bytes, config: Config) -> tuple[dict[str, Any], str, str]:
    """
    The answer to one request body (no claim lookups), its outcome label,
    and the pod's C{namespace/name} for the log.

    @raise _BadReview: no C{uid} can be read, so there is nothing to answer.
    """
    parsed = parse_review(body)
    result, outcome = answer(parsed, config)
    return result, outcome, parsed.who


def claims_to_read(pod: Mapping[str, Any], config: Config) -> tuple[ClaimSource, ...]:
    """
    The objects to read for C{pod}: none unless the operator listed device
    classes; else the claims named by containers that do not already
    qualify by their resources (what they would add is already given),
    each object once.
    """
    if not config.device_classes:
        return ()
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return ()
    used: set[str] = set()
    for field in ("initContainers", "containers"):
        containers = spec.get(field)
        for container in containers if isinstance(containers, list) else ():
            if isinstance(container, Mapping) and not requests_resource(
                    container, config.resources):
                used.update(container_claims(container))
    return tuple(s for s in claim_sources(pod) if s.name in used)


class MutateResource(Resource):
    """
    C{POST /mutate}.  A pod whose claims must be read (L{claims_to_read},
    with a L{ClaimLookup}) is answered when the reads are done, each within
    its deadline; any other at once.
    """

    isLeaf = True
    log = Logger()

    def __init__(self, config: Config, metrics: WebhookMetrics,
                 clock: Callable[[], float] = time.perf_counter,
                 lookup: ClaimLookup | None = None) -> None:
        super().__init__()
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.lookup = lookup
        #: Reviews waiting for their claim reads now.
        self.waiting = 0

    def render_POST(self, request: Request) -> bytes | int:
        started = self.clock()
        assert request.content is not None
        body = request.content.getvalue()
        try:
            parsed = parse_review(body)
        except _BadReview as e:
            self.metrics.refused.labels("bad_request").inc()
            return plain_text(request, http.BAD_REQUEST, str(e))
        sources = claims_to_read(parsed.pod, self.config) \
            if parsed.pod is not None and self.lookup is not None else ()
        if not sources:
            return self._finish(request, parsed, started)
        assert self.lookup is not None
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        unique = _unique(sources)
        if len(body) > MAX_READ_BODY:
            reads = defer.succeed(self.lookup.not_made(
                unique, SKIPPED, f"the review is larger than {MAX_READ_BODY} bytes"))
        elif self.waiting >= MAX_WAITING_REVIEWS:
            reads = defer.succeed(self.lookup.not_made(
                unique, BUSY, f"{MAX_WAITING_REVIEWS} reviews already wait for reads"))
        else:
            # The parsed pod is held until its reads are done: the number
            # of reviews doing so, and their size, are bounded.
            self.waiting += 1
            reads = self.lookup.lookup_all(parsed.namespace, unique)
            reads.addBoth(self._done_waiting)

        def decided(lookups: list[Lookup]) -> None:
            by_object = {(x.source.kind, x.source.object_name): x for x in lookups}
            per_claim = [attrs.evolve(by_object[(s.kind, s.object_name)], source=s)
                         for s in sources]
            warnings = self._failures(parsed, per_claim)
            if gone:
                return
            data = self._finish(request, parsed, started, claim_classes(per_claim), warnings)
            request.write(data)
            request.finish()

        reads.addCallback(decided)
        reads.addErrback(self._failed, request, gone)
        return NOT_DONE_YET

    def _done_waiting(self, result: Any) -> Any:
        self.waiting -= 1
        return result

    def _failures(self, parsed: ParsedReview, lookups: list[Lookup]) -> tuple[str, ...]:
        """A log line for each read that gave nothing, and the review's warnings for them."""
        failed = [x for x in lookups if x.outcome != FOUND]
        for x in failed:
            self.log.warn(
                "hostpid-webhook: {kind} {object} (claim {claim}) of pod {pod} not read "
                "({outcome}: {detail}); its containers qualify by their resources only",
                kind=x.source.kind, object=clip(x.source.object_name), claim=clip(x.source.name),
                pod=parsed.who, outcome=x.outcome, detail=x.detail)
        if not failed:
            return ()
        return (f"hostpid webhook: could not read {len(failed)} of the pod's claim objects "
                f"({', '.join(sorted({x.outcome for x in failed}))}); containers naming them "
                "qualify by their resources only",)

    def _failed(self, failure: Failure, request: Request, gone: list[bool]) -> None:
        """Never expected (reads never fail): a plain 500, and the pod is admitted by policy."""
        self.log.failure("hostpid-webhook: answering after claim reads failed", failure)
        if not gone:
            internal_error(request)

    def _finish(self, request: Request, parsed: ParsedReview, started: float,
                claim_classes: Mapping[str, tuple[frozenset[str], ...]] | None = None,
                warnings: tuple[str, ...] = ()) -> bytes:
        result, outcome = answer(parsed, self.config, claim_classes, warnings)
        data = json.dumps(result, separators=(",", ":")).encode()
        self.metrics.reviews.labels(outcome).inc()
        self.metrics.latency.observe(self.clock() - started)
        if outcome not in ("unchanged", "not_qualifying", "not_pod"):
            self.log.info("hostpid-webhook: {outcome} pod {pod}", outcome=outcome,
                          pod=parsed.who, warnings=result["response"].get("warnings", []))
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % (len(data),))
        return data

    def render_GET(self, request: Request) -> bytes:
        self.metrics.refused.labels("method").inc()
        request.setHeader(b"allow", b"POST")
        return plain_text(request, http.NOT_ALLOWED, "POST an AdmissionReview here")


def _unique(sources: tuple[ClaimSource, ...]) -> list[ClaimSource]:
    seen: dict[tuple[str, str], ClaimSource] = {}
    for source in sources:
        seen.setdefault((source.kind, source.object_name), source)
    return list(seen.values())


class _Text(Resource):
    isLeaf = True

    def __init__(self, text: Callable[[], str]) -> None:
        super().__init__()
        self.text = text

    def render_GET(self, request: Request) -> bytes:
        return plain_text(request, http.OK, self.text())


def webhook_resource(config: Config, metrics: WebhookMetrics,
                     lookup: ClaimLookup | None = None) -> Resource:
    """The resource tree: C{/mutate}, C{/healthz}, C{/readyz}, C{/metrics}."""
    root = Resource()
    root.putChild(b"mutate", MutateResource(config, metrics, lookup=lookup))
    root.putChild(b"healthz", _Text(lambda: "ok"))
    gate = "on" if config.gate else "off (patching nothing but the broker annotation's removal)"
    root.putChild(b"readyz", _Text(lambda: f"ready: mode {config.mode}, gate {gate}"))
    root.putChild(b"metrics", PrometheusResource(metrics.registry))
    return root


class WebhookRequest(Request):
    """
    A request whose body is kept in memory up to L{MAX_BODY} and no
    further, and whose failure is a plain 500, never a traceback.
    """

    log = Logger()

    def gotLength(self, length: int | None) -> None:
        # Never a temporary file (twisted.web's choice past 100 kB): the
        # channel has already refused anything over the cap.
        self.content = io.BytesIO()

    _counted = 0

    def handleContentChunk(self, data: bytes) -> None:
        assert self.content is not None
        channel = self.channel
        if not isinstance(channel, WebhookChannel):
            return
        held = self.content.tell()
        if held + len(data) > MAX_BODY:
            channel.refuse(413, channel.tooLargeText)
            return
        site = channel.site
        # Bytes past SMALL_BODY come from the pool shared by every
        # connection; those before it from the connection's own share.
        large = max(0, held + len(data) - site.smallBody) - max(0, held - site.smallBody)
        if site.large + large > site.maxLarge:
            channel.refuse(503, b"too many request bytes held at once; retry")
            return
        site.large += large
        site.buffered += len(data)
        self._counted += len(data)
        self._counted_large += large
        self._budget = site
        self.content.write(data)

    _counted_large = 0

    def _release(self) -> None:
        """Give this request's body bytes back to the site's budget (once)."""
        site: WebhookSite | None = getattr(self, "_budget", None)
        if self._counted and site is not None:
            site.buffered -= self._counted
            site.large -= self._counted_large
        self._counted = self._counted_large = 0

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        # The body is parsed synchronously (an answer waiting for claim
        # reads holds the parsed pod, not the body): once this returns, the
        # body is no longer needed.
        try:
            super().requestReceived(command, path, version)
        finally:
            self._release()
            self.content = io.BytesIO()

    def connectionLost(self, reason: Failure) -> None:
        self._release()
        super().connectionLost(reason)

    def processingFailed(self, reason: Failure) -> None:
        self.log.error("hostpid-webhook: request failed: {error}",
                       error=reason.getErrorMessage())
        internal_error(self)


class WebhookChannel(BoundedChannel):
    """
    One connection, with the webhook's bounds (L{BoundedChannel}; see the
    module docstring).  Kept alive between requests, as the API server
    wants; any method reaches the resources (C{/mutate} answers C{GET}
    405 itself).
    """

    maxHeaders = 64
    totalHeadersSize = 16384
    maxBody = MAX_BODY
    tooLargeText = b"the body is larger than %d bytes" % (MAX_BODY,)

    site: WebhookSite


class WebhookSite(BoundedSite):
    """
    The webhook's factory: the bounded channel, at most L{MAX_CONNECTIONS}
    (L{BoundedSite}), its refusals counted in L{WebhookMetrics}, and the
    request body bytes held at once over every connection (L{buffered}), of
    which those past each body's first L{SMALL_BODY} (L{large}) are bounded
    by L{MAX_LARGE_BUFFERED}.
    """

    protocol = WebhookChannel
    requestFactory = WebhookRequest

    def __init__(self, resource: Resource, metrics: WebhookMetrics,
                 timeout: float = REQUEST_TIMEOUT, maxConnections: int = MAX_CONNECTIONS,
                 maxLarge: int = MAX_LARGE_BUFFERED, smallBody: int = SMALL_BODY,
                 reactor: Any = None) -> None:
        super().__init__(resource, maxConnections, timeout, reactor=reactor)
        self.metrics = metrics
        self.maxLarge = maxLarge
        self.smallBody = smallBody
        #: Request body bytes held now, over every connection.
        self.buffered = 0
        #: Of those, the bytes past each body's first C{smallBody}.
        self.large = 0

    def buildProtocol(self, addr: IAddress) -> WebhookChannel:  # type: ignore[override]
        channel = super().buildProtocol(addr)
        assert isinstance(channel, WebhookChannel)
        return channel

    def countEviction(self) -> None:
        self.metrics.refused.labels("evicted").inc()

    def countTimeout(self) -> None:
        self.metrics.refused.labels("timed_out").inc()

    def countRefusal(self, code: int) -> None:
        reason = {413: "too_large", 503: "busy"}.get(code, "bad_request")
        self.metrics.refused.labels(reason).inc()


def make_site(config: Config, timeout: float = REQUEST_TIMEOUT, reactor: Any = None,
              metrics: WebhookMetrics | None = None,
              lookup: ClaimLookup | None = None) -> WebhookSite:
    """
    The webhook's site; with C{lookup} (and L{Config.device_classes}) it
    reads the claim objects of pods with ResourceClaims.
    """
    metrics = metrics if metrics is not None else WebhookMetrics()
    if lookup is not None:
        lookup.observe = metrics.observe_lookup
    return WebhookSite(webhook_resource(config, metrics, lookup), metrics, timeout=timeout,
                       reactor=reactor)
