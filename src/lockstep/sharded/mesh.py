"""Who shares shards with whom: the flat layout (one group) and HSDP's two-level mesh.

Flat sharding spreads every unit over all N ranks. Hybrid sharding (HSDP) cuts
the N ranks into N/S shard groups of S consecutive ranks (a node by default) and
replicates across them: rank g holds shard g mod S, and the ranks holding the
same shard on different groups form a replica group. The pure part,
`hybrid_groups`, is unit-tested; `build_mesh` makes the process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lockstep.context import DistContext


@dataclass(frozen=True)
class ShardMesh:
    """This rank's place in the sharding: its shard group and, for HSDP, its replica group.

    Attributes:
        shard_group: the ranks a unit is spread over (None: the default group).
        shard_rank: this rank in `shard_group`: the shard it owns.
        shard_size: S, the number of shards of every unit.
        replica_group: the ranks holding the same shard (None when there is one copy).
        replica_size: how many copies of each shard exist (N / S).
    """

    shard_group: dist.ProcessGroup | None
    shard_rank: int
    shard_size: int
    replica_group: dist.ProcessGroup | None = None
    replica_size: int = 1

    @property
    def hybrid(self) -> bool:
        return self.replica_size > 1


def hybrid_groups(world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The shard groups (consecutive ranks) and the replica groups (same shard) of a world.

    Example: world 4, S = 2 gives shard groups [[0, 1], [2, 3]] and replica groups
    [[0, 2], [1, 3]], torch's 2-D mesh ("replicate", "shard") of `arange(4).view(2, 2)`.
    """
    replicas = world_size // shard_size
    shards = [list(range(r * shard_size, (r + 1) * shard_size)) for r in range(replicas)]
    copies = [list(range(s, world_size, shard_size)) for s in range(shard_size)]
    return shards, copies


def shard_size_problem(world_size: int, shard_size: int, stage: int) -> str | None:
    """What is wrong with a hybrid layout of `shard_size` ranks per group, or None."""
    if stage == 1:
        return (
            "hybrid sharding applies to stages 2 and 3; found stage=1. Use stage=2 "
            "(gradients and optimizer state sharded within the group) or stage=1 without hybrid."
        )
    if shard_size < 1 or world_size % shard_size:
        return (
            f"shard_group_size must divide the world size {world_size}; found {shard_size}. "
            "Pass the number of ranks per node (LOCAL_WORLD_SIZE), or a divisor of it."
        )
    return None


def flat_mesh(process_group: dist.ProcessGroup | None, ctx: DistContext) -> ShardMesh:
    """Every unit spread over the whole group: stages 1 to 3 without hybrid."""
    return ShardMesh(process_group, ctx.rank, ctx.world_size)


def hybrid_mesh(shard_size: int) -> ShardMesh:
    """Make the shard and replica groups of the default group; every rank must call it.

    Every rank creates every group (torch's `new_group` is collective over the
    default group), in the same order, and keeps its own two.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    shards, copies = hybrid_groups(world, shard_size)
    mine = {}
    for kind, lists in (("shard", shards), ("replica", copies)):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return ShardMesh(
        mine["shard"], rank % shard_size, shard_size, mine["replica"], world // shard_size
    )


def resolve_shard_size(hybrid: bool, shard_group_size: int | None, ctx: DistContext) -> int | None:
    """The shard group size asked for: with hybrid, a node's ranks unless given."""
    if hybrid and shard_group_size is None:
        return ctx.local_world_size
    return shard_group_size


def build_mesh(
    process_group: dist.ProcessGroup | None,
    ctx: DistContext,
    stage: int,
    hybrid: bool,
    shard_size: int | None,
) -> ShardMesh:
    """The mesh of a wrapper: flat over `process_group`, or hybrid with `shard_size` ranks.

    Called after the arguments were checked to agree, so every rank raises alike.

    Raises:
        ValueError: hybrid with stage 1, a size that does not divide the world, a
            process group that is not the whole job, or a size without hybrid.
    """
    if not hybrid and shard_size is None:
        return flat_mesh(process_group, ctx)
    problem = _mesh_problem(ctx.world_size, stage, hybrid, shard_size)
    if problem is not None:
        raise ValueError(f"ShardedDataParallel: {problem} (raised on rank {ctx.rank})")
    assert shard_size is not None
    return hybrid_mesh(shard_size)


def _mesh_problem(world_size: int, stage: int, hybrid: bool, shard_size: int | None) -> str | None:
    if not hybrid:
        return f"shard_group_size={shard_size} applies to hybrid sharding; pass hybrid=True"
    assert shard_size is not None
    if world_size != dist.get_world_size():
        return (
            f"hybrid sharding builds its groups from the whole job; found a process group "
            f"of {world_size} of {dist.get_world_size()} ranks. Pass process_group=None."
        )
    return shard_size_problem(world_size, shard_size, stage)
