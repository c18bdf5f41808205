"""A worker lost after its peers' scripts ended: the run is over, and nothing is restarted.

A rank killed after the job's last collective (in its final save, its last log line)
leaves peers that finish their script and exit 0. No generation can form with them:
a replacement would wait for peers that are gone (LOCKSTEP_TIMEOUT_S, 300 s), and the
whole-group restart after it would train a finished job again from the last
checkpoint. So once a peer's script ended well (`live/keys.py` `ENDED`, which the
worker's bootstrap posts; on this node also the exit watch's note and an exit code
of 0), `LiveReplacer` replaces no lost rank, and stops a replacement already started
for a generation that such a peer never joined. The job then ends failed, with no
restart (`Finish`), once this node's other workers have ended: the lost rank's own
end of script did not run (why failed and not 0: docs/design/live-recovery.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lockstep.live import keys, lines, sealed

FINISH_WAIT_S = 30.0  # the longest wait for this node's other workers to end their script


def ended(store: dist.Store, world_size: int, here: set[int]) -> set[int]:
    """Global ranks whose script ended well: posted in the store (sealed: a stranger's
    post is ignored, `live/sealed.py`), or seen `here` (this node)."""
    if not store.add(keys.ENDED_COUNT, 0):  # nobody posted: one call, whatever the world size
        return set(here)
    posted = {r for r in range(world_size) if sealed.read(store, keys.ENDED.format(rank=r)) == 1}
    return posted | here


def reason(lost: str, ranks: list[int], peers: set[int]) -> str:
    """The launcher's line for a loss after the peers' scripts ended.

    Args:
        lost: what happened to the lost rank(s), e.g. "rank 1 (pid 812) killed by SIGKILL".
        ranks: the lost global ranks.
        peers: the ranks whose script had ended well.
    """
    return lines.finished(
        f"{lost} after rank(s) {sorted(peers)} ended their script: every collective of the "
        f"job had finished, so nothing is left to recover live, but what rank(s) {ranks} "
        "do after their last collective (their end of script: a final save, a last log "
        "line) did not run. Run that part again if it matters (started again, the job "
        "resumes from its last checkpoint)"
    )


@dataclass
class Finish:
    """The run ended with a loss after the peers' scripts: wait for this node's other
    workers to end theirs (at most `FINISH_WAIT_S`), then let torch's poll end the round.

    Attributes:
        ranks: the lost global ranks.
        line: the line logged once, when this was decided.
    """

    ranks: list[int]
    line: str
    deadline: float = field(default_factory=lambda: time.monotonic() + FINISH_WAIT_S)

    def holding(self, pcontext: Any) -> bool:
        """True while a worker of this node still runs and the wait is not over."""
        running = [h for h in pcontext.subprocess_handlers.values() if h.proc.poll() is None]
        return bool(running) and time.monotonic() < self.deadline
