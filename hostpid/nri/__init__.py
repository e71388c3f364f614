"""
The runtime side: an NRI plugin (C{twistd hostpid-nri}) that gives containers
with a GPU allocation the broker's mounts and gate at creation.

  - L{hostpid.nri.ttrpc}: ttrpc framing, server and client channels;
  - L{hostpid.nri.mux}: NRI's connection multiplexer;
  - L{hostpid.nri.api_pb2}: the NRI messages (from C{api.proto});
  - L{hostpid.nri.plugin}: the plugin protocol on one connection;
  - L{hostpid.nri.decision}: the pure (pod, container) -> adjustment decision;
  - L{hostpid.nri.hostcheck}: the host side it is given (the host paths, the
    broker mountpoint looked at and repaired by L{hostpid.node.lockparent});
  - L{hostpid.nri.service}: metrics, logs, reconnection; L{hostpid.nri.health}
    its HTTP side; L{hostpid.nri.tap}: the twistd options.

Imports L{hostpid.node} (and the webhook's pure L{hostpid.admission.decision.clip}
for bounded log fields), never L{hostpid.broker}.
"""
