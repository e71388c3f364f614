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

from __future__ import annotations

import importlib

from hostpid.errors import MissingExtra

#: The protobuf runtimes the checked-in messages (C{api_pb2.py}, C{ttrpc_pb2.py})
#: run on, as C{setup.cfg}'s C{nri} extra requires them: their gencode is 6.30.0
#: (grpcio-tools 1.72.2's protoc), and protobuf guarantees that gencode of major
#: V runs on runtimes of V (not older than the gencode) and V+1
#: (https://protobuf.dev/support/cross-version-runtime-guarantee; its
#: C{google/protobuf/runtime_version.py}, C{ValidateProtobufRuntimeVersion},
#: refuses an older runtime).  Not forcing 7 lets the plugin sit beside a node
#: agent pinned to 6 (opentelemetry-proto 1.42 asks for <7); being an extra lets
#: the rest of the package sit beside any protobuf at all.
PROTOBUF_REQUIREMENT = "protobuf>=6.30.0,<8"
PROTOBUF_OLDEST = (6, 30, 0)
PROTOBUF_NEXT_MAJOR = 8
#: The extra that installs L{PROTOBUF_REQUIREMENT} (C{setup.cfg}).
EXTRA = "nri"


def protobuf_problem(version: tuple[int, int, int] | None) -> str | None:
    """
    Why the protobuf runtime C{version} (C{None}: not importable) cannot run
    the NRI messages, in words that say how to fix it; C{None} if it can.
    """
    if version is None:
        found = "no protobuf runtime is installed"
    elif PROTOBUF_OLDEST <= version and version[0] < PROTOBUF_NEXT_MAJOR:
        return None
    else:
        found = f"protobuf {'.'.join(map(str, version))} is installed"
    return (f"the NRI plugin needs {PROTOBUF_REQUIREMENT}, which the package's '{EXTRA}' extra "
            f"installs, but {found}: install the package with the extra (pip install "
            f"'/path/to/hostpid_broker-VERSION-*.whl[{EXTRA}]', or '.[{EXTRA}]' in a checkout), "
            f"or pip install '{PROTOBUF_REQUIREMENT}' in the plugin's environment")


def _installed_protobuf() -> tuple[int, int, int] | None:
    try:
        from google.protobuf import runtime_version
    except ImportError:
        try:
            package = importlib.import_module("google.protobuf")
        except ImportError:
            return None
        # Before 5.26 protobuf had no runtime_version module: older than any we run on.
        major, minor, patch, *_ = ([*str(package.__version__).split("."), "0", "0"])
        return (int(major), int(minor), int(patch.split("rc")[0] or 0))
    return (runtime_version.MAJOR, runtime_version.MINOR, runtime_version.PATCH)


_problem = protobuf_problem(_installed_protobuf())
if _problem is not None:
    # Raised here, where every module of the plugin is imported through, so that
    # twistd names the extra instead of a VersionError from the generated code.
    raise MissingExtra(_problem)
