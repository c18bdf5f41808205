"""Collective algorithms written on torch.distributed point-to-point operations.

Each algorithm is a short loop of sends and receives that you can read, test
against the backend's native collective, and pick for the engine's gradient
all-reduce (`make_allreduce`, or `DistributedDataParallel(allreduce=...)`).
Ranks (`src`, `dst`) are numbered within the group passed. Low precision
(fp16, bf16) is combined in the tensor's own dtype, one rounding per addition,
as NCCL and gloo do. See docs/collectives.md for diagrams and cost models.
"""

from lockstep.collectives._p2p import SUPPORTED_OPS, Workspace, chunk_bounds
from lockstep.collectives.allreduce import (
    all_reduce_halving_doubling,
    all_reduce_naive,
    all_reduce_ring,
    all_reduce_tree,
)
from lockstep.collectives.broadcast import broadcast_linear, broadcast_tree
from lockstep.collectives.hierarchical import (
    NodeGroups,
    all_reduce_hierarchical,
    make_node_groups,
)
from lockstep.collectives.reduce import reduce_tree
from lockstep.collectives.registry import ACCEPTED, AllReduce, AllReduceAlgorithm, make_allreduce
from lockstep.collectives.scatter_gather import (
    all_gather,
    reduce_scatter,
    ring_all_gather_,
    ring_reduce_scatter_,
)

__all__ = [
    "ACCEPTED",
    "SUPPORTED_OPS",
    "AllReduce",
    "AllReduceAlgorithm",
    "NodeGroups",
    "Workspace",
    "all_gather",
    "all_reduce_halving_doubling",
    "all_reduce_hierarchical",
    "all_reduce_naive",
    "all_reduce_ring",
    "all_reduce_tree",
    "broadcast_linear",
    "broadcast_tree",
    "chunk_bounds",
    "make_allreduce",
    "make_node_groups",
    "reduce_scatter",
    "reduce_tree",
    "ring_all_gather_",
    "ring_reduce_scatter_",
]
