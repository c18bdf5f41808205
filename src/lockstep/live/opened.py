"""Where the survivors recover: is any of them already at the next step's start?

Ranks finish a collective at different moments: in the BatchNorm soak a survivor had
rank 0's word on a save (a broadcast) and waited in the next forward's buffer
broadcast while the others were still in the save. Recovered "between steps", those
would run that broadcast again with the replacement, and the peer past it would not.
So at each recovery every survivor posts, for the new generation, its finished steps
and whether it recovers inside a step, and reads everyone's: if one with the same
finished steps is inside the next step (or at its start), the next step's opening
broadcasts are not run again by anyone (`Recovery.opened`, `live/registry.py`).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lockstep.live import keys, lines


def opened(
    store: dist.Store,
    generation: int,
    steps: int,
    replaced: list[int],
    within_step: bool,
    wait_s: float,
) -> bool:
    """Whether any survivor recovers inside the step after `steps` finished ones; each
    survivor's post is awaited up to `wait_s`.

    Raises:
        LockstepError: a survivor did not post where it recovers within the bound.
    """
    store.set(
        keys.AT.format(generation=generation, rank=dist.get_rank()), f"{steps} {within_step:d}"
    )
    survivors = [r for r in range(dist.get_world_size()) if r not in replaced]
    posts = [keys.AT.format(generation=generation, rank=r) for r in survivors]
    try:
        store.wait(posts, timedelta(seconds=wait_s))
    except RuntimeError as error:  # torch's store raises on its timeout
        missing = [r for r, key in zip(survivors, posts, strict=True) if not store.check([key])]
        raise lines.fallback(
            f"rank {dist.get_rank()} waited {wait_s:.0f} s for survivor(s) {missing} to say "
            f"where they recover in generation {generation}"
        ) from error
    seen = [tuple(map(int, store.get(key).decode().split())) for key in posts]
    return within_step or any(within and at == steps for at, within in seen)
