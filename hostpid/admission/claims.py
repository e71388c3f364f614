"""
The webhook's reads of ResourceClaimTemplates and ResourceClaims
(C{resource.k8s.io/v1}) from the API server, for pods whose GPUs come from
claims (L{hostpid.admission.decision}: L{claim_sources}, L{request_classes}).

The webhook answers inside the API server's C{timeoutSeconds} (the chart: at
most 5 s) and must never refuse or fail a pod, so every read here is bounded
and every failure is an outcome, not an error:

  - each read has a deadline (L{ClaimLookup.timeout}: the chart gives half
    the webhook's C{timeoutSeconds}), covering the wait for a slot, the
    connection, the answer and its body; at the deadline it is cancelled
    (the connection aborted) and counted C{timeout};
  - at most L{ClaimLookup.max_in_flight} reads run at once and at most
    L{ClaimLookup.max_waiting} wait for a slot; past that a read is not
    made (C{busy});
  - a body is read up to L{ClaimLookup.max_body} bytes and no further: a
    larger one (from C{Content-Length}, or as it arrives) aborts the
    connection (C{too_large}), so a huge or hostile object never grows the
    webhook's memory;
  - a pod names at most L{MAX_OBJECTS} objects that are read; the rest count
    C{skipped}; names that are not Kubernetes names are never put in a URL
    (C{invalid}).

What a read fails to give, the decision does without: the claim counts for
nothing and its container qualifies by its resources alone.

The credentials are a swapped part (L{IAPICredentials}): in a pod, the
service account's mounted token and CA and C{KUBERNETES_SERVICE_HOST}/C{PORT}
(L{InClusterCredentials}); in tests, any API server given by address, CA and
a token or a client certificate (L{StaticCredentials}).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from OpenSSL import crypto
from twisted.internet import defer, ssl
from twisted.internet.error import ConnectError, ConnectionLost, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    ResponseDone,
    ResponseFailed,
    _HTTP11ClientFactory,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IPolicyForHTTPS
from zope.interface import Interface, implementer

from hostpid.admission.decision import ClaimSource, request_classes


def json_object(data: bytes) -> dict[str, Any]:
    """
    C{data} as a JSON object (an API server's object, an AdmissionReview).

    @raise ValueError: it is not JSON (nested too deep included) or not an
        object; the message is short whatever C{data} holds.
    """
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON: {str(e)[:80]}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj

#: Outcomes of one read (the C{hostpid_webhook_claim_lookups_total} label).
FOUND = "found"
NOT_FOUND = "not_found"
FORBIDDEN = "forbidden"
TIMEOUT = "timeout"
TOO_LARGE = "too_large"
BUSY = "busy"
ERROR = "error"
INVALID = "invalid"
SKIPPED = "skipped"
LOOKUP_OUTCOMES = (FOUND, NOT_FOUND, FORBIDDEN, TIMEOUT, TOO_LARGE, BUSY, ERROR, INVALID,
                   SKIPPED)

#: The default deadline of one read, in seconds: well inside the API
#: server's 5 s (the chart gives half its C{webhook.timeoutSeconds}).
DEFAULT_TIMEOUT = 2.0
#: Reads at once, and reads waiting for a slot.
MAX_IN_FLIGHT = 16
MAX_WAITING = 256
#: The largest object body read, in bytes.  A template of a few requests is
#: a kilobyte or two; the API server stores objects of up to about 1.5 MiB.
MAX_OBJECT = 256 * 1024
#: Objects read for one pod at most.
MAX_OBJECTS = 16
#: The longest service account token read.
MAX_TOKEN = 64 * 1024

#: Where the kubelet mounts a pod's service account token, CA and namespace.
SERVICE_ACCOUNT_DIRECTORY = Path("/var/run/secrets/kubernetes.io/serviceaccount")

_PLURALS = {"ResourceClaimTemplate": "resourceclaimtemplates",
            "ResourceClaim": "resourceclaims"}
#: A DNS subdomain (RFC 1123) as Kubernetes checks object names, and a DNS label.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


class CredentialsUnavailable(Exception):
    """The credentials cannot be read now (no token, no API server address)."""


class IAPICredentials(Interface):
    """How the webhook reaches and authenticates to the API server."""

    def server() -> str:
        """
        The API server's base URL, C{https://HOST:PORT} (C{http://} only in
        tests), without a trailing slash.

        @raise CredentialsUnavailable: no address is known.
        """

    def authorization() -> bytes | None:
        """
        The C{Authorization} header's value, read afresh for every request
        (the kubelet rotates projected tokens), or None (a client
        certificate authenticates).

        @raise CredentialsUnavailable: the token cannot be read.
        """

    def tlsPolicy() -> IPolicyForHTTPS:
        """The TLS client policy: the API server's CA, and a client certificate if any."""


