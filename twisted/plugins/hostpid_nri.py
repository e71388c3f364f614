"""twistd plugin: C{twistd --nodaemon --pidfile= hostpid-nri [--nri-socket PATH]}."""

from twisted.application.service import ServiceMaker

hostpidNri = ServiceMaker(
    "hostpid-nri",
    "hostpid.nri.tap",
    "NRI plugin: gives containers with a GPU allocation the host PID broker's mounts and gate",
    "hostpid-nri",
)
