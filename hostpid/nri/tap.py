"""
C{twistd hostpid-nri}: options and service construction, nothing more.

The gate is the plugin's own environment, as for the broker and the webhook:
only C{LIBVGPU_HOSTPID_BROKER=1} (exactly) lets it adjust containers
(L{hostpid.gate.gate_enabled}).  With the gate off it still registers, so
that turning the gate on is a restart of the plugin and nothing else.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from twisted.application.internet import StreamServerEndpointService, TimerService
from twisted.application.service import IService, MultiService
from twisted.internet import endpoints
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python import usage
from zope.interface import implementer

from hostpid import defaults
from hostpid.gate import gate_enabled
from hostpid.nri.decision import DEFAULT_RESOURCES, Config, Signal, parse_resource
from hostpid.nri.plugin import DEFAULT_INDEX, REGISTRATION_TIMEOUT
from hostpid.version import VersionOption

DEFAULT_SOCKET = "/var/run/nri/nri.sock"
#: Seconds between two looks at the host (L{hostpid.nri.service.Adjuster.look})
#: besides the one before each adjustment: how soon C{/readyz}, which only
#: reports the last look, follows a host that changed on an idle node.
HOST_LOOK_INTERVAL = 10.0
#: NRI's own rule for an index: two digits (containerd/nri
#: C{pkg/api/plugin.go}, C{CheckPluginIndex}).
INDEX = re.compile(r"[0-9]{2}")
#: Seconds a stopping plugin stays registered (L{PluginRoot.stopService}).
#: The runtime adds a new plugin to those it calls only after registering,
#: configuring and synchronizing it, and after any CreateContainer in flight
#: (C{acceptPluginConnections} in containerd/nri C{pkg/adaptation/
#: adaptation.go} appends it under the lock C{CreateContainer} holds): an old
#: instance stopped the moment its replacement reports ready could leave a
#: creation to neither.  Half the runtime's request timeout (2 s) covers a
#: creation in flight; the chart's grace period (10 s) and the unit's
#: C{TimeoutStopSec} (10 s) cover it.
DRAIN = 1.0


class Options(VersionOption, usage.Options):
    synopsis = ("[--nri-socket PATH | --nri-fd N] [--plugin-index NN] [--resource SIGNAL]... "
                "[--metrics ENDPOINT] [--health ENDPOINT] [--drain S]")
    longdesc = (
        "Run the NRI plugin that gives every container with a GPU allocation the host PID "
        "broker's mounts (/tmp/vgpulock, then /tmp/vgpulock/hostpid read-only) and "
        "LIBVGPU_HOSTPID_BROKER=1 at creation.  It adjusts containers only when its own "
        "LIBVGPU_HOSTPID_BROKER is exactly \"1\", never answers the runtime an error, and "
        "reconnects when the runtime restarts.  Run it as "
        "`twistd --nodaemon --pidfile= hostpid-nri`."
    )
    optParameters = [
        ["nri-socket", None, DEFAULT_SOCKET, "The runtime's NRI socket."],
        ["plugin-index", None, DEFAULT_INDEX,
         "Two digits: the plugin's place among NRI plugins (lower runs first).  The default "
         "runs after device-injecting plugins, so the GPUs they add are seen."],
        ["metrics", None, None,
         "Twisted endpoint string for /healthz, /readyz (configured by the runtime, and the "
         "lock parent, the broker directory and the broker mountpoint usable) and /metrics, "
         "e.g. tcp:9396:interface=127.0.0.1.  Off by default."],
        ["health", None, None,
         "Twisted endpoint string for /healthz and /readyz only, for an exec probe "
         "(`hostpid nri-probe`) over a listener no other pod reaches, e.g. "
         "tcp:9398:interface=127.0.0.1 in the plugin's pod.  Its own connection cap: a flood "
         "of the --metrics port cannot evict a probe.  Off by default."],
        ["host-look-interval", None, HOST_LOOK_INTERVAL,
         "Seconds between two looks at the host besides the one at each GPU container's "
         "creation (/readyz reports the last look, it never looks itself)."],
        ["lock-parent", None, defaults.LOCK_PARENT,
         "The host lock parent, mounted at /tmp/vgpulock."],
        ["broker-dir", None, defaults.BROKER_DIRECTORY,
         "The host broker directory, mounted read-only at /tmp/vgpulock/hostpid."],
        ["registration-timeout", None, REGISTRATION_TIMEOUT,
         "Seconds the runtime has to accept the registration before the plugin reconnects."],
        ["nri-fd", None, None,
         "Launched by the runtime (a file in its NRI plugin directory): the descriptor of the "
         "connection it handed over (NRI_PLUGIN_SOCKET), used instead of --nri-socket; the "
         "plugin exits when it closes."],
        ["drain", None, DRAIN,
         "Seconds the plugin stays registered after it is told to stop, so that a replacement "
         "started first has joined the runtime's plugins before this one leaves."],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["resource"] = []
        self["signals"] = []

    def opt_resource(self, value: str) -> None:
        """
        A sign of a GPU allocation the plugin honours (repeatable; default nvidia.com/gpu):
        a known resource name (nvidia.com/gpu), device:GLOB or device:re:REGEX (a device
        node in the container), cdi:VENDOR/CLASS (a CDI device of that kind) or
        devnull-mount:DIR (a device-list mount of /dev/null inside DIR).
        """
        try:
            signals = parse_resource(value)
        except ValueError as e:
            raise usage.UsageError(f"--resource {e}") from None
        self["resource"].append(value)
        self["signals"].extend(signals)

    def seconds(self, name: str, low: float, high: float, above: bool = False) -> None:
        """
        Option C{name} as a number of seconds from C{low} (excluded when
        C{above}) to C{high}, or a usage error naming both.
        """
        try:
            value = float(self[name])
        except ValueError:
            value = math.nan
        if not ((low < value) if above else (low <= value)) or not value <= high:
            raise usage.UsageError(f"--{name} must be a number of seconds from {low:g} to "
                                   f"{high:g}, got {self[name]!r}")
        self[name] = value

    def postOptions(self) -> None:
        if not INDEX.fullmatch(self["plugin-index"] or ""):
            raise usage.UsageError(f"--plugin-index must be two digits (NRI's rule), "
                                   f"got {self['plugin-index']!r}")
        if not self["nri-socket"]:
            raise usage.UsageError("--nri-socket must name the runtime's NRI socket")
        self.seconds("registration-timeout", 0, 60, above=True)
        self.seconds("drain", 0, 30)
        self.seconds("host-look-interval", 1, 3600)
        if self["nri-fd"] is not None:
            from hostpid.nri.launched import inherited_socket_error

            if not (self["nri-fd"] or "").isdigit():
                raise usage.UsageError(f"--nri-fd must be a descriptor number, "
                                       f"got {self['nri-fd']!r}")
            self["nri-fd"] = int(self["nri-fd"])
            error = inherited_socket_error(self["nri-fd"])
            if error is not None:
                raise usage.UsageError(f"--nri-fd: {error}: run this way only by the runtime "
                                       "(a file in its NRI plugin directory)")
        for name in ("metrics", "health"):
            if self[name]:
                from twisted.internet import reactor

                try:
                    endpoint = endpoints.serverFromString(reactor, self[name])
                except Exception as e:
                    raise usage.UsageError(f"--{name} {self[name]!r}: not a Twisted server "
                                           f"endpoint string ({e})") from None
                setattr(self, f"{name}Endpoint", endpoint)


def config_from(options: Options | dict[str, Any], environ: Any = None) -> Config:
    signals: list[Signal] = list(options.get("signals") or ())
    if not signals:
        for name in DEFAULT_RESOURCES:
            signals.extend(parse_resource(name))
    return Config(
        signals=tuple(dict.fromkeys(signals)),
        gate=gate_enabled(environ),
        lock_parent=options.get("lock-parent") or defaults.LOCK_PARENT,
        broker_dir=options.get("broker-dir") or defaults.BROKER_DIRECTORY,
    )


#: What the plugin says, once, while the runtime's NRI socket does not exist.
NRI_OFF_HINT = (
    "NRI may be off in the container runtime.  containerd 1.7: in config.toml, "
    "[plugins.\"io.containerd.nri.v1.nri\"] disable = false (containerd 2.x has it on); "
    "CRI-O before 1.30: [crio.nri] enable_nri = true; then restart the runtime.  "
    "--nri-socket must name the socket the runtime's NRI configuration names"
)


@implementer(IStreamClientEndpoint)
class SocketEndpoint:
    """
    The runtime's socket as a client endpoint that names its path when
    logged (C{ClientService} logs each retry with the endpoint's C{repr}),
    and says once, until a connection succeeds, that a socket that does not
    exist may mean NRI is off in the runtime, and how to turn it on.
    """

    log = Logger()

    def __init__(self, reactor: Any, path: str) -> None:
        self.path = path
        self._endpoint = endpoints.UNIXClientEndpoint(reactor, path)
        self.hinted = False

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        connecting = self._endpoint.connect(factory)
        connecting.addCallbacks(self._connected, self._failed)
        return connecting

    def _connected(self, protocol: IProtocol) -> IProtocol:
        self.hinted = False
        return protocol

    def _failed(self, failure: Any) -> Any:
        if not self.hinted and not os.path.exists(self.path):
            self.hinted = True
            self.log.warn("hostpid-nri: no NRI socket at {socket}.  {hint}.  Retrying.",
                          socket=self.path, hint=NRI_OFF_HINT)
        return failure

    def __repr__(self) -> str:
        return f"unix:{self.path}"


class HealthEndpointService(StreamServerEndpointService):
    """The metrics listener: a failed listen stops twistd with status 1."""

    _raiseSynchronously = True


class PluginRoot(MultiService):
    log = Logger()

    def __init__(self, config: Config, socket_path: str, index: str, clock: Any = None,
                 drain: float = 0.0) -> None:
        super().__init__()
        self.config = config
        self.socketPath = socket_path
        self.index = index
        self.clock = clock
        self.drain = drain
        #: The runtime connection's service (its C{ready}: registered).
        self.connection: Any = None

    def startService(self) -> None:
        self.log.info(
            "hostpid-nri: connecting to {socket} as {index}-hostpid, gate {gate}, "
            "signals {signals}", socket=self.socketPath, index=self.index,
            gate="on" if self.config.gate else "off",
            signals=[s.describe() for s in self.config.signals])
        super().startService()

    def stopService(self) -> Deferred[None] | None:
        """
        Stay registered L{drain} seconds before leaving: an upgrade starts the
        new instance, waits for it to be ready, then stops this one
        (docs/nri.md), and the runtime may still be adding the new one.
        """
        if self.drain > 0 and self.clock is not None and getattr(
                self.connection, "ready", False):
            from twisted.internet.task import deferLater

            self.log.info("hostpid-nri: stopping; still answering the runtime for {drain} s",
                          drain=self.drain)
            waited: Deferred[None] = deferLater(self.clock, self.drain, lambda: None)
            waited.addCallback(lambda _: super(PluginRoot, self).stopService())
            return waited
        return super().stopService()


def makeService(options: Options | dict[str, Any], reactor: Any = None) -> IService:
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
    from hostpid.nri.service import (
        Adjuster,
        Backoff,
        NRIMetrics,
        NRIPluginService,
        PluginFactory,
    )

    config = config_from(options)
    socket_path = options.get("nri-socket") or DEFAULT_SOCKET
    index = options.get("plugin-index") or DEFAULT_INDEX
    metrics = NRIMetrics()
    adjuster = Adjuster(config, metrics)
    timeout = float(options.get("registration-timeout") or REGISTRATION_TIMEOUT)
    fd = options.get("nri-fd")
    drain = options.get("drain")
    client: Any
    if fd is not None:
        from hostpid.nri.launched import LaunchedConnectionService, LaunchedPluginFactory

        def gone() -> None:
            if reactor.running:
                reactor.stop()

        launched = LaunchedPluginFactory(
            adjuster, reactor, metrics, Backoff(), index=index,
            registration_timeout=timeout, gone=gone)
        client = LaunchedConnectionService(reactor, int(fd), launched)
        socket_path = client.socketPath
    else:
        factory = PluginFactory(adjuster, reactor, metrics, Backoff(),
                                index=index, registration_timeout=timeout)
        client = NRIPluginService(SocketEndpoint(reactor, socket_path), factory, reactor,
                                  socket_path)
    root = PluginRoot(config, socket_path, index, reactor,
                      DRAIN if drain is None else float(drain))
    root.connection = client
    client.setServiceParent(root)
    if config.gate:
        # The host looked at now and then, not only at a GPU container's
        # creation: a missing lock parent is said (once) even on an idle node,
        # and /readyz, which reports the last look, follows the host.
        looker = TimerService(float(options.get("host-look-interval") or HOST_LOOK_INTERVAL),
                              adjuster.look)
        looker.clock = reactor
        looker.setServiceParent(root)
    for name, metered in (("metrics", True), ("health", False)):
        if options.get(name):
            from hostpid.nri.health import health_site

            endpoint = getattr(options, f"{name}Endpoint", None) or \
                endpoints.serverFromString(reactor, options[name])
            if metered:
                from hostpid.pacedport import paced

                # The port any pod can reach: a connect flood there must not
                # take the reactor from the runtime's requests and the probes.
                endpoint = paced(endpoint)
            site = health_site(client, metrics if metered else None, reactor,
                               host=(lambda: adjuster.last) if config.gate else None,
                               stale=lambda: adjuster.stale)
            HealthEndpointService(endpoint, site).setServiceParent(root)
    return root
