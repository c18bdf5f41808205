"""The bucket rebuild's broadcast before step 2, under live recovery (`engine/reducer.py`).

The one rebuild re-buckets every rank in rank 0's observed ready order, which rank 0
broadcasts at the second synchronised forward. Ranks finish a broadcast at different
moments: with three ranks and rank 1 lost there, rank 2 had the order from rank 0 and
was inside step 2's backward while rank 0 still waited on its send to rank 1. Run the
broadcast again and the two are in different collectives (gloo aborts on the size
mismatch). So a loss met there is recovered as at the start of step 2, as the buffer
broadcast's is (`live/buffers.py`), and nobody broadcasts the order again:

- rank 0 posts its order in the launcher's store before it broadcasts; a rank still
  in the broadcast takes the order from that post;
- rank 0 lost before it posted: then no rank has the order, and the donor, itself
  in the broadcast, posts its own observed order while it hands over (the same as
  rank 0's unless the ranks' graphs differ);
- the replacement adopts the rebuilt layout and never runs the rebuild;
- with buffers broadcast at every forward, that broadcast comes next in the same
  forward: a hand-over meanwhile gives what it carries, and a rank recovered here
  takes that too and skips it (`live/ddp.py` `opening`, `skip_opening`).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep.errors import LockstepError
from lockstep.live import registry as live
from lockstep.live import wire as live_wire
from lockstep.live.points import between_steps

WHAT = "the bucket rebuild's broadcast before step 2"
POST_WAIT_S = 30.0


def _key() -> str:
    return live.round_key("rebuild_order")  # one rebuild per process lifetime


def broadcast_order(order: torch.Tensor, root: int, group: dist.ProcessGroup | None) -> list[int]:
    """Rank 0's ready order on every rank; a rank lost meanwhile is recovered here.

    Args:
        order: this rank's observed ready order (rank 0's is sent).
        root: rank 0's global rank.
        group: the replicas' group (the default one: live recovery refuses others).
    """
    if dist.get_rank() == root:
        live.store().set(_key(), live_wire.pack(order.tolist()))
    work = dist.broadcast(order, root, group=group, async_op=True)
    engines = live.engines()
    with contextlib.ExitStack() as opening:
        for engine in engines:
            opening.enter_context(engine.opening())
        if between_steps(work, WHAT, within_step=True):
            return order.tolist()
    for engine in engines:  # its buffer broadcast and Join's notices: not run, taken
        engine.skip_opening()
    return posted_order()


def agreed_order(own: list[int]) -> list[int]:
    """The donor, in the broadcast at a hand-over: rank 0's posted order, else its own
    (posted now, before the state goes over, so that every survivor reads the same)."""
    store, key = live.store(), _key()
    if store.check([key]):
        return live_wire.unpack(store.get(key))
    store.set(key, live_wire.pack(own))
    return list(own)


def posted_order() -> list[int]:
    """The order posted by rank 0 or by the donor (which posts before it hands over).

    Raises:
        LockstepError: nobody posted it in time (the donor was not in the broadcast:
            it met the loss elsewhere, and the survivors disagree on where they are).
    """
    store, key = live.store(), _key()
    try:
        store.wait([key], timedelta(seconds=POST_WAIT_S))
    except RuntimeError as error:  # torch's store raises on its timeout
        raise LockstepError(
            f"live recovery: rank {dist.get_rank()} met the loss in {WHAT}, but neither "
            f"rank 0 nor the donor posted the order within {POST_WAIT_S:.0f} s; falling "
            "back to the whole-group restart"
        ) from error
    return live_wire.unpack(store.get(key))
