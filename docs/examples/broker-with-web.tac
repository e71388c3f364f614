# A Twisted application in the shape of a device plugin: the host PID broker
# beside a twisted.web site that itself asks the broker, with the Twisted
# client, and returns the answer (its own host PID).
#
#   LIBVGPU_HOSTPID_BROKER=1 twistd --nodaemon --pidfile= -y broker-with-web.tac
#
# Environment: HOSTPID_BROKER_DIRECTORY (default /var/run/hami/hostpid, which
# needs root) and HOSTPID_WEB_ENDPOINT (default tcp:8080:interface=127.0.0.1).
import os

from twisted.application import service, strports
from twisted.internet.defer import CancelledError
from twisted.web import resource, server

import hostpid
from hostpid.broker.refusal import RefuseInOneLine

directory = os.environ.get("HOSTPID_BROKER_DIRECTORY", "/var/run/hami/hostpid")
web_endpoint = os.environ.get("HOSTPID_WEB_ENDPOINT", "tcp:8080:interface=127.0.0.1")

# The site asks its own broker directly, not through a workload's read-only
# mount: that one check is turned off by name; every other check stays on,
# and the UID to trust is this process's own, since the broker runs in it.
policy = hostpid.TrustPolicy(
    socket_path=os.path.join(directory, "broker.sock"), trusted_uid=os.geteuid()
).without("read-only-mount")


class HostPid(resource.Resource):
    isLeaf = True

    def render_GET(self, request):
        asked = hostpid.query_host_pid_deferred(policy)

        def answered(pid):
            request.setHeader(b"content-type", b"text/plain")
            request.write(b"%d\n" % pid)
            request.finish()

        def unavailable(failure):
            if failure.check(CancelledError):
                return  # the client went away first
            failure.trap(hostpid.HostPidUnavailable)
            request.setResponseCode(503)
            request.setHeader(b"content-type", b"text/plain")
            request.write(f"{failure.value}\n".encode())
            request.finish()

        asked.addCallbacks(answered, unavailable)
        request.notifyFinish().addErrback(lambda _: asked.cancel())
        return server.NOT_DONE_YET


application = service.Application("device-plugin")

# RefuseInOneLine: a refused start is one line on stderr and exit status 1,
# as with `twistd hostpid-broker`, instead of a traceback in the log.
top = RefuseInOneLine()
top.setServiceParent(application)

# The broker first: if it refuses to start, the site never starts serving.
# Without onFatal, a broker that stops serving later ends the process
# (status 1) so the supervisor restarts it.
hostpid.BrokerService(directory=directory).setServiceParent(top)
strports.service(web_endpoint, server.Site(HostPid())).setServiceParent(top)