@implementer(IPolicyForHTTPS)
@attrs.frozen
class _TrustPolicy:
    """
    Verify the server against the CA C{trust} gives (read for each request:
    the kubelet replaces the mounted one in place) and nothing else: never
    the system's CAs, which a missing CA would otherwise fall back to.
    Present C{client}, if any.
    """

    trust: Callable[[], ssl.Certificate]
    client: ssl.PrivateCertificate | None = None

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        return ssl.optionsForClientTLS(hostname.decode("ascii"), trustRoot=self.trust(),
                                       clientCertificate=self.client)


def _read_bounded(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CredentialsUnavailable(f"{path} is larger than {limit} bytes")
    return data


@implementer(IAPICredentials)
@attrs.define
class InClusterCredentials:
    """
    A pod's own: C{KUBERNETES_SERVICE_HOST} and C{_PORT} (the kubelet sets
    both in every container), the token and CA the kubelet mounts in
    L{directory}.  The token is read for every request: a projected token
    is rotated by the kubelet and replaced in place.
    """

    directory: Path = SERVICE_ACCOUNT_DIRECTORY
    environ: Mapping[str, str] = attrs.field(factory=lambda: os.environ)

    def server(self) -> str:
        host = self.environ.get("KUBERNETES_SERVICE_HOST")
        port = self.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise CredentialsUnavailable(
                "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    def authorization(self) -> bytes | None:
        try:
            token = _read_bounded(self.directory / "token", MAX_TOKEN).strip()
        except OSError as e:
            raise CredentialsUnavailable(f"no service account token: {e}") from None
        if not token:
            raise CredentialsUnavailable(f"{self.directory / 'token'} is empty")
        return b"Bearer " + token

    def tlsPolicy(self) -> IPolicyForHTTPS:
        return _TrustPolicy(self._ca)

    def _ca(self) -> ssl.Certificate:
        path = self.directory / "ca.crt"
        try:
            return ssl.Certificate.loadPEM(_read_bounded(path, MAX_TOKEN))
        except OSError as e:
            raise CredentialsUnavailable(f"no API server CA: {e}") from None
        except crypto.Error:
            raise CredentialsUnavailable(f"{path} is not a PEM certificate") from None


@implementer(IAPICredentials)
@attrs.frozen
class StaticCredentials:
    """
    A kubeconfig's worth, given: the server, its CA (PEM) and a bearer
    token or a client certificate and key (PEM, concatenated).
    """

    url: str
    ca: bytes | None = None
    token: bytes | None = None
    client: bytes | None = None

    def server(self) -> str:
        return self.url.rstrip("/")

    def authorization(self) -> bytes | None:
        return b"Bearer " + self.token if self.token else None

    def tlsPolicy(self) -> IPolicyForHTTPS:
        return _TrustPolicy(self._ca, ssl.PrivateCertificate.loadPEM(self.client)
                            if self.client else None)

    def _ca(self) -> ssl.Certificate:
        if not self.ca:
            raise CredentialsUnavailable("no API server CA given")
        return ssl.Certificate.loadPEM(self.ca)


class _TooLarge(Exception):
    pass


class _QuietFactory(_HTTP11ClientFactory):
    """The pool's connection factory without a "Starting factory" log line per connection."""

    noisy = False


class _CappedBody(Protocol):
    """
    A response body up to C{limit} bytes; past it the transport is told to
    stop (the connection is aborted) and L{finished} fails with L{_TooLarge}.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.finished: defer.Deferred[bytes] | None = defer.Deferred(self._cancel)

    def _cancel(self, _: object) -> None:
        self.finished = None
        self._stop()

    def _stop(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    def _fail(self, failure: Failure | Exception) -> None:
        finished, self.finished = self.finished, None
        self.parts = []
        if finished is not None:
            finished.errback(failure)

    def dataReceived(self, data: bytes) -> None:
        if self.finished is None:
            return
        self.size += len(data)
        if self.size > self.limit:
            self._fail(_TooLarge(f"more than {self.limit} bytes"))
            self._stop()
            return
        self.parts.append(data)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if self.finished is None:
            return
        if reason is None or reason.check(ResponseDone, PotentialDataLoss):
            finished, self.finished = self.finished, None
            finished.callback(b"".join(self.parts))
        else:
            self._fail(reason)


def _discard(response: Any) -> None:
    """Read none of C{response}'s body: the connection is aborted unless it is empty."""
    body = _CappedBody(0)
    assert body.finished is not None
    body.finished.addErrback(lambda _: None)
    response.deliverBody(body)


@attrs.frozen
class Lookup:
    """
    One read: the pod's claim, the object read, its outcome, and (found)
    the device classes of each of its requests, or why not (C{detail}).
    """

    source: ClaimSource
    outcome: str
    classes: tuple[frozenset[str], ...] = ()
    detail: str = ""


def valid_name(name: str) -> bool:
    return len(name) <= 253 and _SUBDOMAIN.match(name) is not None


def valid_namespace(namespace: str) -> bool:
    return _LABEL.match(namespace) is not None


@attrs.define
class ClaimLookup:
    """
    Reads claim objects for the webhook, on the reactor, within the bounds
    of the module docstring.

    @ivar observe: called with each read's outcome and its seconds.
    """

    credentials: IAPICredentials
    reactor: Any
    clock: IReactorTime | None = None
    timeout: float = DEFAULT_TIMEOUT
    max_in_flight: int = MAX_IN_FLIGHT
    max_waiting: int = MAX_WAITING
    max_body: int = MAX_OBJECT
    observe: Callable[[str, float], None] = lambda outcome, seconds: None
    now: Callable[[], float] = time.perf_counter
    _agent: Agent | None = attrs.field(default=None, init=False)
    _slots: defer.DeferredSemaphore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.clock is None:
            self.clock = self.reactor
        self._slots = defer.DeferredSemaphore(self.max_in_flight)

    def agent(self) -> Agent:
        if self._agent is None:
            pool = HTTPConnectionPool(self.reactor, persistent=True)
            pool.maxPersistentPerHost = self.max_in_flight
            pool.retryAutomatically = False
            pool._factory = _QuietFactory
            self._agent = Agent(self.reactor, contextFactory=self.credentials.tlsPolicy(),
                                connectTimeout=self.timeout, pool=pool)
        return self._agent

    def lookup_all(self, namespace: str,
                   sources: Sequence[ClaimSource]) -> defer.Deferred[list[Lookup]]:
        """
        Every one of C{sources} read at once, in C{namespace}; fires with
        one L{Lookup} each (never fails).  Objects past L{MAX_OBJECTS} are
        not read.
        """
        reads: list[defer.Deferred[Lookup]] = []
        for index, source in enumerate(sources):
            if index >= MAX_OBJECTS:
                reads.append(defer.succeed(self._done(
                    source, SKIPPED, 0.0, detail=f"more than {MAX_OBJECTS} objects in one pod")))
            else:
                reads.append(self.lookup(namespace, source))
        gathered = defer.gatherResults(reads)
        return gathered

    def not_made(self, sources: Sequence[ClaimSource], outcome: str, detail: str) -> list[Lookup]:
        """C{sources} not read, each counted with C{outcome}."""
        started = self.now()
        return [self._done(source, outcome, started, detail=detail) for source in sources]

    def lookup(self, namespace: str, source: ClaimSource) -> defer.Deferred[Lookup]:
        """One object read, within the deadline; fires with a L{Lookup}, never fails."""
        started = self.now()
        if not (valid_namespace(namespace) and valid_name(source.object_name)):
            return defer.succeed(self._done(source, INVALID, started,
                                            detail="not a Kubernetes name"))
        if len(self._slots.waiting) >= self.max_waiting:
            return defer.succeed(self._done(source, BUSY, started,
                                            detail=f"{self.max_waiting} reads already waiting"))
        read = defer.Deferred.fromCoroutine(self._read(namespace, source))
        assert self.clock is not None
        # Cancelled at the deadline, the agent fails with its own error
        # (ResponseNeverReceived around the cancellation): it is a timeout.
        read.addTimeout(self.timeout, self.clock,
                        onTimeoutCancel=lambda _, timeout: Failure(defer.TimeoutError(
                            f"no answer in {timeout:g} s")))

        def failed(failure: Failure) -> Lookup:
            outcome, detail = self._classify(failure)
            return self._done(source, outcome, started, detail=detail)

        return read.addCallbacks(
            lambda found: self._done(source, FOUND, started, classes=found), failed)

    async def _read(self, namespace: str, source: ClaimSource) -> tuple[frozenset[str], ...]:
        await self._slots.acquire()
        try:
            url = (f"{self.credentials.server()}/apis/resource.k8s.io/v1/namespaces/"
                   f"{namespace}/{_PLURALS[source.kind]}/{source.object_name}")
            headers = Headers({b"accept": [b"application/json"]})
            authorization = self.credentials.authorization()
            if authorization is not None:
                headers.setRawHeaders(b"authorization", [authorization])
            response = await self.agent().request(b"GET", url.encode("ascii"), headers)
            if response.code != 200:
                _discard(response)
                raise _Status(response.code)
            if response.length is not UNKNOWN_LENGTH and response.length > self.max_body:
                _discard(response)
                raise _TooLarge(f"Content-Length {response.length}")
            body = _CappedBody(self.max_body)
            response.deliverBody(body)
            assert body.finished is not None
            data = await body.finished
        finally:
            self._slots.release()
        try:
            obj = json_object(data)
        except ValueError as e:
            raise _Malformed(str(e)) from None
        # The kind read is the kind asked for (request_classes reads a
        # template's nested spec by it).
        return request_classes({**obj, "kind": source.kind})

    @staticmethod
    def _classify(failure: Failure) -> tuple[str, str]:
        error = failure.value
        if isinstance(error, _Status):
            if error.code == 404:
                return NOT_FOUND, "404"
            if error.code in (401, 403):
                return FORBIDDEN, str(error.code)
            return ERROR, f"HTTP {error.code}"
        if isinstance(error, defer.TimeoutError):
            return TIMEOUT, "no answer in time"
        if isinstance(error, _TooLarge):
            return TOO_LARGE, str(error)
        if isinstance(error, ResponseFailed):
            reasons = [r.getErrorMessage() for r in error.reasons]
            return ERROR, f"response failed: {'; '.join(reasons)[:120]}"
        if isinstance(error, (ConnectError, ConnectionLost, TimeoutError)):
            return ERROR, f"{type(error).__name__}: {str(error)[:120]}"
        if isinstance(error, CredentialsUnavailable | _Malformed):
            return ERROR, str(error)[:160]
        return ERROR, f"{type(error).__name__}: {str(error)[:120]}"

    def _done(self, source: ClaimSource, outcome: str, started: float,
              detail: str = "", classes: tuple[frozenset[str], ...] = ()) -> Lookup:
        self.observe(outcome, max(0.0, self.now() - started))
        return Lookup(source, outcome, classes, detail)


class _Status(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code


class _Malformed(Exception):
    pass


def claim_classes(lookups: Sequence[Lookup]) -> dict[str, tuple[frozenset[str], ...]]:
    """L{decide}'s C{claim_classes}: what each found read gave, by the pod's name for the claim."""
    return {lookup.source.name: lookup.classes for lookup in lookups
            if lookup.outcome == FOUND}
