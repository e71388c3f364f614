"""twistd plugin: C{twistd --nodaemon --pidfile= hostpid-webhook --endpoint ENDPOINT}."""

from twisted.application.service import ServiceMaker

hostpidWebhook = ServiceMaker(
    "hostpid-webhook",
    "hostpid.admission.tap",
    "Admission webhook: gives GPU pods the host PID broker's CDI device or mounts",
    "hostpid-webhook",
)
