"""The data's first-pass agreement under live recovery (`data/agreement.py`).

Before a process's first batch its ranks gather each other's statement about the
data; with `seed=None` every rank then takes rank 0's seed. Ranks finish a gather at
different moments, so a rank lost in it may leave some survivors inside the first
step and others still in the gather. The gather is a recovery point at the step's
start (`runtime/recovery.py`), and under live recovery:

- each rank posts its statement in the launcher's store before the gather (`post`);
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

from typing import Any

import torch.distributed as dist

from lockstep.live import keys, lines, registry, sealed, wire
from lockstep.runtime.recovery import Point

Statement = dict[str, Any]


def _key(rank: int) -> str:
    return keys.in_round(keys.STATEMENT.format(rank=rank))


def post(statement: Statement) -> None:
    """This rank's statement, before the gather (the point's first collective)."""
    sealed.put_bytes(registry.store(), _key(dist.get_rank()), wire.pack(statement))


def taken(replaced: list[int]) -> tuple[int, Statement]:
    """(rank, statement): rank 0's post, or the donor's when rank 0 was lost before it.

    Raises:
        LockstepError: neither had posted.
    """
    store = registry.store()
    donor = registry.donor_of(replaced)
    for rank in (0, donor):
        data = sealed.read_bytes(store, _key(rank))
        if data is not None:
            return rank, wire.unpack(data)
    raise lines.fallback(
        f"rank {dist.get_rank()} met the loss of rank(s) {replaced} in {Point.AGREEMENT.value}, "
        f"but neither rank 0 nor the donor (rank {donor}) had posted its statement"
    )
