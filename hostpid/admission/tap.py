"""
C{twistd hostpid-webhook}: options and service construction, nothing more.

The gate is the webhook's own environment, as for the broker: only
C{LIBVGPU_HOSTPID_BROKER=1} (exactly) lets it patch pods
(L{hostpid.gate.gate_enabled}).
"""

from __future__ import annotations

from typing import Any

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import IService
from twisted.internet import endpoints
from twisted.logger import ILogObserver, Logger
from twisted.python import usage
from twisted.python.components import Componentized

from hostpid import defaults, logs
from hostpid.admission.claims import DEFAULT_TIMEOUT, ClaimLookup, InClusterCredentials, valid_name
from hostpid.admission.decision import MODES, Config
from hostpid.admission.service import REQUEST_TIMEOUT, make_site
from hostpid.gate import gate_enabled
from hostpid.version import VersionOption

DEFAULT_RESOURCE = "nvidia.com/gpu"
MAX_TIMEOUT = 60.0
MAX_LOOKUP_TIMEOUT = 30.0


class Options(VersionOption, usage.Options):
    synopsis = ("--endpoint ENDPOINT [--resource NAME]... [--device-class NAME]... "
                "[--mode cdi|mounts]")
    longdesc = (
        "Serve the admission webhook that gives GPU pods the host PID broker: POST /mutate "
        "(AdmissionReview admission.k8s.io/v1), /healthz, /readyz, /metrics.  It patches pods "
        "only when its own LIBVGPU_HOSTPID_BROKER is exactly \"1\".  Run it as "
        "`twistd --nodaemon --pidfile= hostpid-webhook --endpoint "
        "ssl:8443:privateKey=tls.key:certKey=tls.crt`."
    )
    optParameters = [
        ["endpoint", None, None,
         "Twisted server endpoint string, e.g. ssl:8443:privateKey=KEY:certKey=CERT "
         "(the API server calls webhooks over TLS only)."],
        ["mode", None, "cdi",
         "cdi: the pod annotation cdi.k8s.io/hostpid-broker (needs a node component that "
         "turns it into container CDI devices, see docs/admission.md); mounts: hostPath "
         "volumes, mounts and the gate, as `hostpid allocate` gives them."],
        ["lock-parent", None, defaults.LOCK_PARENT,
         "The host lock parent mounted at /tmp/vgpulock (mode mounts)."],
        ["broker-dir", None, defaults.BROKER_DIRECTORY,
         "The host broker directory mounted read-only at /tmp/vgpulock/hostpid (mode mounts)."],
        ["request-timeout", None, REQUEST_TIMEOUT,
         "Seconds in which each request must arrive whole."],
        ["claim-lookup-timeout", None, DEFAULT_TIMEOUT,
         "Seconds each read of a ResourceClaimTemplate or ResourceClaim may take (with "
         "--device-class); keep it well inside the webhook's timeoutSeconds."],
        ["log-files", None, logs.MAX_ROTATED_FILES,
         "Rotated log files kept beside --logfile (twistd rotates it at 1 MB and on SIGUSR1; "
         "by itself it keeps every one)."],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["resource"] = []
        self["device-class"] = []

    def opt_resource(self, name: str) -> None:
        """An extended resource that makes a pod qualify (repeatable; default nvidia.com/gpu)."""
        if not name or "/" not in name:
            raise usage.UsageError(f"--resource {name!r}: an extended resource name "
                                   "(DOMAIN/NAME), e.g. nvidia.com/gpu")
        self["resource"].append(name)

    def opt_device_class(self, name: str) -> None:
        """
        A DeviceClass (resource.k8s.io) whose devices are GPUs (repeatable; none: no
        lookups): a container naming a claim that asks only for listed classes qualifies,
        read from the API server with the pod's service account.
        """
        if not valid_name(name):
            raise usage.UsageError(f"--device-class {name!r}: a DeviceClass name (a DNS "
                                   "subdomain), e.g. gpu.example.com")
        self["device-class"].append(name)

    def postOptions(self) -> None:
        if not self["endpoint"]:
            raise usage.UsageError("--endpoint is required")
        if self["mode"] not in MODES:
            raise usage.UsageError(f"--mode must be one of {', '.join(MODES)}, "
                                   f"not {self['mode']!r}")
        try:
            timeout = float(self["request-timeout"])
        except ValueError:
            timeout = -1.0
        if not 0 < timeout <= MAX_TIMEOUT:
            raise usage.UsageError(f"--request-timeout must be a number of seconds from 0 "
                                   f"to {MAX_TIMEOUT:g}, got {self['request-timeout']!r}")
        self["request-timeout"] = timeout
        try:
            lookup_timeout = float(self["claim-lookup-timeout"])
        except ValueError:
            lookup_timeout = -1.0
        if not 0 < lookup_timeout <= MAX_LOOKUP_TIMEOUT:
            raise usage.UsageError(
                f"--claim-lookup-timeout must be a number of seconds from 0 to "
                f"{MAX_LOOKUP_TIMEOUT:g} (the API server waits at most 30 s for a webhook), "
                f"got {self['claim-lookup-timeout']!r}")
        self["claim-lookup-timeout"] = lookup_timeout
        try:
            self["log-files"] = logs.parse_log_files(self["log-files"])
        except ValueError as e:
            raise usage.UsageError(f"--log-files {e}") from None
        from twisted.internet import reactor

        try:
            self.endpointObject = endpoints.serverFromString(reactor, self["endpoint"])
        except Exception as e:
            raise usage.UsageError(f"--endpoint {self['endpoint']!r}: not a Twisted server "
                                   f"endpoint string ({e})") from None


class WebhookService(StreamServerEndpointService):
    """The listening service; a failed listen stops twistd with status 1."""

    _raiseSynchronously = True
    log = Logger()

    #: The observer twistd is to log through (L{hostpid.logs.observer}), or
    #: None for twistd's own.
    logObserver: ILogObserver | None = None

    def __init__(self, endpoint: Any, factory: Any, config: Config) -> None:
        super().__init__(endpoint, factory)
        self.config = config

    def setServiceParent(self, parent: Any) -> None:
        """
        twistd logs through its application's L{ILogObserver} component
        when it has one (Twisted: C{twisted/application/app.py},
        C{AppLogger.start}), set here before twistd starts logging.
        """
        if self.logObserver is not None and isinstance(parent, Componentized):
            parent.setComponent(ILogObserver, self.logObserver)
        super().setServiceParent(parent)

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        assert self._waitingForPort is not None
        self._waitingForPort.addCallback(self._listening)

    def _listening(self, port: Any) -> Any:
        address = port.getHost()
        self.log.info(
            "hostpid-webhook: listening on port {port}, mode {mode}, gate {gate}, "
            "resources {resources}, device classes {device_classes}",
            port=getattr(address, "port", address), mode=self.config.mode,
            gate="on" if self.config.gate else "off", resources=list(self.config.resources),
            device_classes=list(self.config.device_classes) or "none (no claim reads)")
        return port


def config_from(options: Options | dict[str, Any], environ: Any = None) -> Config:
    return Config(
        resources=tuple(options.get("resource") or (DEFAULT_RESOURCE,)),
        device_classes=tuple(options.get("device-class") or ()),
        mode=options.get("mode") or "cdi",
        gate=gate_enabled(environ),
        lock_parent=options.get("lock-parent") or defaults.LOCK_PARENT,
        broker_dir=options.get("broker-dir") or defaults.BROKER_DIRECTORY,
    )


def makeService(options: Options | dict[str, Any]) -> IService:
    config = config_from(options)
    endpoint = getattr(options, "endpointObject", None)
    if endpoint is None:
        from twisted.internet import reactor

        endpoint = endpoints.serverFromString(reactor, options["endpoint"])
    lookup = None
    if config.device_classes:
        from twisted.internet import reactor

        # The pod's own service account (the chart mounts its token only
        # when device classes are listed, with RBAC to get claims and
        # templates and nothing else).
        lookup = ClaimLookup(InClusterCredentials(), reactor, timeout=float(
            options.get("claim-lookup-timeout") or DEFAULT_TIMEOUT))
    site = make_site(config, timeout=float(options.get("request-timeout") or REQUEST_TIMEOUT),
                     lookup=lookup)
    service = WebhookService(endpoint, site, config)
    service.logObserver = logs.observer(getattr(options, "parent", None), "text",
                                        int(options.get("log-files") or logs.MAX_ROTATED_FILES))
    return service
