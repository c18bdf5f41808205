"""The DDP engine: `DistributedDataParallel` with torch's modes, and `NaiveDataParallel`.

What both engines share (the backward driver, buckets, waits) is `lockstep.runtime`.
"""
