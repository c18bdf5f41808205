"""The bucket rebuild's broadcast before step 2, under live recovery (`engine/reducer.py`).

The one rebuild re-buckets every rank in rank 0's observed ready order, which rank 0
broadcasts at the second synchronised forward. Ranks finish a broadcast at different
moments: with three ranks and rank 1 lost there, rank 2 had the order from rank 0 and
was inside step 2's backward while rank 0 still waited on its send to rank 1. Run the
broadcast again and the two are in different collectives (gloo aborts on the size
mismatch). So the broadcast is a recovery point at the step's start
(`runtime/recovery.py`): a loss met there is recovered as at the start of step 2, as
the buffer broadcast's is, and nobody broadcasts the order again:

- rank 0 posts its order in the launcher's store before it broadcasts (`post`); a
  rank still in the broadcast takes the order from that post (`posted`);
- rank 0 lost before it posted: then no rank has the order, and the donor, itself
  in the broadcast, posts its own observed order while it hands over (`agreed`: the
  same as rank 0's unless the ranks' graphs differ);
- the replacement adopts the rebuilt layout and never runs the rebuild;
- with buffers broadcast at every forward, that broadcast comes next in the same
  forward: a rank recovered here takes what it carries too (`LiveDDP.skip_opening`).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lockstep.live import keys, lines, registry, sealed, wire
from lockstep.runtime.recovery import Point

POST_WAIT_S = 30.0


def _key() -> str:
    return keys.in_round(keys.REBUILD)  # one rebuild per process lifetime


def post(order: list[int]) -> None:
    """Rank 0, before it broadcasts its order: the same order, in the store."""
    if dist.get_rank() == 0:
        sealed.put_bytes(registry.store(), _key(), wire.pack(list(order)))


def agreed(own: list[int]) -> list[int]:
    """The donor, in the broadcast at a hand-over: rank 0's posted order, else its own
    (posted now, before the state goes over, so that every survivor reads the same)."""
    store, key = registry.store(), _key()
    data = sealed.read_bytes(store, key)
    if data is not None:
        return wire.unpack(data)
    sealed.put_bytes(store, key, wire.pack(list(own)))
    return list(own)


def posted() -> list[int]:
    """The order posted by rank 0 or by the donor (which posts before it hands over).

    Raises:
        LockstepError: nobody posted it in time (the donor was not in the broadcast:
            it met the loss elsewhere, and the survivors disagree on where they are).
    """
    store, key = registry.store(), _key()
    try:
        store.wait([key], timedelta(seconds=POST_WAIT_S))
    except RuntimeError as error:  # torch's store raises on its timeout
        raise lines.fallback(
            f"rank {dist.get_rank()} met the loss in {Point.REBUILD.value}, but neither rank 0 "
            f"nor the donor posted the order within {POST_WAIT_S:.0f} s"
        ) from error
    data = sealed.read_bytes(store, key)
    if data is None:
        raise lines.fallback(
            f"rank {dist.get_rank()} met the loss in {Point.REBUILD.value}, but the order posted "
            f"under {key} does not open (named above)"
        )
    return wire.unpack(data)
