"""Choose an all-reduce by name: what `DistributedDataParallel(allreduce=...)` resolves.

`make_allreduce` is called collectively, once, when the engine is built: every
rank of the group checks that all ranks asked for the same thing, sub-groups
(for "hierarchical") are created there in one order on every rank, and receive
buffers are kept for the life of the returned callable. The engine then calls it
on each gradient bucket, in bucket order, from its one communication thread.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
import torch.distributed as dist

from lockstep.collectives._p2p import Group, ReduceOp, Workspace
from lockstep.collectives.agreement import differing_ranks, gather_from_ranks
from lockstep.collectives.allreduce import (
    all_reduce_halving_doubling,
    all_reduce_naive,
    all_reduce_ring,
    all_reduce_tree,
)
from lockstep.collectives.hierarchical import (
    all_reduce_hierarchical,
    make_node_groups,
    node_members,
)
from lockstep.collectives.ring import NETWORK_SEGMENT_BYTES
from lockstep.errors import RankMismatchError


class AllReduceAlgorithm(str, Enum):
    """The all-reduce algorithms lockstep can run, by the name users pass."""

    NATIVE = "native"  # the backend's own (NCCL or gloo), torch.distributed.all_reduce
    NAIVE = "naive"  # everything through rank 0, one rank at a time
    TREE = "tree"  # binomial-tree reduce to rank 0, then binomial-tree broadcast
    RING = "ring"  # ring reduce-scatter, then ring all-gather
    HALVING_DOUBLING = "halving_doubling"  # recursive halving, then recursive doubling
    HIERARCHICAL = "hierarchical"  # reduce in each node, ring among leaders, broadcast


ACCEPTED = tuple(algorithm.value for algorithm in AllReduceAlgorithm)

_FLAT = {
    AllReduceAlgorithm.NAIVE: all_reduce_naive,
    AllReduceAlgorithm.TREE: all_reduce_tree,
    AllReduceAlgorithm.RING: all_reduce_ring,
    AllReduceAlgorithm.HALVING_DOUBLING: all_reduce_halving_doubling,
}


class AllReduce:
    """A SUM all-reduce, in place and synchronous, over one process group; from `make_allreduce`.

    Holds its own receive buffers: call it from one thread at a time.
    """

    def __init__(self, algorithm: AllReduceAlgorithm, run: Callable[[torch.Tensor], None]):
        self.algorithm = algorithm
        self._run = run

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the group, in place; returns when this rank has the result."""
        self._run(tensor)

    def __repr__(self) -> str:
        return f"AllReduce({self.algorithm.value})"


def make_allreduce(
    name: str, process_group: dist.ProcessGroup | None, local_world_size: int
) -> Callable[[torch.Tensor], None]:
    """Build the all-reduce named `name` over `process_group`. Collective: call on every rank.

    Every rank of `process_group` calls it; for "hierarchical", every rank of the
    default group (each with its own process group), since sub-groups are made here.

    Args:
        name: one of "native", "naive", "tree", "ring", "halving_doubling", "hierarchical".
        process_group: the group to sum over; the default group when None. The returned
            callable communicates on it alone (and on sub-groups of it made here).
        local_world_size: processes per node (ranks are numbered node by node).
            "hierarchical" builds its node groups from it; "ring" sends smaller messages
            (`ring.NETWORK_SEGMENT_BYTES`) when the group spans nodes.

    Returns:
        A callable that sums a tensor over the group, in place, synchronously.

    Raises:
        RankMismatchError: the ranks passed different names or local world sizes
            (raised on every rank).
        ValueError: the name is unknown, local_world_size is below 1, or it does not
            divide the world size for "hierarchical" (raised on every rank).
    """
    _check_agreement(name, local_world_size, process_group)
    if local_world_size < 1:
        raise ValueError(
            f"make_allreduce expects local_world_size >= 1 (processes per node); found "
            f"{local_world_size}. Pass the launcher's LOCAL_WORLD_SIZE."
        )
    try:
        algorithm = AllReduceAlgorithm(name)
    except ValueError:
        raise ValueError(
            f"unknown all-reduce algorithm {name!r}; expected one of {', '.join(ACCEPTED)}"
        ) from None
    return AllReduce(algorithm, _build(algorithm, process_group, local_world_size))


def _build(
    algorithm: AllReduceAlgorithm, group: Group, local_world_size: int
) -> Callable[[torch.Tensor], None]:
    if algorithm is AllReduceAlgorithm.NATIVE:
        return lambda tensor: dist.all_reduce(tensor, op=ReduceOp.SUM, group=group)
    workspace = Workspace()
    if algorithm is AllReduceAlgorithm.HIERARCHICAL:
        world_size = dist.get_world_size()
        if world_size % local_world_size:
            raise ValueError(
                f"hierarchical all-reduce expects local_world_size to divide the world size "
                f"{world_size}; found {local_world_size}. Pass the launcher's "
                "LOCAL_WORLD_SIZE (DistContext.local_world_size)."
            )
        groups = make_node_groups(group, local_world_size)
        return lambda tensor: all_reduce_hierarchical(tensor, groups, ReduceOp.SUM, workspace)
    if algorithm is AllReduceAlgorithm.RING and _spans_nodes(group, local_world_size):
        return lambda tensor: all_reduce_ring(
            tensor, ReduceOp.SUM, group, workspace, NETWORK_SEGMENT_BYTES
        )
    run = _FLAT[algorithm]
    return lambda tensor: run(tensor, ReduceOp.SUM, group, workspace)


def _spans_nodes(group: Group, local_world_size: int) -> bool:
    """True when the group's ranks run on more than one node (ranks numbered node by node)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return len(node_members(ranks, local_world_size)) > 1


def _check_agreement(name: str, local_world_size: int, group: Group) -> None:
    """Exchange what each rank asked for; raise on every rank if they differ."""
    asked = gather_from_ranks((name, local_world_size), group)
    if differing_ranks(asked):
        listing = ", ".join(f"rank {rank}: ({n!r}, {lws})" for rank, (n, lws) in enumerate(asked))
        raise RankMismatchError(
            "make_allreduce expects the same algorithm name and local_world_size on every "
            f"rank; found (name, local_world_size) per rank: {listing}. Pass the same "
            "allreduce= on every rank."
        )
