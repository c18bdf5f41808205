"""`lockstep run --live-recovery --replace-stuck`: a stuck worker is killed and replaced live.

The stall watch (`launch/watches/stall.py`) names the workers that stopped making progress
while their peers wait in a collective; alone, it ends the round and the whole group
restarts. `StuckReplacer` is that watch with one more act: once the stuck workers'
stacks are in the log, each gets SIGKILL, so its peers' wait fails as at any other
loss and `LiveReplacer` (`launch/recovery/replacer.py`) replaces it at the agent's next look. Until
a replacement (of this loss or any other) has noted progress of its own, its start is
not taken for a stall. A stall where every local worker waits (the stuck rank is
elsewhere) still ends the round.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from torch.distributed.elastic.agent.server.api import Worker

from lockstep.launch.watches.stall import Stall, StallWatch
from lockstep.runtime import progress

log = logging.getLogger("lockstep.run")


class StuckReplacer(StallWatch):
    """The stall watch of `--replace-stuck` (same arguments as `StallWatch`)."""

    def reset(self) -> None:
        super().reset()
        self._replacing: dict[int, progress.Record | None] = {}  # local rank -> record then
        self._pids: dict[int, int | None] = {}

    def check(self, workers: list[Worker], node_rank: int, host: str) -> Stall | None:
        """None when nothing is stuck or the stuck workers were killed for replacement."""
        if self._still_replacing(workers):  # a replacement starting is not a stall (and no
            self._since = time.monotonic()  # stack request: it may not handle the signal yet)
            return None
        stall = super().check(workers, node_rank, host)
        if stall is None:
            return None
        stuck = [w for w in workers if w.local_rank in stall.stuck and w.id]
        if not stuck:
            return stall  # every local rank waits: the round ends, as without the flag
        log.error("%s", stall.message)
        for worker in stuck:
            self._replacing[worker.local_rank] = progress.read(self._progress(worker))
            log.warning(
                "replace-stuck: rank %d (pid %s) is stuck; killed with SIGKILL, to be "
                "replaced live",
                worker.global_rank,
                worker.id,
            )
            with contextlib.suppress(ProcessLookupError):  # it ended: the replacer sees it too
                os.kill(int(worker.id), signal.SIGKILL)
        self._since = time.monotonic()
        return None

    def _still_replacing(self, workers: list[Worker]) -> bool:
        """Forget each replacement once its record changed; True while one has not.

        A worker whose pid changed was replaced live (any loss, not only a stuck one):
        its record is still the lost process's until the replacement writes its own.
        """
        for worker in workers:
            if self._pids.setdefault(worker.local_rank, worker.id) != worker.id:
                record = progress.read(self._progress(worker))
                self._replacing.setdefault(worker.local_rank, record)
                self._pids[worker.local_rank] = worker.id
            if worker.local_rank in self._replacing:
                before = self._replacing[worker.local_rank]
                if progress.read(self._progress(worker)) != before:
                    del self._replacing[worker.local_rank]
        return bool(self._replacing)
