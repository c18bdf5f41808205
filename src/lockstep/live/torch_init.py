"""A replacement whose script makes the group itself: `torch.distributed.init_process_group`.

`lockstep.init()` joins a replacement to its generation's group (`context.join_with`).
A script that calls torch's `init_process_group` itself instead (a torch script under
`lockstep run --engine lockstep`, or one that imports lockstep for its engine only)
made a group on the keys of the job's first group, where no survivor waits: the
replacement then waited in the hand-over's broadcast on that group while the
survivors waited for it in the new one, until the collective timeout
(`LOCKSTEP_TIMEOUT_S`), and the fallback blamed the survivors.

So in a replacement, `install()` (at `import lockstep`, which `lockstep run`'s worker
bootstrap does before the script's first line) wraps `torch.distributed`'s
`init_process_group`: while the process has no group, a call joins its generation's
group with the launcher's rank and world size, whatever rendezvous the script named
(`env://`, `tcp://`, a store); any other call is torch's own. A group made around the
wrap (torch's `distributed_c10d.init_process_group` called directly) is caught at the
replacement's wrap, which falls back at once, naming it (`check_joined`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep.env import read_launch_env, read_timeout
from lockstep.live import group, lines

_WRAPPED = "_lockstep_live_join"  # the attribute that marks torch's function as wrapped


def join_generation(rank: int, world_size: int, timeout: timedelta) -> bool:
    """A replacement joins its generation's group (True), or this process is none (False)."""
    generation = group.start_generation()
    if generation == 0 or not group.live_enabled():
        return False
    group.join(group.worker_store(timeout), generation, rank, world_size, timeout)
    return True


def install() -> None:
    """In a replacement, make torch's `init_process_group` join its generation (idempotent)."""
    if group.start_generation() == 0 or getattr(dist.init_process_group, _WRAPPED, False):
        return
    dist.init_process_group = _joining(dist.init_process_group)


def _joining(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized() or not group.joining():
            return original(*args, **kwargs)
        asked = signature.bind(*args, **kwargs).arguments
        launch = read_launch_env()
        _check_place(asked, launch.rank, launch.world_size)
        timeout = asked.get("timeout") or read_timeout()
        join_generation(launch.rank, launch.world_size, timeout)

    setattr(init_process_group, _WRAPPED, True)
    return init_process_group


def _check_place(asked: dict[str, Any], rank: int, world_size: int) -> None:
    """The script's own rank and world size, where it gives them, are the launcher's.

    Raises:
        LockstepError: they differ (the generation's group has the launcher's places).
    """
    for name, launcher in (("rank", rank), ("world_size", world_size)):
        mine = asked.get(name, -1)
        if mine not in (-1, None) and int(mine) != launcher:
            raise lines.fallback(
                f"a replacement's init_process_group asked for {name}={mine}, where the "
                f"launcher started it with {name}={launcher}: it cannot join the group of "
                "its generation; pass the launcher's RANK and WORLD_SIZE (or neither)"
            )


def check_joined() -> None:
    """A replacement at its wrap: its default group is its generation's.

    Raises:
        LockstepError: the group was made around the wrap: it holds no survivor.
    """
    if group.joined() != group.start_generation():
        raise lines.fallback(
            f"this replacement of generation {group.start_generation()} made its process "
            "group without joining its generation (torch's "
            "distributed_c10d.init_process_group called directly?), on the keys of the job's "
            "first group, where no survivor waits; call torch.distributed.init_process_group "
            "or lockstep.init()"
        )
