"""
The node (allocation) side: the lock parent and broker mountpoint
(L{lockparent}) and the patching of a kubelet allocation response
(L{allocation}).
"""
