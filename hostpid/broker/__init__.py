"""
The broker side: the root service that answers each caller with its own host
PID.  The transaction (L{server}), the listening port (L{port}), the
filesystem rules (L{fsrules}), the PID namespace check (L{pidns}), the
lifecycle service (L{service}), metrics and health (L{metrics}), systemd
readiness (L{sdnotify}), socket activation and the descriptor store
(L{activation}), the handover between an old and a new broker (L{handover})
and the twistd options (L{tap}).
"""
