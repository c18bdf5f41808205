"""Which pass over its data fed this rank's batch: counted from torch's DataLoader iterators.

Ranks with uneven data (one rank has a batch fewer per epoch) run out at
different steps; with an epoch loop the short rank starts its next epoch while
the others finish theirs, and from then on their all-reduces pair different
steps in silence. To see that, every DataLoader iterator gets a serial number
when it starts a pass (its first batch, or `_reset` of a persistent one),
and each batch it yields records that serial. The engine counts, per rank, how
many different passes have fed its synchronised steps (`DataPasses.seen`); the
step fingerprint (`lockstep.runtime.fingerprint`) compares that count across
ranks. Installed once, when the first model is wrapped; a batch that does not
come from a DataLoader leaves the count unchanged.

A rank that read no batch from a DataLoader since its last step is fed by another
rank (Accelerate's `dispatch_batches`: rank 0 reads and broadcasts every rank's
slice): it says 0, "not reading", and takes no part in the comparison. What the
check guards is that the ranks' data comes from one pass; the rank that reads for
all of them decides that alone.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch.utils.data import dataloader

_serials = itertools.count(1)
_last_serial = [0]  # the pass that yielded the most recent batch in this process
_reads = [0]  # batches asked of DataLoader iterators in this process
_installed = [False]
_CONTINUES = -1  # `DataPasses.adopt`: the next pass seen is the one counted already


def install() -> None:
    """Make DataLoader iterators record their pass (idempotent, process-wide)."""
    if _installed[0]:
        return
    _installed[0] = True
    base = dataloader._BaseDataLoaderIter
    original_reset, original_next = base._reset, base.__next__

    def _reset(self: Any, loader: Any, first_iter: bool = False) -> None:
        original_reset(self, loader, first_iter)
        self._lockstep_pass = next(_serials)  # a persistent iterator's new pass

    def __next__(self: Any) -> Any:
        serial = self.__dict__.get("_lockstep_pass")
        if serial is None:  # a new iterator's first batch
            serial = self._lockstep_pass = next(_serials)
        _last_serial[0] = serial
        _reads[0] += 1
        return original_next(self)

    base._reset = _reset
    base.__next__ = __next__


class DataPasses:
    """How many passes over the data have fed this rank's synchronised steps."""

    def __init__(self) -> None:
        install()
        self.seen = 0
        self._current = 0
        self._reads = _reads[0]

    def note_step(self) -> int:
        """Called at each synchronised forward; returns the count of passes so far, or 0
        when this rank read no batch since its last step (another rank reads for it)."""
        serial = _last_serial[0]
        if serial != self._current:
            self.seen += self._current != _CONTINUES
            self._current = serial
        read, self._reads = _reads[0] != self._reads, _reads[0]
        return self.seen if read else 0

    def adopt(self, seen: int, continues: bool) -> None:
        """A live replacement takes a peer's count as of the last finished step; its first
        pass continues the peer's pass (a resumed epoch) or is a new one."""
        self.seen, self._current = seen, _CONTINUES if continues else 0
