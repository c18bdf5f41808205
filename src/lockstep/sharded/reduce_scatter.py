"""The bucket collectives of the sharded engine: all-reduce (stage 1), reduce-scatter (2, 3).

Both follow the `BucketCollective` protocol (`runtime/bucket_collective.py`):
the 1/N rule is decided once, by `Averaging`, and a complete bucket is handed
to `launch`. Stage 1 reuses DDP's `AllReduceMean` as is (every rank gets the
whole averaged gradient and keeps its slice); `ReduceScatterMean` sums and
leaves each rank only its shard, in the bucket's `shard_grad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.collectives.torch_compat import reduce_scatter_single
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.bucket_collective import AllReduceMean, Averaging, BucketCollective
from lockstep.runtime.handles import CollectiveHandle, WorkHandle
from lockstep.runtime.transport import NATIVE, Transport
from lockstep.sharded.flat import FlatParam
from lockstep.sharded.precision import reduce_input

_EMPTY = torch.empty(0)


@dataclass
class ShardBucket(Bucket):
    """One flat's bucket: its buffer is the step's `full.grad`; this rank's result `shard_grad`.

    Built once per flat; `fill_bucket` points it at the step's gradient and
    `release` lets go of it once the result is taken, so no full gradient
    outlives its collective.
    """

    shard_grad: torch.Tensor | None = None
    scatters: bool = True  # reduce-scatter (stages 2, 3); all-reduce and slice (stage 1)
    flat_nbytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.flat_nbytes

    def release(self) -> None:
        self.buffer, self.views, self.shard_grad, self.found_in_place = _EMPTY, [], None, []


class ReduceScatterMean:
    """Gradients averaged by the engine, then one SUM reduce-scatter per bucket.

    The backend's own call: where it is a ring (NCCL) each rank sends (N-1)/N of
    the bucket; gloo's is an all-reduce, 2(N-1)/N (on CPU tensors lockstep's ring
    replaces it: `sharded/hybrid.py`). The figure reported is what was sent.
    """

    scatters = True  # each rank keeps its shard of the result (`ShardBucket.shard_grad`)

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.sent = 0
        gloo = dist.is_initialized() and dist.get_backend(process_group) == "gloo"
        self.factor = 2 if gloo else 1

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        return Averaging.for_dtype(self.world_size, dtype) if self.world_size > 1 else None

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        assert isinstance(bucket, ShardBucket) and bucket.shard_grad is not None
        bucket.divide_found_in_place()
        self.sent += self.factor * (self.world_size - 1) * bucket.shard_grad.nbytes
        work = reduce_scatter_single(
            bucket.shard_grad, bucket.buffer, group=self.process_group, async_op=True
        )
        return WorkHandle(work)

    def sent_bytes(self) -> int | None:
        return None

    def issues_inline(self) -> bool:
        return True

    def take_wire_bytes(self) -> dict[str, int]:
        """Bytes sent since the last call (the driver calls it each step)."""
        sent, self.sent = self.sent, 0
        return {"reduce_scatter": sent}


def make_collective(
    stage: int, process_group: dist.ProcessGroup | None, world_size: int, local_world_size: int
) -> BucketCollective:
    """The strategy for `stage`: DDP's all-reduce for stage 1, reduce-scatter otherwise."""
    if stage == 1:
        return AllReduceMean(Transport(process_group, NATIVE, local_world_size), world_size)
    return ReduceScatterMean(process_group, world_size)


def shard_bucket(position: int, flat: FlatParam, collective: BucketCollective) -> ShardBucket:
    """The bucket of `flat`, at `position` in launch order; empty until `fill_bucket`."""
    averaging = collective.averaging(flat.dtypes.reduce)
    scatters = getattr(collective, "scatters", False)
    nbytes = flat.layout.padded_numel * flat.dtypes.reduce.itemsize  # what the collective sends
    return ShardBucket(
        position,
        [flat.shard],
        [flat.index],
        _EMPTY,
        [],
        averaging,
        scatters=scatters,
        flat_nbytes=nbytes,
    )


def fill_bucket(bucket: ShardBucket, flat: FlatParam, rank: int) -> None:
    """Point `bucket` at `flat.full.grad` (found in place, so the engine divides it by N).

    Under a mixed-precision policy, at its copy in the reduce dtype (`precision.py`).
    """
    grad = reduce_input(flat)
    bucket.buffer, bucket.views = grad, [grad]
    bucket.found(grad)
    if bucket.scatters:
        bucket.shard_grad = grad.new_empty(flat.layout.shard_numel)
    else:
        start, end = flat.layout.shard_range(rank)
        bucket.shard_grad = grad[start:end]
