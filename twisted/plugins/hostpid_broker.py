"""twistd plugin: C{twistd --nodaemon --pidfile= hostpid-broker [options]}."""

from typing import Any

from twisted.application.service import ServiceMaker


class _BrokerMaker(ServiceMaker):
    """
    twistd reads C{options} only for the plugin it runs: the broker's
    process is then kept free of the TLS stack it never uses
    (L{hostpid.broker.lean}), before any of its modules is imported.
    """

    @property
    def options(self) -> Any:
        from hostpid.broker.lean import without_tls

        without_tls()
        return super().options


hostpidBroker = _BrokerMaker(
    "hostpid-broker",
    "hostpid.tap",
    "Host PID broker: tells each caller its own host PID (SO_PEERCRED)",
    "hostpid-broker",
)
