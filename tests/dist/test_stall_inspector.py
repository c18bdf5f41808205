"""Waiting ranks say which ranks have not launched their collective, under any launcher.

Real gloo ranks from `run_ranks` (no lockstep launcher): rank 1 pauses before its
backward at one step while rank 0 waits on its gradient bucket. Rank 0's stall
inspector (warning period 0.4 s) must post its wait to the store, read rank 1's
absence, and name rank 1 in its message and in its progress record; once the wait
is over, its post is withdrawn (a stale one would tell the others it still waits).
The launcher's own decision (`StallWatch.check`) is checked on real progress files.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.elastic.agent.server.api import Worker

import lockstep
from lockstep.launch.watches.stall import StallWatch
from lockstep.runtime import progress, waits
from lockstep.runtime.progress import Phase, Progress
from lockstep.testing import run_ranks


def _pause_rank1_at_step(ctx, pause_step: int, pause_s: float) -> tuple:
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(nn.Linear(4, 2))
    for step in range(3):
        if ctx.rank == 1 and step == pause_step:
            time.sleep(pause_s)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step + 10 * ctx.rank))
        model(x).sum().backward()
    still_posted = waits._store().check([waits.KEY.format(rank=ctx.rank)])
    return (
        waits.inspector().last_message,
        [p.grad.clone() for p in model.parameters()],
        still_posted,
        progress.current().phase,
    )


def test_a_waiting_rank_names_the_rank_that_has_not_launched_its_bucket():
    env = {"LOCKSTEP_STALL_WARN_S": "0.4"}
    results = run_ranks(_pause_rank1_at_step, 2, 2, 2.5, env=env, deadline_s=120)
    message = results[0][0]
    assert "[rank 0]: waited" in message and "of step 3" in message, message
    assert "rank(s) 1 have not launched it" in message, message
    assert results[0][2] is False  # the post ended with the wait
    assert results[0][3] == Phase.SYNCHRONISED  # and so did the waiting phase
    # The pause changed nothing in the arithmetic: both ranks hold the same averaged gradients.
    for mine, theirs in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(mine, theirs)


def test_a_rank_blocked_in_the_bucket_rebuild_is_seen_waiting():
    """The one rebuild of the buckets (before step 2's forward) broadcasts rank 0's ready
    order: a rank blocked there waits on a collective like any other (the stall watch
    once missed it, and a run stuck there never ended)."""
    env = {"LOCKSTEP_STALL_WARN_S": "0.4"}
    results = run_ranks(_pause_rank1_at_step, 2, 1, 1.5, env=env, deadline_s=120)
    message = results[0][0]
    assert "bucket rebuild's broadcast of step 2" in message, message
    assert "rank(s) 1 have not launched it" in message, message


def _workers(n: int) -> list[Worker]:
    return [Worker(local_rank=r, global_rank=r, role_rank=r, world_size=n) for r in range(n)]


def test_the_watch_blames_the_rank_that_is_not_waiting(tmp_path):
    watch = StallWatch(tmp_path, timeout_s=0.3, nnodes=1)  # clears the folder: first
    waiting, stuck = Progress(tmp_path / "0.progress"), Progress(tmp_path / "1.progress")
    waiting.note(Phase.BACKWARD, 3)
    stuck.note(Phase.SYNCHRONISED, 2)
    workers = _workers(2)
    assert watch.check(workers, 0, "host") is None  # progress just happened
    waiting.note(Phase.WAITING, 3, 0, "gradient bucket 0 of step 3")
    assert watch.check(workers, 0, "host") is None
    time.sleep(0.4)
    stall = watch.check(workers, 0, "host")
    assert stall is not None
    first, echo = stall.failures
    assert (first.rank, first.is_echo) == (1, False)
    assert "after step 2 (synchronised)" in first.message
    assert "rank 0 waiting on gradient bucket 0 of step 3" in first.traceback[-1]
    assert (echo.rank, echo.is_echo) == (0, True)


def test_ranks_that_all_compute_slowly_are_not_a_stall(tmp_path):
    watch = StallWatch(tmp_path, timeout_s=0.2, nnodes=1)
    one, two = Progress(tmp_path / "0.progress"), Progress(tmp_path / "1.progress")
    one.note(Phase.BACKWARD, 5)
    two.note(Phase.BACKWARD, 5)
    assert progress.read(tmp_path / "1.progress").step == 5
    watch.check(_workers(2), 0, "host")
    time.sleep(0.3)
    assert watch.check(_workers(2), 0, "host") is None  # nobody waits for anybody
