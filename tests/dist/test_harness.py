"""The multi-rank harness itself: results come back per rank, failures and hangs are reported."""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch
import torch.distributed as dist

from lockstep.testing import RankFailure, run_ranks


def _sum_of_ranks(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return (ctx.rank, ctx.world_size, t.item())


def _raise_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 waits here for a rank that never arrives


def _hang_forever(ctx):
    if ctx.rank == 0:
        time.sleep(3600)


def _native_crash_on_rank_one(ctx):
    if ctx.rank == 1:
        ctypes.string_at(0)  # a real SIGSEGV, inside native code
    return ctx.rank


def _exit_early_on_rank_one(ctx):
    if ctx.rank == 1:
        os._exit(0)
    return ctx.rank


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_per_rank_match_native_all_reduce(world_size):
    results = run_ranks(_sum_of_ranks, world_size)
    expected = float(sum(range(world_size)))
    assert results == [(r, world_size, expected) for r in range(world_size)]


def test_exception_names_rank_and_reaps_others():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2, timeout_s=5)
    assert 1 in info.value.failed_ranks
    assert "rank 1 raised" in str(info.value)
    assert "boom from rank one" in str(info.value)
    assert time.monotonic() - start < 15


def test_hung_rank_fails_within_deadline():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish within 3 s"):
        run_ranks(_hang_forever, 2, deadline_s=3)
    assert time.monotonic() - start < 10


def test_a_rank_that_exits_0_without_a_result_is_named():
    with pytest.raises(RankFailure, match=r"ranks \[1\] exited with code 0") as info:
        run_ranks(_exit_early_on_rank_one, 2)
    assert info.value.failed_ranks == [1]


def test_a_native_crash_is_named_with_its_signal_and_the_python_stack():
    with pytest.raises(RankFailure) as info:
        run_ranks(_native_crash_on_rank_one, 2)
    message = str(info.value)
    assert info.value.failed_ranks == [1], message
    assert "rank 1 died by signal SIGSEGV" in message, message
    assert "_native_crash_on_rank_one" in message, message  # faulthandler's stack
