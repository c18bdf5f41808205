"""Data sharding: each rank reads a disjoint, equal share of every epoch, resumably.

`ShardedSampler` decides which samples each rank reads and remembers where an
epoch stands; `shard()` wraps it in a DataLoader; `agreement` is the pre-flight
check that every rank describes the same data before the first batch.
"""

from lockstep.data.loader import ShardedLoader, WorkerSeeder, shard
from lockstep.data.sampler import ShardedSampler, epoch_order

__all__ = ["ShardedLoader", "ShardedSampler", "WorkerSeeder", "epoch_order", "shard"]
