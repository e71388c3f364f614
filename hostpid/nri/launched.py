"""
The plugin launched by the runtime itself: one connection it was handed.

A runtime with NRI starts the plugins it finds in its plugin directory
(C{plugin_path}, C{/opt/nri/plugins} by default) before it serves CRI, so a
container the kubelet creates after a node start is seen by them.  NRI's
contract for such a plugin (containerd/nri C{pkg/adaptation/plugin.go},
C{newLaunchedPlugin}; C{pkg/stub/stub.go} is a Go plugin's side): the file
C{NN-NAME} is executed with an environment of exactly three variables,
C{NRI_PLUGIN_NAME} (C{NAME}), C{NRI_PLUGIN_IDX} (C{NN}) and
C{NRI_PLUGIN_SOCKET} (C{3}), and descriptor 3 is one end of a socket pair
whose other end the runtime already multiplexes.  The plugin registers on
it as an external plugin does; the runtime takes the name and index from
the file name, not from the registration.

What differs from L{hostpid.nri.service.NRIPluginService}:

  - nothing to connect to and nothing to reconnect: when the connection
    closes (the runtime stopped, or dropped the plugin) the process exits,
    and the runtime launches it again when it starts again;
  - the runtime waits for the registration (its registration timeout, 5 s
    by default) before it serves CRI.  containerd 1.7 (NRI 0.6) treats a
    launched plugin that does not register in time as a fatal error of its
    CRI service; NRI 0.7 and later log it and go on (C{startPlugins} in
    C{pkg/adaptation/adaptation.go}).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.interfaces import IReactorSocket
from twisted.logger import Logger

from hostpid.nri.service import PluginFactory


class LaunchedPluginFactory(PluginFactory):
    """L{PluginFactory} whose one connection's end is the process's end."""

    def __init__(self, *args: Any, gone: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gone = gone

    def disconnected(self, protocol: Any, was_registered: bool) -> None:
        self.forget(protocol, was_registered)
        self.log.info("hostpid-nri: the runtime closed the connection it launched the plugin "
                      "with{after}; exiting (it launches the plugin again when it starts)",
                      after=" after registration" if was_registered else "")
        self.gone()


class LaunchedConnectionService(Service):
    """
    The connection on an inherited descriptor, adopted at start.

    @ivar socketPath: what C{/readyz} names (C{fd N}).
    """

    log = Logger()

    def __init__(self, reactor: IReactorSocket, fd: int, factory: LaunchedPluginFactory) -> None:
        self.reactor = reactor
        self.fd = fd
        self.pluginFactory = factory
        self.socketPath = f"fd {fd}"

    @property
    def ready(self) -> bool:
        return self.pluginFactory.ready

    def startService(self) -> None:
        super().startService()
        # Adopting duplicates the descriptor; the original is closed so that
        # the connection's only reference is the reactor's.
        inherited = socket.socket(fileno=self.fd)
        try:
            if inherited.family != socket.AF_UNIX or inherited.type != socket.SOCK_STREAM:
                raise ValueError(f"descriptor {self.fd} is not a Unix stream socket")
            # Typed for a server's factory; it only calls buildProtocol.
            self.reactor.adoptStreamConnection(inherited.fileno(), socket.AF_UNIX,
                                               self.pluginFactory)  # type: ignore[arg-type]
        finally:
            inherited.close()


def inherited_socket_error(fd: int) -> str | None:
    """Why descriptor C{fd} cannot be the runtime's connection, or None."""
    try:
        probe = socket.socket(fileno=fd)
    except OSError as e:
        return f"descriptor {fd} is not open or not a socket ({e.strerror})"
    try:
        if probe.family != socket.AF_UNIX or probe.type != socket.SOCK_STREAM:
            return f"descriptor {fd} is not a Unix stream socket"
        try:
            probe.getpeername()
        except OSError as e:
            return f"descriptor {fd} is not connected ({e.strerror})"
        return None
    finally:
        probe.detach()
