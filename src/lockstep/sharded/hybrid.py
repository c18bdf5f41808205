"""The gradient collective of stages 2 and 3 at its theoretical bytes, flat or hybrid (HSDP).

`RingScatterReduce` is a `BucketCollective` (`runtime/bucket_collective.py`):
the engine divides a complete bucket by N (the whole world), then, on one
communication thread, in bucket order:

1. lockstep's ring reduce-scatter (`collectives/scatter_gather.py`) over the shard
   group, in place on the bucket: each rank sends (S-1)/S of it. gloo's own
   reduce-scatter runs an all-reduce and sends 2(S-1)/S (docs/sharding.md);
2. HSDP only: a SUM all-reduce of this rank's shard over its replica group (the
   ranks holding the same shard on other nodes): 2(R-1)/R of the shard, 1/S of the
   gradient, crosses the slower link.

It counts the bytes each level sends (from the chunk bounds it posts, and the
ring figure of the backend's all-reduce) for `StepStats`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lockstep.collectives._p2p import ReduceOp
from lockstep.collectives.ring import NETWORK_SEGMENT_BYTES, SEGMENT_BYTES
from lockstep.collectives.scatter_gather import ring_reduce_scatter_
from lockstep.collectives.torch_compat import reduce_scatter_single
from lockstep.runtime.averaging import Averaging
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.bucket_collective import BucketCollective
from lockstep.runtime.handles import CollectiveHandle, ThreadHandle
from lockstep.runtime.step_stats import ring_wire_bytes
from lockstep.runtime.threads import Worker
from lockstep.sharded.mesh import ShardMesh
from lockstep.sharded.reduce_scatter import ShardBucket, make_collective

SHARD_LEVEL = "reduce_scatter"
REPLICA_LEVEL = "replica_all_reduce"


def native_scatter_sends_more(process_group: dist.ProcessGroup | None) -> bool:
    """True where the backend's reduce-scatter sends more than (N-1)/N: gloo's is an all-reduce."""
    return dist.is_initialized() and dist.get_backend(process_group) == "gloo"


def ring_fits(process_group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Use lockstep's ring: gloo on CPU tensors (gloo's send and receive take CPU memory only)."""
    return native_scatter_sends_more(process_group) and device.type == "cpu"


class RingScatterReduce:
    """Ring reduce-scatter in the shard group, then (HSDP) all-reduce over the replicas.

    Args:
        mesh: the shard group and, for HSDP, the replica group.
        world_size: N, every rank that adds to a gradient (S x R).
        spans_nodes: the shard group crosses nodes (smaller ring messages).
        ring: lockstep's ring reduce-scatter (gloo, CPU); else the backend's own call.
    """

    scatters = True  # each rank keeps its shard of the result (`ShardBucket.shard_grad`)

    def __init__(self, mesh: ShardMesh, world_size: int, spans_nodes: bool, ring: bool) -> None:
        self.mesh, self.world_size, self.ring = mesh, world_size, ring
        # gloo's own reduce-scatter is an all-reduce: 2(S-1)/S where the ring sends (S-1)/S.
        self.native_factor = 2 if native_scatter_sends_more(mesh.shard_group) else 1
        self.segment_bytes = NETWORK_SEGMENT_BYTES if spans_nodes else SEGMENT_BYTES
        self.sent = {SHARD_LEVEL: 0, REPLICA_LEVEL: 0} if mesh.hybrid else {SHARD_LEVEL: 0}
        self._thread = Worker("lockstep-scatter", owner=self)
        self.stop = self._thread.stop  # the wrapper ends it too (`sharded/engine.py`)

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        return Averaging.for_dtype(self.world_size, dtype) if self.world_size > 1 else None

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        assert isinstance(bucket, ShardBucket) and bucket.shard_grad is not None
        bucket.divide_found_in_place()
        self._count(bucket.shard_grad)
        return ThreadHandle(self._thread.submit(self._run, bucket.buffer, bucket.shard_grad))

    def _run(self, buffer: torch.Tensor, shard_grad: torch.Tensor) -> float:
        """On the thread: the two levels, synchronously; returns when it finished."""
        mesh, n = self.mesh, shard_grad.numel()
        bounds = [i * n for i in range(mesh.shard_size + 1)]
        # shard_grad is the receive buffer of every ring step, then takes the result.
        group = mesh.shard_group
        if self.ring:
            ring_reduce_scatter_(
                buffer, bounds, ReduceOp.SUM, group, shard_grad, self.segment_bytes
            )
            own = mesh.shard_rank
            shard_grad.copy_(buffer[bounds[own] : bounds[own + 1]])
        else:
            reduce_scatter_single(shard_grad, buffer, group=group)
        if mesh.hybrid:
            dist.all_reduce(shard_grad, group=mesh.replica_group)
        return time.perf_counter()

    def _count(self, shard_grad: torch.Tensor) -> None:
        """Bytes this rank sends: S-1 ring steps of one shard each; the replicas' ring."""
        shard_bytes = shard_grad.numel() * shard_grad.element_size()
        factor = 1 if self.ring else self.native_factor
        self.sent[SHARD_LEVEL] += factor * (self.mesh.shard_size - 1) * shard_bytes
        if self.mesh.hybrid:
            self.sent[REPLICA_LEVEL] += ring_wire_bytes(shard_bytes, self.mesh.replica_size)

    def sent_bytes(self) -> int | None:
        return None

    def issues_inline(self) -> bool:
        return False  # on the communication thread

    def take_wire_bytes(self) -> dict[str, int]:
        """Bytes sent per level since the last call (the backward driver calls it each step)."""
        out = dict(self.sent)
        self.sent = dict.fromkeys(self.sent, 0)
        return out


def grad_collective(
    stage: int, mesh: ShardMesh, world_size: int, local_world_size: int, device: torch.device
) -> BucketCollective:
    """The gradient collective of a stage: the backend's where it is at theory, else the ring.

    Stage 1 all-reduces (DDP's `AllReduceMean`); stages 2 and 3 reduce-scatter with
    the backend's own call where it sends (N-1)/N (NCCL), and with lockstep's ring
    where it sends more (gloo, CPU tensors); HSDP adds the replicas' all-reduce.
    """
    ring = ring_fits(mesh.shard_group, device)
    if stage == 1 or (not mesh.hybrid and not ring):
        return make_collective(stage, mesh.shard_group, world_size, local_world_size)
    spans_nodes = mesh.shard_size > local_world_size
    return RingScatterReduce(mesh, world_size, spans_nodes, ring)
