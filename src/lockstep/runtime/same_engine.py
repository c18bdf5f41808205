"""Construction-time check that every rank built lockstep's engine, not torch's on some.

Under a framework, a rank the framework started itself (Lightning's relaunch of the
other ranks, `ddp_spawn`, `mp.spawn`) may build torch's `DistributedDataParallel`
while the others build lockstep's: their collectives would never pair, and the job
would hang. So lockstep's first collective at wrap time has the shape of torch's
first one (an all-gather of one int64 per rank, where torch sends its parameter
count): lockstep sends a negative mark no count can equal. Each side then sees the
other: lockstep's ranks raise `RankMismatchError` naming who built which engine,
and torch's ranks raise their own "inconsistent params" error. Nobody hangs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lockstep.errors import RankMismatchError
from lockstep.runtime import recovery
from lockstep.runtime.control_device import control_device

ENGINE_MARK = -0x4C53  # "LS"; torch's first collective at wrap time sends a count >= 0


def engines_of_ranks(process_group: dist.ProcessGroup | None, world_size: int) -> list[bool]:
    """Per rank of the group: whether it built lockstep's engine (one tiny all-gather)."""
    mine = torch.tensor([ENGINE_MARK], dtype=torch.int64, device=control_device(process_group))
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=process_group)
    return [int(value) == ENGINE_MARK for value in everyone]


def verify_same_engine(
    process_group: dist.ProcessGroup | None, rank: int, world_size: int
) -> list[bool]:
    """Raise on every rank that built lockstep's engine unless all ranks did; return the list.

    Raises:
        RankMismatchError: naming the ranks that built torch's engine and what to do.
    """
    lockstep = engines_of_ranks(process_group, world_size)
    if all(lockstep):
        return lockstep
    theirs = [r for r, ours in enumerate(lockstep) if not ours]
    ours = [r for r, ours in enumerate(lockstep) if ours]
    raise RankMismatchError(
        f"on rank {rank}: DistributedDataParallel expected every rank to build lockstep's "
        f"engine; rank(s) {theirs} built torch's, rank(s) {ours} lockstep's "
        "(LOCKSTEP_ENGINE=lockstep). A process a framework starts itself (Lightning's "
        'strategy="ddp" starts the other ranks again, ddp_spawn, mp.spawn) keeps torch\'s '
        "engine unless lockstep's adoption reaches it: install lockstep into the Python "
        "environment the ranks run (its lockstep-engine.pth reads LOCKSTEP_ENGINE in every "
        "process), import lockstep in the script, or launch with `lockstep run` or "
        "torchrun; or unset LOCKSTEP_ENGINE on every rank to keep torch's engine."
    )


def check_engines(init_sync: bool, process_group: dist.ProcessGroup | None) -> bool:
    """At a wrap: check that every rank builds lockstep's engine; whether it was checked.

    Not with `init_sync=False` (torch's wrap makes no collective then), with one rank,
    or in a live replacement (its peers are inside their step, not in a constructor).
    """
    if not (init_sync and dist.is_available() and dist.is_initialized()):
        return False
    world_size = dist.get_world_size(process_group)
    if world_size == 1 or recovery.replacing():
        return False
    verify_same_engine(process_group, dist.get_rank(process_group), world_size)
    return True
