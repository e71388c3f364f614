"""
The broker's process without the TLS stack it never uses.

The broker serves a Unix socket and, optionally, plain-HTTP metrics: no TLS.
But with pyOpenSSL installed (C{twisted[tls]}, which the admission webhook
needs, so every install of this package has it), Twisted imports it at
module level wherever it could offer TLS: C{twisted.internet.tcp} (for
C{startTLS}, through C{twisted.internet._newtls}) and
C{twisted.internet.endpoints} (for C{ssl:} endpoints), both of which the
broker imports (its Unix port, its metrics port).  pyOpenSSL brings
C{cryptography}'s Rust extension and OpenSSL's libcrypto: measured on a real
C{twistd hostpid-broker} with the gate on, 48.1 MB of RSS with them and
35.0 MB without (53.8 and 41.5 MB with C{--metrics}).

Both Twisted modules fall back when C{import OpenSSL} fails (their
C{except ImportError} branches), so the broker's twistd plugin calls
L{without_tls} once twistd has chosen it, before the broker's modules are
imported: only C{hostpid-broker} processes are affected, never another
twistd plugin's (the webhook's needs TLS) nor a program that imports
C{hostpid}.
"""

from __future__ import annotations

import sys

#: Modules whose import decides, once, whether the process offers TLS.
_DECIDED_BY = ("OpenSSL", "twisted.internet.tcp", "twisted.internet.endpoints")


def without_tls() -> bool:
    """
    Make C{import OpenSSL} fail in this process from now on, unless it, or
    a Twisted module that would have imported it, is already loaded (then
    nothing is saved, and nothing is taken away).  Returns whether it did.
    """
    if any(name in sys.modules for name in _DECIDED_BY):
        return False
    sys.modules["OpenSSL"] = None  # type: ignore[assignment]
    return True
