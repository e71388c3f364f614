"""twistd plugin: C{twistd --nodaemon --pidfile= hostpid-nri [--nri-socket PATH]}."""

from hostpid.servicemaker import ExtraServiceMaker

hostpidNri = ExtraServiceMaker(
    "hostpid-nri",
    "hostpid.nri.tap",
    "NRI plugin: gives containers with a GPU allocation the host PID broker's mounts and gate",
    "hostpid-nri",
)
