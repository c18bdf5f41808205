"""The sampler's first-pass agreement under live recovery (`data/sampler.py`).

Before a process's first batch its ranks gather each other's statement about the
data (`data/agreement.py`); with `seed=None` every rank then takes rank 0's seed.
Ranks finish a gather at different moments, so a rank lost in it may leave some
survivors inside the first step and others still in the gather. Under live recovery:

- each rank posts its statement in the launcher's store before the gather, which is
  made of asynchronous all-gathers waited interruptibly (`live/points.py`);
- a rank still in the gather when a rank is lost is recovered as at the start of the
  first step: it takes rank 0's posted statement, or, rank 0 lost before it posted
  (then nobody had the statements), the donor's (the lowest surviving rank, whose
  sampler the replacement receives), settles its seed before the donor hands over,
  and goes on into the step without the comparison (made by any peer past the
  gather; the step fingerprint's data-pass count still catches uneven data);
- with buffers broadcast at every forward, it also skips that step's broadcast, whose
  value is its own buffers (`live/buffers.py` `recovered_before_forward`).

Cost while nothing fails: one store write per rank, once per process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep.errors import LockstepError
from lockstep.live import registry as live
from lockstep.live import wire as live_wire
from lockstep.live.points import between_steps

WHAT = "the data's agreement before the first batch"

Statement = dict[str, int | None]


def _key(rank: int) -> str:
    return live.round_key(f"data_statement/{rank}")


def gather(statement: Statement, settle: Callable[[Statement], None]) -> list[Statement]:
    """Every rank's statement; after a loss met here, only the one this rank took.

    Args:
        statement: this rank's (with its shared fields: the seed it drew).
        settle: applies the statement taken after a loss (the seed), before the donor
            hands the state over.
    """
    live.store().set(_key(dist.get_rank()), live_wire.pack(statement))
    taken: list[Statement] = []

    def recovered(replaced: list[int]) -> None:
        rank, posted = _posted(replaced)
        taken.append(posted)
        settle(posted)
        for engine in live.engines():
            engine.recovered_before_forward()
        print(
            f"lockstep [rank {dist.get_rank()}]: live recovery in {WHAT}: took rank {rank}'s "
            "statement",
            file=sys.stderr,
            flush=True,
        )

    gathered = _all_gather(live_wire.pack(statement), recovered)
    if gathered is None:
        return taken
    return [live_wire.unpack(data) for data in gathered]


def _all_gather(data: bytes, recovered: Callable[[list[int]], None]) -> list[bytes] | None:
    """Every rank's bytes (lengths first, then padded); None if a rank was lost."""
    world = dist.get_world_size()
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    work = dist.all_gather(sizes, torch.tensor([mine.numel()]), async_op=True)
    if not between_steps(work, WHAT, within_step=True, before_hand_over=recovered):
        return None
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    every = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    work = dist.all_gather(every, padded, async_op=True)
    if not between_steps(work, WHAT, within_step=True, before_hand_over=recovered):
        return None
    return [bytes(t[: int(n.item())].numpy()) for t, n in zip(every, sizes, strict=True)]


def _posted(replaced: list[int]) -> tuple[int, Statement]:
    """(rank, statement): rank 0's post, or the donor's when rank 0 was lost before it."""
    store = live.store()
    donor = live.donor_of(replaced)
    for rank in (0, donor):
        if store.check([_key(rank)]):
            return rank, live_wire.unpack(store.get(_key(rank)))
    raise LockstepError(
        f"live recovery: rank {dist.get_rank()} met the loss of rank(s) {replaced} in {WHAT}, "
        f"but neither rank 0 nor the donor (rank {donor}) had posted its statement; falling "
        "back to the whole-group restart"
    )
