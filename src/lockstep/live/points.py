"""Live recovery for a collective between two steps.

The Monitor's interval and report, the bucket rebuild's broadcast before step 2
(`live/rebuild.py`), the buffer broadcast at a forward
(`live/buffers.py`): each runs after a step's end and before the next
backward, outside the backward driver. A rank lost in it is recovered as after a
step's end (the two broadcasts: as at the start of the step they open); the caller
goes on without the collective's result (the Monitor) or takes its value from rank
0's post (the broadcasts). docs/multinode.md, "Live recovery".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch.distributed as dist

from lockstep.errors import LockstepError
from lockstep.runtime import waits
from lockstep.live import registry as live
from lockstep.runtime.handles import WorkHandle


def between_steps(
    work: dist.Work,
    what: str,
    within_step: bool = False,
    before_hand_over: Callable[[list[int]], None] | None = None,
) -> bool:
    """Wait for `work`, a collective between two steps; False if a rank was lost in it.

    Under live recovery the lost rank is recovered here, as after a step's end: the
    donor's state is the finished step's, the replacement resumes at the next one and
    never runs this collective, so the caller goes on without its result (the
    Monitor logs this rank's own figures for that interval). `within_step`: the
    collective opens the next step (the buffer broadcast at its forward), and the
    hand-over is the one for a step the survivors finish with the replacement
    (`live/registry.py` `Recovery`): some peers may have finished the collective
    and be inside the step already. `before_hand_over(replaced)`: what this rank
    settles in the new group before the donor sends the state (the sampler's seed).

    Raises:
        RuntimeError: the collective failed and this rank cannot be recovered live.
    """
    try:
        waits.block(WorkHandle(work))
        return True
    except RuntimeError as error:
        if not live.enabled() or isinstance(error, LockstepError):
            raise
        start = time.monotonic()
        replaced = live.rejoin(error)
        if before_hand_over is not None:
            before_hand_over(replaced)
        live.hand_over(replaced, within_step)
    where = "at the start of the step" if within_step else "between steps"
    print(
        f"lockstep [rank {dist.get_rank()}]: live recovery: generation {live.generation()}, "
        f"rank(s) {replaced} replaced during {what}, {where}; "
        f"{time.monotonic() - start:.2f} s standing still",
        file=sys.stderr,
        flush=True,
    )
    return False
