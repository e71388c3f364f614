"""twistd plugin: C{twistd --nodaemon --pidfile= hostpid-broker [options]}."""

from twisted.application.service import ServiceMaker

hostpidBroker = ServiceMaker(
    "hostpid-broker",
    "hostpid.tap",
    "Host PID broker: tells each caller its own host PID (SO_PEERCRED)",
    "hostpid-broker",
)
