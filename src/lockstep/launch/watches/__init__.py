"""The launcher's watches over its workers: progress (stall), exits, and itself (watchdog).

`stall.py` ends a stalled run blaming the rank that stopped; `exits.py` bounds a
worker's exit after its script; `watchdog.py` ends a launcher stuck on a silent store.
"""
