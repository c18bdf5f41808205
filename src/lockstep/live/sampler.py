"""The sampler's place under live recovery: taken at each step's end, handed over as is.

A survivor is recovered inside a step whose batch its loader has already handed out,
so its sampler's state at that moment counts one batch more than the steps finished.
`SamplerPlace` copies the state at the end of every synchronised step instead,
labelled with the finished steps it is as of; the donor sends that copy, and the
replacement resumes at the interrupted step's batch: no sample skipped or seen twice.
A `ShardedSampler` states plain ints, the same on every rank, so the donor's copy
fits the replacement; its first pass then skips the agreement the others made.
"""

from __future__ import annotations

import copy
from typing import Any

from lockstep.data.sampler import ShardedSampler


class SamplerPlace:
    """The state of the sampler given to `restore()` as of the last finished step.

    Args:
        sampler: what the script gave `restore()` (None: no sampler).
        step: the finished steps it is as of now.
    """

    def __init__(self, sampler: Any, step: int) -> None:
        self.sampler = sampler
        self.state: Any = None
        self.step = 0  # the finished steps `state` is as of: its label (set by `take`)
        self.take(step)

    def take(self, step: int) -> None:
        """Copy the sampler's state now, as of `step` finished steps (between two steps,
        or at `restore()`)."""
        self.step = step
        if self.sampler is not None:
            self.state = copy.deepcopy(self.sampler.state_dict())

    def handed(self) -> Any:
        """The copy a donor sends, with the seed the ranks agreed on since it was taken.

        With `seed=None` each rank draws its own seed and takes rank 0's at the first
        pass's agreement, inside the first step: the copy taken at `restore()` still
        holds the donor's own draw, and a replacement of rank 0 lost in that step read
        another order than its peers (samples seen twice, others never).
        """
        inner = getattr(self.sampler, "sampler", self.sampler)  # `shard()`'s loader
        if isinstance(inner, ShardedSampler) and inner.agreed and isinstance(self.state, dict):
            return {**self.state, "seed": inner.seed}
        return self.state


def received(sampler: Any) -> None:
    """A replacement loaded its sampler from a peer: no first-pass agreement of its own."""
    inner = getattr(sampler, "sampler", sampler)  # `shard()`'s loader or the sampler
    if isinstance(inner, ShardedSampler):
        inner.agreed_elsewhere()


def continues(state: Any) -> bool:
    """Whether the next pass of a sampler in `state` goes on with an epoch begun already
    (the engine's count of data passes then stays; `runtime/data_passes.py`); True
    when unknown (no sampler, or not lockstep's)."""
    if not isinstance(state, dict) or not {"position", "num_samples"} <= state.keys():
        return True
    return 0 < int(state["position"]) < int(state["num_samples"])
