"""Rendezvous and security: where nodes meet, and how each value they exchange is sealed.

`rounds.py` is the rendezvous (rounds at node 0's store); `store.py` the bounded TCP
stores; `secret.py` the job's secret and the seal; `netif.py` the route to the master.
"""
