"""The Monitor's interval messages when ranks hold different numbers of steps.

A live replacement joins inside a logging interval and a straggler window, so it
holds fewer steps than its peers; every rank must still send the same message.
Oracles: the losses' means written out by hand, and `analyze` on the steps every
rank has, computed in one process from the same rows.
"""

from __future__ import annotations

import pytest
import torch

from lockstep.errors import RankMismatchError
from lockstep.observe.loss_mean import mean_over_ranks
from lockstep.observe.straggler import StragglerWatch, analyze
from lockstep.runtime.step_stats import BucketRecord, StepStats
from lockstep.testing import RankFailure, run_ranks

# rank 0 has steps 5-8, rank 1 (joined at step 7) has 7-8; rank 0 has no loss at step 6
STEPS = {0: [5, 6, 7, 8], 1: [7, 8]}
LOSSES = {0: [1.0, None, 3.0, 5.0], 1: [torch.tensor(7.0), torch.tensor(9.0)]}


def _means(ctx, last_step_offset: int) -> list[float | None]:
    steps = [s + (last_step_offset if ctx.rank == 1 else 0) for s in STEPS[ctx.rank]]
    return mean_over_ranks(steps, LOSSES[ctx.rank], 4, None, ctx.world_size, ctx.device)


def test_each_steps_loss_is_averaged_over_the_ranks_that_had_it():
    means = run_ranks(_means, 2, 0)
    assert means[0] == [1.0, None, 5.0, 7.0]  # (3 + 7) / 2, (5 + 9) / 2
    assert means[1] == [5.0, 7.0]


def test_ranks_at_different_steps_raise_on_every_rank():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_means, 2, 1)
    assert failure.value.failed_ranks == [0, 1]
    assert RankMismatchError.__name__ in str(failure.value)
    assert "the ranks' step counts differ" in str(failure.value)


def _stats(step: int, rank: int) -> StepStats:
    late = 0.004 * rank + 0.001 * step  # rank 1 readies its buckets later
    buckets = (
        BucketRecord(0, 4000, 2, ready=0.010 + late, launched=0.010, done=0.030),
        BucketRecord(1, 8000, 3, ready=0.014 + late, launched=0.016, done=0.030),
    )
    return StepStats(
        step=step,
        world_size=2,
        forward_seconds=0.005,
        backward_seconds=0.017,
        payload_bytes=12000,
        wire_bytes=12000,
        comm_seconds=0.014,
        exposed_seconds=0.002,
        buckets=buckets,
        start=0.0,
    )


def _window(ctx):
    watch = StragglerWatch(None, ctx.device, ctx.world_size, rows=4)
    for step in STEPS[ctx.rank]:
        watch.record(step, _stats(step, ctx.rank))
    return watch.exchange()


def test_straggler_windows_of_different_lengths_compare_the_common_steps():
    reports = run_ranks(_window, 2)
    rows = [[[_stats(s, r).buckets[b].ready for b in (0, 1)] for s in (7, 8)] for r in (0, 1)]
    ready = torch.tensor(rows, dtype=torch.float64)
    expected = analyze(ready, torch.full((2, 2), 0.030, dtype=torch.float64), 7, 8)
    assert reports[0] == reports[1] == expected
    assert (expected.rank, expected.first_step, expected.last_step) == (1, 7, 8)
