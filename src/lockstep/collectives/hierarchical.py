"""Hierarchical all-reduce: sum inside each node, all-reduce among one leader per node, share.

Across nodes the network is the slow link. A flat ring sends 2(N-1)/N of the
tensor out of every rank, and on a ring laid over nodes about two of its hops per
node boundary cross the network. Here each node first reduces onto its leader
(binomial tree over a local group, on the fast intra-node links), only the
leaders all-reduce across the network (a ring among the leaders: one aggregated
payload per node), and each leader broadcasts the result inside its node. The
groups are made once, collectively, by `make_node_groups` (at engine construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep.collectives._p2p import (
    Group,
    ReduceOp,
    Workspace,
    check_args,
    finish_,
    workspace_or_new,
)
from lockstep.collectives.allreduce import all_reduce_ring
from lockstep.collectives.broadcast import broadcast_tree
from lockstep.collectives.reduce import reduce_tree_
from lockstep.collectives.ring import NETWORK_SEGMENT_BYTES


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two sub-groups for the hierarchical all-reduce.

    Attributes:
        local: the group's members on this rank's node; its rank 0 is the node's leader.
        leaders: one rank per node (the lowest global rank on each); None off the leaders.
        num_nodes: how many nodes the group spans.
        size: the size of the whole group (for AVG).
    """

    local: dist.ProcessGroup
    leaders: dist.ProcessGroup | None
    num_nodes: int
    size: int


def _group_timeout(group: Group) -> timedelta | None:
    """The collective timeout of `group`, so sub-groups fail as fast as their parent."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None  # torch's default for new groups


def node_members(ranks: list[int], local_world_size: int) -> list[list[int]]:
    """Global `ranks` by node: global rank g runs on node g // local_world_size.

    Launchers number ranks node by node, so this is where each rank really runs.
    """
    nodes: dict[int, list[int]] = {}
    for global_rank in sorted(ranks):
        nodes.setdefault(global_rank // local_world_size, []).append(global_rank)
    return [nodes[node] for node in sorted(nodes)]


def make_node_groups(process_group: Group, local_world_size: int) -> NodeGroups:
    """Create the per-node groups and the leaders' group. Collective over the default group.

    `torch.distributed.new_group` must be entered by every rank of the default
    group, in one order. So every rank of the default group calls this at the same
    time, each with its own `process_group` (usually the default group itself):
    the ranks first exchange their groups, then all of them create the node groups
    of every distinct group, in one sorted order, and each keeps its own.

    Args:
        process_group: the group to all-reduce over; the default group when None.
        local_world_size: processes per node (the launcher's LOCAL_WORLD_SIZE).

    Returns:
        This rank's `NodeGroups`.
    """
    mine = tuple(sorted(dist.get_process_group_ranks(process_group or dist.group.WORLD)))
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    timeout = _group_timeout(None)
    kept = None
    for ranks in sorted(set(everyone)):  # type: ignore[type-var]
        groups = _create(list(ranks), local_world_size, timeout)
        if ranks == mine:
            kept = groups
    assert kept is not None
    return kept


def _create(
    ranks: list[int], local_world_size: int, timeout: timedelta | None
) -> NodeGroups | None:
    """new_group for each node of `ranks`, then for their leaders; None if this rank is not in."""
    nodes = node_members(ranks, local_world_size)
    me = dist.get_rank()
    local = None
    for members in nodes:
        group = dist.new_group(members, timeout=timeout)
        if me in members:
            local = group
    leader_ranks = [members[0] for members in nodes]
    leaders = dist.new_group(leader_ranks, timeout=timeout)
    if local is None:
        return None
    return NodeGroups(local, leaders if me in leader_ranks else None, len(nodes), len(ranks))


def all_reduce_hierarchical(
    tensor: torch.Tensor,
    groups: NodeGroups,
    op: object = ReduceOp.SUM,
    workspace: Workspace | None = None,
) -> None:
    """Tree-reduce onto each node's leader, ring all-reduce among leaders, tree-broadcast.

    The leaders' ring sends `ring.NETWORK_SEGMENT_BYTES` messages: it crosses the network.

    Args:
        tensor: this rank's contribution; overwritten with the result on every rank.
        groups: from `make_node_groups`, made once.
        op: SUM, AVG, PRODUCT, MIN or MAX; combined in the tensor's dtype.
        workspace: reusable receive buffers; a fresh one when None.

    Raises:
        ValueError: the tensor is not dense and contiguous, or the op is not supported.
    """
    check_args(tensor, op)
    flat = tensor.view(-1)
    workspace = workspace_or_new(workspace)
    inner = ReduceOp.SUM if op == ReduceOp.AVG else op
    reduce_tree_(flat, 0, inner, groups.local, workspace.scratch(flat.numel(), flat))
    if groups.leaders is not None:
        all_reduce_ring(flat, inner, groups.leaders, workspace, NETWORK_SEGMENT_BYTES)
        finish_(flat, op, groups.size)
    broadcast_tree(tensor, 0, groups.local)
