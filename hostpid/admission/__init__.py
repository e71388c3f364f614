"""
The cluster side: an admission webhook that gives GPU pods the broker's CDI
device annotation or its mounts.

L{decision} is the pure rule (a Pod in, a JSON Patch out); L{service} is the
twisted.web AdmissionReview server around it.  This side imports
L{hostpid.node} for the canonical mounts and CDI names, never the broker.
"""
