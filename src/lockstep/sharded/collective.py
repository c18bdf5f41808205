"""The bucket collectives of the sharded engine: all-reduce (stage 1), reduce-scatter (2, 3).

Both follow the engine's `BucketCollective` protocol (`engine/collective.py`):
the 1/N rule is decided once, by `Averaging`, and a complete bucket is handed
to `launch`. Stage 1 reuses DDP's `AllReduceMean` as is (every rank gets the
whole averaged gradient and keeps its slice); `ReduceScatterMean` sums and
leaves each rank only its shard, in the bucket's `shard_grad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.engine.bucket import Bucket
from lockstep.engine.collective import AllReduceMean, Averaging, BucketCollective
from lockstep.engine.handles import CollectiveHandle, WorkHandle
from lockstep.engine.transport import NATIVE, Transport
from lockstep.sharded.flat import FlatParam


@dataclass
class ShardBucket(Bucket):
    """A bucket whose reduced result for this rank lands in `shard_grad`."""

    shard_grad: torch.Tensor | None = None


class ReduceScatterMean:
    """Gradients averaged by the engine, then one SUM reduce-scatter per bucket."""

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        return Averaging.for_dtype(self.world_size, dtype) if self.world_size > 1 else None

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        assert isinstance(bucket, ShardBucket) and bucket.shard_grad is not None
        bucket.divide_found_in_place()
        work = dist.reduce_scatter_single(
            bucket.shard_grad, bucket.buffer, group=self.process_group, async_op=True
        )
        return WorkHandle(work)

    def sent_bytes(self) -> int | None:
        return None


def make_collective(
    stage: int, process_group: dist.ProcessGroup | None, world_size: int, local_world_size: int
) -> BucketCollective:
    """The strategy for `stage`: DDP's all-reduce for stage 1, reduce-scatter otherwise."""
    if stage == 1:
        return AllReduceMean(Transport(process_group, NATIVE, local_world_size), world_size)
    return ReduceScatterMean(process_group, world_size)


def bucket_of(flat: FlatParam, collective: BucketCollective, rank: int) -> ShardBucket:
    """A bucket over `flat.full.grad` (found in place, so the engine divides it by N)."""
    grad = flat.full.grad
    assert grad is not None
    bucket = ShardBucket(
        flat.index, [flat.shard], [flat.index], grad, [grad], collective.averaging(grad.dtype)
    )
    bucket.found(grad)
    while hasattr(collective, "inner"):  # a wrapper (the non-finite check): what it wraps
        collective = collective.inner
    if isinstance(collective, ReduceScatterMean):
        bucket.shard_grad = torch.empty_like(flat.shard)
    else:
        start, end = flat.layout.shard_range(rank)
        bucket.shard_grad = grad[start:end]
    return bucket
