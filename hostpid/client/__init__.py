"""
The client side: HAMi-core's trust rules (L{trust}), the blocking client
(L{blocking}) and the Twisted client (L{txclient}).
"""
