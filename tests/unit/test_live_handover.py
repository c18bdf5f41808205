"""The pure pieces of a live hand-over: the data-pass count and the sampler's place.

A replacement resumes inside its peers' epoch or at the start of the next one; its
count of data passes (the step fingerprint's uneven-data check) must then match
theirs (`runtime/data_passes.py`), and the sampler state sent is the one copied at the
last step's end, not the one a loader that has already handed out the next batch holds
(`live/sampler.py`). Every piece a replacement takes is labelled with the finished
steps it is as of, and a replacement refuses a piece of another step
(`live/checkpoint.py` `check_labels`).
"""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from lockstep.data.sampler import ShardedSampler
from lockstep.errors import LockstepError
from lockstep.live import lines
from lockstep.live.checkpoint import check_labels
from lockstep.live.sampler import SamplerPlace, continues
from lockstep.runtime.data_passes import DataPasses


def test_a_replacement_continues_its_peers_pass_or_starts_the_next():
    loader = DataLoader(range(8), batch_size=2)
    resumed = DataPasses()
    resumed.adopt(3, continues=True)  # a position inside the epoch
    batches = iter(loader)
    next(batches)
    assert resumed.note_step() == 3
    next(batches)
    assert resumed.note_step() == 3
    next(iter(loader))  # its next pass is a new one, as at its peers
    assert resumed.note_step() == 4
    fresh = DataPasses()
    fresh.adopt(3, continues=False)  # the epoch was finished: the first pass is new
    next(iter(loader))
    assert fresh.note_step() == 4


def test_continues_reads_the_position_inside_the_epoch():
    state = {"epoch": 1, "seed": 0, "num_samples": 40, "world_size": 2, "shuffle": True}
    assert continues({**state, "position": 16})
    assert not continues({**state, "position": 40})  # finished: the next pass starts one
    assert not continues({**state, "position": 0})
    assert continues(None) and continues({"step": 3})  # unknown: taken to continue


def test_the_place_sent_is_the_one_taken_at_the_last_step_end():
    sampler = ShardedSampler(range(40), batch_size=4, rank=0, world_size=2)
    place = SamplerPlace(sampler, 0)
    indices = iter(sampler)
    for _ in range(4):
        next(indices)
    sampler.mark_consumed(4)
    place.take(1)  # the end of step 0: one finished step
    for _ in range(4):
        next(indices)
    sampler.mark_consumed(8)  # step 1's batch is out; step 1 is interrupted
    assert sampler.state_dict()["position"] == 16  # what the loader holds now
    assert place.handed()["position"] == 8  # what the donor sends: step 1 is read again
    assert place.step == 1  # its label: as of one finished step


def test_a_replacement_refuses_state_labelled_for_another_step():
    sampler = object()
    fine = {"rng": [3, 3], "sampler": 3}
    check_labels(fine, 3, 1, {"sampler": sampler})  # every label says 3: taken
    # a stale random-state post (the race of a rank lost after its step's last
    # collective and before an end-of-step post): the replacement falls back
    with pytest.raises(LockstepError) as stale:
        check_labels({"rng": [3, 2], "sampler": 3}, 3, 1, {"sampler": sampler})
    assert str(stale.value) == (
        "live recovery: the random state of rank 1 (a post as of 2 finished steps) handed to "
        "a replacement that resumes after 3 finished steps: it would compute with another "
        "step's state; falling back to the whole-group restart"
    )
    with pytest.raises(LockstepError, match=r"rank 0 \(no post\) and the sampler's place "):
        check_labels({"rng": [None, 3], "sampler": 2}, 3, 0, {"sampler": sampler})
    check_labels({"rng": [3, 3], "sampler": 2}, 3, 0, {})  # no sampler given: not checked


def test_a_script_that_numbers_its_steps_otherwise_is_told_which_save_is_accepted():
    """`save(4)` after 4 finished steps used to read "saved step 4 where the engine counts
    4 finished steps" (two equal numbers): the line names the rank, the call, the value
    live recovery accepts and what to change."""
    line = lines.miscounted(1, 4, 4)
    assert line.startswith("rank 1: the script called Checkpointer.save(4) after 4 ")
    assert "live recovery accepts save(3) here, the 0-based number of the step just" in line
    assert "range(start, steps)" in line and "restore() + 1" in line
